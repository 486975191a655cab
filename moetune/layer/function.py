"""``ExpertsFunction``: the CPU expert engine as a differentiable torch op.

``y = routed_experts(engine, x, topk_ids, topk_weights, lora=lora)``; ``y.sum().backward()`` fills the grads
of x, of topk_weights (the router's gradient) and of every tensor in ``engine.trained_tensors(lora)`` that
requires grad (expert LoRA, the call's own or the engine's, and base weights in full mode). The LoRA tensors
may be views of other parameters (PEFT's ``lora_A`` / ``lora_B``): autograd carries their grads on to those.
Inputs may live on any device; the engine computes on host copies and results return to the device of ``x``
(``moetune.layer.transfer``: pinned staging, non-blocking copies, no device-wide synchronisation).
"""

from __future__ import annotations

from typing import Any

import torch

from moetune.engine import ExpertEngine, ExpertLoRA, SavedForward
from moetune.engine.base_grads import ExpertGradBuffer
from moetune.layer.hot import SlotSubset
from moetune.layer.memo import ForwardMemo
from moetune.layer.transfer import HostCopy, to_device, to_host


class ExpertsFunction(torch.autograd.Function):
    """autograd glue; call through :func:`routed_experts`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        engine: ExpertEngine,
        lora: ExpertLoRA | None,
        training: bool,
        memo: ForwardMemo | None,
        host: HostCopy | None,
        subset: SlotSubset | None,
        sink: ExpertGradBuffer | None,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *trained: torch.Tensor,
    ) -> torch.Tensor:
        needs_backward = any(ctx.needs_input_grad[7:])
        inputs = (host if host is not None else HostCopy(x, topk_ids, topk_weights)).wait()
        ctx.subset, ctx.num_tokens = subset, x.shape[0]
        if subset is not None:  # one row per slot of the subset (k = 1)
            inputs = subset.take(*inputs)
        saved: SavedForward | None
        if needs_backward and memo is not None:
            y, saved = memo.forward(engine, *inputs, training=training, lora=lora)
        else:
            y, saved = engine.forward(*inputs, save=needs_backward, training=training, lora=lora)
        ctx.engine, ctx.memo, ctx.saved, ctx.sink = engine, memo, None, sink
        if saved is not None:
            if sink is not None:
                sink.expect_backward(saved.index)
            # autograd owns the big tensors: it frees them after a backward without retain_graph and raises
            # its own "backward through the graph a second time" error on reuse; retain_graph keeps them.
            ctx.save_for_backward(*saved.tensors())
            ctx.saved = saved.with_tensors((None,) * len(saved.TENSOR_FIELDS))
        ctx.x_device, ctx.w_device = x.device, topk_weights.device
        if subset is not None:
            y = subset.add_rows(y, x.shape[0])
        return to_device(y, x.device)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        engine: ExpertEngine = ctx.engine
        saved = ctx.saved.with_tensors(ctx.saved_tensors) if ctx.saved is not None else None
        if ctx.memo is not None and saved is not None:
            ctx.memo.forget(saved)
        (grad_y_host,) = to_host(grad_y)
        subset: SlotSubset | None = ctx.subset
        if subset is not None:
            grad_y_host = grad_y_host.index_select(0, subset.token)
        grads = engine.backward(saved, grad_y_host)
        grad_x_host, grad_w_host = grads.x, grads.topk_weights
        if subset is not None:
            grad_x_host = subset.add_rows(grad_x_host, ctx.num_tokens)
            grad_w_host = subset.put_slots(grad_w_host, ctx.num_tokens)
        trained = engine.trained_tensors(saved.lora if saved is not None else None)
        flat: tuple[torch.Tensor | None, ...] = grads.flat()
        if grads.base is not None:
            sink: ExpertGradBuffer | None = ctx.sink
            if sink is not None:  # sparse: the expert optimizer reads them from the buffer, no dense .grad
                assert saved is not None
                sink.add(grads.base, saved.index)
                flat += (None,) * (len(trained) - len(flat))
            else:  # plain autograd (any torch optimizer): a dense grad, zeros for experts without rows
                flat += tuple(grads.base.dense(engine.base_tensors()).values())
        trained_grads = tuple(
            g.to(t.dtype) if need and g is not None else None
            for g, t, need in zip(flat, trained, ctx.needs_input_grad[10:], strict=True)
        )
        grad_x = to_device(grad_x_host, ctx.x_device) if ctx.needs_input_grad[7] else None
        grad_w = to_device(grad_w_host, ctx.w_device) if ctx.needs_input_grad[9] else None
        return (None, None, None, None, None, None, None, grad_x, None, grad_w, *trained_grads)


def routed_experts(
    engine: ExpertEngine,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    training: bool = True,
    memo: ForwardMemo | None = None,
    host: HostCopy | None = None,
    lora: ExpertLoRA | None = None,
    subset: SlotSubset | None = None,
    sink: ExpertGradBuffer | None = None,
) -> torch.Tensor:
    """x ``[T, H]``, topk_ids ``[T, k]`` int64, topk_weights ``[T, k]`` -> y ``[T, H]``, differentiable.

    ``lora``: expert LoRA for this call (A ``[E, r, in]``, B ``[E, out, r]``; views allowed) instead of the
    engine's own.
    With ``memo``, a recompute of the same forward (activation checkpointing) reuses it instead of running
    the engine again (see ``moetune.layer.memo``). ``host``: host copies of the three inputs already queued
    by the caller (so device work queued after them overlaps the engine); by default they are made here.
    ``subset``: compute only these slots (``moetune.layer.hot``: the others are the device's), each as a row of
    its own; y and the gradients keep the full ``[T, H]`` / ``[T, k]`` shapes (zeros for slots left out).
    ``sink``: full mode's base gradients go there, sparse (``moetune.engine.base_grads``), instead of into
    dense ``.grad`` tensors of the base weights.
    """
    return ExpertsFunction.apply(
        engine,
        lora,
        training,
        memo,
        host,
        subset,
        sink
        if torch.is_grad_enabled()
        else None,  # no graph (a checkpoint's first pass): no backward to expect
        x,
        topk_ids,
        topk_weights,
        *engine.trained_tensors(lora),
    )
