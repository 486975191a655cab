"""Shared experts on the device while the CPU engine computes the routed experts of the same block.

DeepSeek-V2/V3 and GLM-4-MoE blocks compute ``y = experts(x, ids, w) + shared_experts(x)``, in that order,
and the experts call blocks until the CPU engine is done, so a GPU would sit idle during the engine's
work and the shared experts would start only after it. moetune does not touch the block's code; with
the module hooks PyTorch offers on the shared-experts instance (no class is patched), ``CpuExperts``
instead:

1. queues the host copies of its inputs (``moetune.layer.transfer.HostCopy``),
2. calls :meth:`SharedAhead.launch`, which runs ``shared_experts`` on the same tensor now, so its kernels
   are queued behind the copies,
3. waits for the copies only and runs the engine while the device computes the shared experts.

When the block then calls ``shared_experts(t)`` with that same tensor (same storage, size and version,
whatever its view shape), a forward pre-hook hands the module an empty token batch and a forward hook
returns the launched result, viewed to ``t``'s shape: the result and its autograd graph are the ones
``shared_experts(t)`` computes, since a shared MLP works token by token. Any other call (another tensor,
keyword arguments, a block that calls its shared experts first) runs the module as usual. On the CPU the
same steps run; they only change the order of two computations.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

TensorKey = tuple[torch.device, int, int, int]


def _key(t: torch.Tensor) -> TensorKey:
    """Identifies a tensor's data: same storage offset, size and in-place version, any view shape."""
    return (t.device, t.data_ptr(), t.numel(), t._version)


class SharedAhead:
    """Launches one block's shared-experts module early; attached to the module with forward hooks."""

    def __init__(self, shared: nn.Module) -> None:
        self.shared = shared
        self._launching = False
        self._pending: tuple[TensorKey, torch.Tensor] | None = None
        self._swap: torch.Tensor | None = None
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
        self._pending = (_key(x), out)

    def _pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if self._launching:
            return None
        pending, self._pending = self._pending, None  # a result is used once, or dropped
        if pending is None or kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            return None
        x = args[0]
        if _key(x) != pending[0]:
            return None
        out = pending[1]
        self._swap = out.view(*x.shape[:-1], out.shape[-1])
        return (x.reshape(-1, x.shape[-1])[:0],), {}  # the module's own run sees no tokens

    def _post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> torch.Tensor | None:
        swap, self._swap = self._swap, None
        return swap

    def remove(self) -> None:
        """Detach the hooks (the shared module then runs only when the block calls it)."""
        for handle in self.handles:
            handle.remove()
        self._pending = self._swap = None


def attach_shared_ahead(model: nn.Module, experts_paths: list[str], shared_attr: str) -> int:
    """Give each ``CpuExperts`` at ``experts_paths`` a :class:`SharedAhead` for its block's ``shared_attr``
    module (blocks without one are skipped: e.g. DeepSeek layers with ``n_shared_experts=0``); returns how
    many were attached."""
    from moetune.layer.cpu_experts import CpuExperts

    attached = 0
    for path in experts_paths:
        experts = model.get_submodule(path)
        shared = getattr(model.get_submodule(path.rpartition(".")[0]), shared_attr, None)
        if isinstance(experts, CpuExperts) and isinstance(shared, nn.Module):
            experts.shared_ahead = SharedAhead(shared)
            attached += 1
    return attached
