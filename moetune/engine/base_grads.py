"""Full mode's base-weight gradients, kept only for the experts that received tokens.

A routed layer's dense gradient would be ``[E, 2I, H]`` + ``[E, H, I]`` per step even though a batch reaches a
fraction of the experts; a zero-filled dense gradient also makes every untouched expert cost a full pass of
gradient memory. :class:`BaseGrads` is one backward's result, ``{expert: {name: tensor}}`` for the active
experts only, in fp32 (fp64 for an fp64 engine; why fp32: it is summed over micro-batches, and bf16 sums lose
the small late terms). :class:`ExpertGradBuffer` sums them over the micro-batches of one optimizer step, per
expert, and tells a listener when a layer's last pending backward of the step is done (the expert optimizer's
overlap, ``moetune.train.expert_optim``).

Names: ``gate_up`` ``[2I, H]``, ``down`` ``[H, I]``, ``gate_up_bias`` ``[2I]``, ``down_bias`` ``[H]`` (per expert,
the engine's own layout).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from moetune.finite import all_finite

BASE_NAMES = ("gate_up", "down", "gate_up_bias", "down_bias")


@dataclass
class BaseGrads:
    """One backward's base gradients: ``by_expert[e][name]``, only experts with at least one routed row."""

    by_expert: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)

    def dense(self, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every name of ``like`` (``{name: [E, ...] tensor}``) as a dense gradient in that tensor's dtype, zeros
        for the experts without rows: what plain autograd needs when no buffer collects the sparse form."""
        out = {name: torch.zeros_like(t) for name, t in like.items()}
        for e, grads in self.by_expert.items():
            for name, g in grads.items():
                out[name][e].copy_(g)
        return out


class ExpertGradBuffer:
    """Base gradients of one experts module summed over the micro-batches of one optimizer step, per expert.

    ``expect_backward(index)`` notes a differentiated forward (the engine's forward number: activation
    checkpointing's recompute hands autograd the same forward again, ``moetune.layer.memo``, and must not count
    twice); ``add(grads, index)`` sums one backward's :class:`BaseGrads` (thread-safe) and, once every noted
    forward's backward has arrived while ``on_ready`` is set, calls it (the optimizer then updates this layer while
    autograd continues below it). ``take()`` / ``clear()`` empty it (the step, or a skipped step).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.grads: dict[int, dict[str, torch.Tensor]] = {}
        self.pending: set[int] = set()  # forwards of this step whose backward has not run yet
        self.on_ready: Callable[[ExpertGradBuffer], None] | None = None
        self.peak_nbytes = 0  # the most gradient bytes held at once (memory_report)
        self._lock = threading.Lock()

    def expect_backward(self, index: int) -> None:
        with self._lock:
            self.pending.add(index)

    def add(self, grads: BaseGrads, index: int) -> None:
        """Sum ``grads`` in (the first contribution of an expert is kept as is: no zero-filled start)."""
        with self._lock:
            for e, named in grads.by_expert.items():
                mine = self.grads.get(e)
                if mine is None:
                    self.grads[e] = dict(named)
                    continue
                for name, g in named.items():
                    mine[name].add_(g)
            self.pending.discard(index)
            self.peak_nbytes = max(self.peak_nbytes, self.nbytes)
            ready = self.on_ready if not self.pending else None
        if ready is not None:
            ready(self)

    def take(self) -> dict[int, dict[str, torch.Tensor]]:
        """The summed gradients, leaving the buffer empty (a forward noted but never differentiated is forgotten)."""
        with self._lock:
            out, self.grads, self.pending = self.grads, {}, set()
            return out

    def clear(self) -> None:
        """Drop the gradients and the pending count (a skipped step, or the start of the next one)."""
        with self._lock:
            self.grads, self.pending = {}, set()

    @property
    def nbytes(self) -> int:
        return sum(g.nbytes for named in self.grads.values() for g in named.values())

    def non_finite(self) -> list[str]:
        """The names (``BASE_NAMES``) whose held gradient has a NaN/Inf in some expert."""
        bad = {n for named in self.grads.values() for n, g in named.items() if not all_finite(g)}
        return [n for n in BASE_NAMES if n in bad]

    def norm_sq(self) -> torch.Tensor:
        """Sum of squares of every held gradient, fp64 0-d (0 when empty)."""
        total = torch.zeros((), dtype=torch.float64)
        for named in self.grads.values():
            for g in named.values():
                total += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
        return total
