"""Hot and cold experts of one call at the same time, forward and backward.

With hot experts (``moetune.layer.hot``) a call's slots are split: the engine computes the cold ones on the host,
the model's device the hot ones. The two must run at the same time in both passes, which ordinary autograd does
not give: a single autograd node for the engine runs its backward (on the host, blocking the autograd thread)
before autograd reaches the hot experts' nodes, which were created earlier in forward, so the device would get
its backward work only once the host had finished. Here the engine's share is two autograd nodes around the hot
experts' ops, and its host work runs on a worker thread:

    forward                                            backward (autograd walks the nodes in reverse)
    EngineStart   worker: engine forward, cold slots   EngineStart.backward   wait for the worker; the grads of
      |                                                                       x, topk_weights, expert LoRA
    hot experts   calling thread: queued on the        hot experts' backward  calling thread, meanwhile
      |           device (computed here on the CPU)
    EngineJoin    wait for the worker; y = cold + hot  EngineJoin.backward    host copy of grad_y queued;
                                                                              worker: engine backward

Autograd runs ready nodes of higher creation order first, so after ``EngineJoin``'s backward it takes the hot
experts' nodes (created after ``EngineStart``) before ``EngineStart``'s; the engine's backward is by then under
way on the worker. On CUDA the calling thread only queues the device kernels (the current stream; host copies
through pinned memory ordered by events, ``moetune.layer.transfer``), and grad_y's host copy is queued before the
hot experts' backward kernels, so the engine never waits for them. With ``device="cpu"`` standing in, the calling
thread computes the hot experts while the worker computes the engine, so the overlap is real there too
(``bench/hot_overlap.py`` measures the share of the hot experts' time hidden).

The worker does host work only (the engine on host tensors); every device copy is issued on the calling thread.
One stream suffices: each host copy is queued before the device work it must not wait for. The worker computes
without a graph (as autograd's forward and backward do), in the caller's inference mode and with the caller's
intra-op thread count (torch's count is per thread). One exception to "beside": on the CPU with expert LoRA
dropout in training, both sides would draw masks from the one CPU random generator at once (in an order that
changes from run to run), so there the hot experts run before the engine, forward and backward (logged once).
Results are those of ``ExpertsFunction`` with the same ``subset``: the same engine calls on the same inputs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from moetune.engine import ExpertEngine, ExpertLoRA, SavedForward
from moetune.layer.function import (
    backward_on_host,
    device_grads,
    forward_on_host,
    keep_saved,
    kept_saved,
)
from moetune.layer.hot import SlotSubset
from moetune.layer.memo import ForwardMemo
from moetune.layer.transfer import HostCopy, to_device

T = TypeVar("T")
logger = logging.getLogger(__name__)

_worker: ThreadPoolExecutor | None = None
_worker_lock = threading.Lock()


def _engine_thread() -> ThreadPoolExecutor:
    """The process's one engine worker thread (made on first use; one call's engine runs at a time: autograd
    finishes a layer's backward before it reaches the layer below)."""
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetune-engine")
        return _worker


def _forget_worker_in_child() -> None:
    """A forked child has none of the parent's threads: it starts a worker of its own on first use."""
    global _worker, _worker_lock
    _worker, _worker_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_worker_in_child)


def _submit(fn: Callable[[], T]) -> Future[T]:
    """``fn()`` on the engine worker, with the calling thread's intra-op thread count and inference mode, without
    a graph."""
    threads, inference = torch.get_num_threads(), torch.is_inference_mode_enabled()

    def run() -> T:
        if torch.get_num_threads() != threads:  # the count is per thread; this one takes the caller's
            torch.set_num_threads(threads)
        with torch.inference_mode(inference), torch.no_grad():
            return fn()

    return _engine_thread().submit(run)


