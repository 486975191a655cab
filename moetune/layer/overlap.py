"""Shared experts on the device while the CPU engine computes the routed experts of the same block.

DeepSeek-V2/V3 and GLM-4-MoE blocks compute ``y = experts(x.view(-1, H), ids, w) + shared_experts(x)``, in
that order, and the experts call blocks until the CPU engine is done, so a GPU would sit idle during the
engine's work and the shared experts would start only after it. moetune does not touch the block's code;
with the module hooks PyTorch offers on the shared-experts instance (no class is patched), ``CpuExperts``
instead:

1. queues the host copies of its inputs (``moetune.layer.transfer.HostCopy``),
2. calls :meth:`SharedAhead.launch`, which runs ``shared_experts`` on the experts' input now, so its kernels
   are queued behind the copies,
3. waits for the copies only and runs the engine while the device computes the shared experts.

When the block then calls ``shared_experts(t)``, the launched result is handed over only if ``t`` holds the
very data the launch ran on, decided by object identity, never by memory address: the launch keeps a
reference to its input ``x`` (so that tensor object, and the tensor it views, stay alive and cannot be
mistaken for a new one), and ``t`` must be ``x`` itself or a view of the same base tensor object at the same
storage offset with the same elements, both contiguous, with the in-place version counter unchanged. Then a
forward pre-hook hands the module an empty token batch made for this one call, and the forward hook returns
the launched result only for that very empty tensor: the result and its autograd graph are the ones
``shared_experts(t)`` computes, since a shared MLP works token by token. Any other call (another tensor,
keyword arguments, a block that calls its shared experts first, a call whose pre-hook ran but whose forward
never finished, as when activation checkpointing stops a recompute early) runs the module as usual, and a
launched result is offered to the next call only. On the CPU the same steps run; they only change the
order of two computations.

Why hooks and not a module swap: replacing ``shared_experts`` by a wrapper would rename its parameters
(``shared_experts.inner.gate_proj``), and adapters saved from such a model would no longer load in stock PEFT.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def _root(t: torch.Tensor) -> torch.Tensor:
    """The tensor object whose storage ``t`` views (``t`` itself when it is no view)."""
    return t if t._base is None else t._base


def same_data(launched: torch.Tensor, version: int, t: torch.Tensor) -> bool:
    """Whether ``t`` is ``launched`` (taken at in-place ``version``) or a view of the same live tensor object
    over the same elements in the same order, unchanged since. The caller holds ``launched``, so its root
    object cannot be freed and a new tensor in reused memory is never taken for it."""
    if t._version != version:
        return False
    if t is launched:
        return True
    return (
        _root(t) is _root(launched)
        and t.storage_offset() == launched.storage_offset()
        and t.numel() == launched.numel()
        and t.shape[-1] == launched.shape[-1]
        and t.is_contiguous()
        and launched.is_contiguous()
    )


@dataclass
class _Launched:
    """A launch: its input ``x`` [T, H] (held, see ``same_data``), x's version then, and ``out`` [T, H_out]."""

    x: torch.Tensor
    version: int
    out: torch.Tensor


@dataclass
class _Handover:
    """The empty batch the pre-hook gave one call, and the result that call's forward hook returns."""

    empty: torch.Tensor
    out: torch.Tensor


class SharedAhead:
    """Launches one block's shared-experts module early; attached to the module with forward hooks.

    One per module: :func:`attach_shared_ahead` reuses the one already attached.
    """

    def __init__(self, shared: nn.Module) -> None:
        self.shared = shared
        self._launching = False
        self._launched: _Launched | None = None
        self._handover: _Handover | None = None
        self.handles = (
            shared.register_forward_pre_hook(self._pre, with_kwargs=True),
            shared.register_forward_hook(self._post),
        )

    def launch(self, x: torch.Tensor) -> None:
        """Run the shared experts on ``x`` ``[T, H]`` now; the block's own call on the same data reuses it."""
        self._launching = True
        try:
            out = self.shared(x)
        finally:
            self._launching = False
        self._launched = _Launched(x, x._version, out)

    def _pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        self._handover = None  # a handover left by a call that never finished is void
        if self._launching:
            return None
        launched, self._launched = self._launched, None  # a result is offered to the next call only
        if launched is None or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            return None
        t = args[0]
        if not same_data(launched.x, launched.version, t):
            return None
        empty = t.reshape(-1, t.shape[-1])[:0]  # the module's own run sees no tokens
        self._handover = _Handover(empty, launched.out.view(*t.shape[:-1], launched.out.shape[-1]))
        return (empty,), {}

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor | None:
        handover = self._handover
        if handover is None or not args or args[0] is not handover.empty:
            return None  # not the call the pre-hook prepared (e.g. the launch's own run)
        self._handover = None
        return handover.out

    def remove(self) -> None:
        """Detach the hooks (the shared module then runs only when the block calls it)."""
        for handle in self.handles:
            handle.remove()
        self._launched = self._handover = None


def attach_shared_ahead(blocks: list[tuple[Any, nn.Module | None]]) -> int:
    """For each ``(experts, shared)`` pair (a ``CpuExperts`` and its block's shared-experts module; None where
    the block has none, e.g. DeepSeek layers with ``n_shared_experts=0``), give ``experts`` a
    :class:`SharedAhead` for ``shared``, reusing one already attached to that module. Returns how many."""
    attached = 0
    for experts, shared in blocks:
        if shared is None:
            continue
        ahead = getattr(experts, "shared_ahead", None)
        experts.shared_ahead = ahead if ahead is not None and ahead.shared is shared else SharedAhead(shared)
        attached += 1
    return attached
