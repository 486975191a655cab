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


def forward_on_host(
    engine: ExpertEngine,
    lora: ExpertLoRA | None,
    training: bool,
    memo: ForwardMemo | None,
    host: HostCopy,
    subset: SlotSubset | None,
    needs_backward: bool,
) -> tuple[torch.Tensor, SavedForward | None]:
    """The engine's forward on the host copies of (x ``[T, H]``, topk_ids ``[T, k]``, topk_weights ``[T, k]``):
    y ``[T, H]`` on the host (only ``subset``'s slots, each as a row of its own, when given) and what its backward
    needs (None without ``needs_backward``). Host work only, so it may run on another thread (``layer.hot_overlap``)."""
    inputs = host.wait()
    num_tokens = inputs[0].shape[0]
    if subset is not None:  # one row per slot of the subset (k = 1)
        inputs = subset.take(*inputs)
    saved: SavedForward | None
    if needs_backward and memo is not None:
        y, saved = memo.forward(engine, *inputs, training=training, lora=lora)
    else:
        y, saved = engine.forward(*inputs, save=needs_backward, training=training, lora=lora)
    return (subset.add_rows(y, num_tokens) if subset is not None else y), saved


def backward_on_host(
    engine: ExpertEngine,
    saved: SavedForward | None,
    subset: SlotSubset | None,
    grad_y_host: torch.Tensor,
    sink: ExpertGradBuffer | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]]:
    """grad_y ``[T, H]`` (host) -> the host gradients of x ``[T, H]``, topk_weights ``[T, k]`` and the trained
    tensors (``engine.trained_tensors(saved.lora)`` order); host work only, like :func:`forward_on_host`.
    Full mode's base gradients (only the experts with rows) go to ``sink`` when given (their entries are then
    None: the expert optimizer reads the buffer), else become dense gradients (zeros for experts without rows)."""
    num_tokens = grad_y_host.shape[0]
    if subset is not None:
        grad_y_host = grad_y_host.index_select(0, subset.token)
    grads = engine.backward(saved, grad_y_host)
    grad_x_host, grad_w_host = grads.x, grads.topk_weights
    if subset is not None:
        grad_x_host = subset.add_rows(grad_x_host, num_tokens)
        grad_w_host = subset.put_slots(grad_w_host, num_tokens)
    flat: tuple[torch.Tensor | None, ...] = grads.flat()
    if grads.base is not None:
        if sink is not None:
            assert saved is not None
            sink.add(grads.base, saved.index)
            flat += (None,) * (len(engine.trained_tensors(saved.lora)) - len(flat))
        else:
            flat += tuple(grads.base.dense(engine.base_tensors()).values())
    return grad_x_host, grad_w_host, flat


def keep_saved(ctx: Any, saved: SavedForward | None) -> None:
    """Hand a forward's big tensors to autograd (``ctx.save_for_backward``): it frees them after a backward
    without retain_graph and raises its own "backward through the graph a second time" error on reuse;
    retain_graph keeps them. :func:`kept_saved` gives the forward back in backward."""
    ctx.saved = None
    if saved is not None:
        ctx.save_for_backward(*saved.tensors())
        ctx.saved = saved.with_tensors((None,) * len(saved.TENSOR_FIELDS))


def kept_saved(ctx: Any) -> SavedForward | None:
    """The forward :func:`keep_saved` handed to autograd, its tensors back in place."""
    return ctx.saved.with_tensors(ctx.saved_tensors) if ctx.saved is not None else None


def device_grads(
    engine: ExpertEngine,
    saved: SavedForward | None,
    host_grads: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor | None, ...]],
    needs: tuple[bool, ...],
    x_device: torch.device,
    w_device: torch.device,
) -> tuple[torch.Tensor | None, ...]:
    """(grad x, grad topk_weights, *grads of the trained tensors) as autograd wants them back: x's and the
    weights' on their devices, the trained tensors' in their dtypes, None where ``needs`` (x, weights, trained
    tensors) says no gradient is wanted."""
    grad_x_host, grad_w_host, flat = host_grads
    trained = engine.trained_tensors(saved.lora if saved is not None else None)
    trained_grads = tuple(
        g.to(t.dtype) if need and g is not None else None
        for g, t, need in zip(flat, trained, needs[2:], strict=True)
    )
    grad_x = to_device(grad_x_host, x_device) if needs[0] else None
    grad_w = to_device(grad_w_host, w_device) if needs[1] else None
    return (grad_x, grad_w, *trained_grads)


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
        host = host if host is not None else HostCopy(x, topk_ids, topk_weights)
        y, saved = forward_on_host(engine, lora, training, memo, host, subset, needs_backward)
        keep_saved(ctx, saved)
        ctx.engine, ctx.memo, ctx.subset, ctx.sink = engine, memo, subset, sink
        if saved is not None and sink is not None:
            sink.expect_backward(saved.index)
        ctx.x_device, ctx.w_device = x.device, topk_weights.device
        return to_device(y, x.device)

    @staticmethod
    def backward(ctx: Any, grad_y: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        engine: ExpertEngine = ctx.engine
        saved = kept_saved(ctx)
        if ctx.memo is not None and saved is not None:
            ctx.memo.forget(saved)
        (grad_y_host,) = to_host(grad_y)
        host_grads = backward_on_host(engine, saved, ctx.subset, grad_y_host, ctx.sink)
        needs = (ctx.needs_input_grad[7], ctx.needs_input_grad[9], *ctx.needs_input_grad[10:])
        grad_x, grad_w, *trained_grads = device_grads(
            engine, saved, host_grads, needs, ctx.x_device, ctx.w_device
        )
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
    # no graph (a checkpoint's first pass): no backward to expect
    sink = sink if torch.is_grad_enabled() else None
    return ExpertsFunction.apply(
        engine,
        lora,
        training,
        memo,
        host,
        subset,
        sink,
        x,
        topk_ids,
        topk_weights,
        *engine.trained_tensors(lora),
    )