@dataclass
class EngineJob:
    """The engine's share (``subset``'s slots) of one call, run on the worker: the forward submitted by
    ``EngineStart`` and collected by ``EngineJoin``, the backward submitted by ``EngineJoin`` and collected by
    ``EngineStart``."""

    engine: ExpertEngine
    lora: ExpertLoRA | None
    training: bool
    memo: ForwardMemo | None
    host: HostCopy
    subset: SlotSubset
    _forward: Future[tuple[torch.Tensor, SavedForward | None]] | None = field(default=None, init=False)
    _backward: Future[tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]] | None = field(
        default=None, init=False
    )
    saved: SavedForward | None = field(default=None, init=False)  # the forward the running backward consumes

    def start_forward(self, needs_backward: bool) -> None:
        args = (self.engine, self.lora, self.training, self.memo, self.host, self.subset, needs_backward)
        self._forward = _submit(lambda: forward_on_host(*args))

    def finish_forward(self) -> tuple[torch.Tensor, SavedForward | None]:
        """y ``[T, H]`` (host) and the saved forward, once the worker is done."""
        assert self._forward is not None, "EngineJoin follows EngineStart"
        future, self._forward = self._forward, None
        return future.result()

    def settle(self) -> None:
        """Wait for a forward still running (the hot experts raised between start and join): the engine is
        then free for the next call."""
        if self._forward is not None:
            future, self._forward = self._forward, None
            future.exception()  # waits; the hot experts' error is the one raised

    def start_backward(self, saved: SavedForward | None, grad_y: torch.Tensor) -> None:
        """grad_y ``[T, H]`` (any device): its host copy is queued now, on the calling thread's stream, so it
        waits for nothing queued after (the hot experts' backward); the worker waits for it, then runs the
        engine's backward."""
        if self.memo is not None and saved is not None:
            self.memo.forget(saved)
        host = HostCopy(grad_y)
        self.saved = saved
        self._backward = _submit(lambda: backward_on_host(self.engine, saved, self.subset, host.wait()[0]))

    def finish_backward(self) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]:
        assert self._backward is not None, "EngineStart's backward follows EngineJoin's"
        future, self._backward = self._backward, None
        return future.result()


class EngineStart(torch.autograd.Function):
    """Submits the engine's forward; its backward collects the engine's backward (module docstring)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        job: EngineJob,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *trained: torch.Tensor,
    ) -> torch.Tensor:
        job.start_forward(needs_backward=any(ctx.needs_input_grad[1:]))
        ctx.job, ctx.x_device, ctx.w_device = job, x.device, topk_weights.device
        return x.new_empty(0)  # a token: EngineJoin's input, so that autograd orders the two nodes

    @staticmethod
    def backward(ctx: Any, _token: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        job: EngineJob = ctx.job
        host_grads = job.finish_backward()
        needs = (ctx.needs_input_grad[1], ctx.needs_input_grad[3], *ctx.needs_input_grad[4:])
        grads = device_grads(job.engine, job.saved, host_grads, needs, ctx.x_device, ctx.w_device)
        job.saved = None
        return (None, grads[0], None, grads[1], *grads[2:])


class EngineJoin(torch.autograd.Function):
    """Collects the engine's forward and adds the hot experts' share; its backward submits the engine's."""

    @staticmethod
    def forward(ctx: Any, job: EngineJob, token: torch.Tensor, y_hot: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y_cold, saved = job.finish_forward()
        keep_saved(ctx, saved)
        ctx.job = job
        return to_device(y_cold, y_hot.device) + y_hot

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.job.start_backward(kept_saved(ctx), grad_y)
        return None, grad_y.new_zeros(0), grad_y


def routed_experts_beside(
    engine: ExpertEngine,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    beside: Callable[[], torch.Tensor],
    *,
    subset: SlotSubset,
    host: HostCopy,
    training: bool = True,
    memo: ForwardMemo | None = None,
    lora: ExpertLoRA | None = None,
) -> torch.Tensor:
    """``routed_experts(..., subset=subset) + beside()``, the engine's share computed (forward and backward) on
    the worker while ``beside()`` (the hot experts: ``[T, H]`` on x's device, differentiable) and its backward run
    on the calling thread. Shapes and arguments as ``routed_experts``; ``host`` (the host copies of x, topk_ids,
    topk_weights, queued by the caller) is required."""
    job = EngineJob(engine, lora, training, memo, host, subset)
    if x.device.type == "cpu" and training and lora is not None and lora.dropout > 0:
        # both sides would draw dropout masks from the one CPU generator at once, in an order that changes from
        # run to run (and the checkpointing memo would miss its forward): beside() first, then the engine
        _log_sequential_once()
        y_beside = beside()
        token = EngineStart.apply(job, x, topk_ids, topk_weights, *engine.trained_tensors(lora))
    else:
        token = EngineStart.apply(job, x, topk_ids, topk_weights, *engine.trained_tensors(lora))
        try:
            y_beside = beside()
        except BaseException:
            job.settle()
            raise
    return EngineJoin.apply(job, token, y_beside)


_logged_sequential = False


def _log_sequential_once() -> None:
    global _logged_sequential
    if not _logged_sequential:
        _logged_sequential = True
        logger.info(
            "moetune: hot experts on the CPU with expert LoRA dropout: computed before the engine, not beside it "
            "(both would draw from the one CPU random generator)"
        )
