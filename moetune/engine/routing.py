"""Sort, count, permute and unpermute tokens by expert.

Symbols: T tokens, k experts per token, N = T * k routed rows ("slots"), E experts, H hidden.
A slot ``s = t * k + j`` is token ``t``'s ``j``-th choice. Sorting slots by expert makes each expert's
rows one contiguous segment, so its GEMMs run on views with no further copies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from moetune.errors import EngineError

Segment = tuple[int, int, int]  # expert, first sorted row, end row


def flat_segments(segments: Iterable[Segment]) -> list[int]:
    """``segments`` as one list of ``(expert, start, end)`` triples, the form the compiled run calls take
    (``kernels/ops.h``, ``entry.h``)."""
    return [v for seg in segments for v in seg]


class Run(NamedTuple):
    """Consecutive active experts whose sorted rows are one range: ``segments`` and their rows ``[start, end)``."""

    segments: tuple[Segment, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Dispatch:
    """Where each routed row goes. Built once per forward, reused by its backward."""

    num_tokens: int  # T
    top_k: int  # k
    order: torch.Tensor  # [N] int64: slot index of each sorted row (sorted by expert, stable)
    inverse: torch.Tensor  # [N] int64: sorted position of each slot (inverse permutation of order)
    token: torch.Tensor  # [N] int64: token of each sorted row (order // k)
    counts: tuple[int, ...]  # [E] rows per expert

    def segments(self) -> list[Segment]:
        """``(expert, start, end)`` of each active expert's rows in sorted order."""
        out, start = [], 0
        for e, n in enumerate(self.counts):
            if n:
                out.append((e, start, start + n))
            start += n
        return out

    def runs(self, max_rows: int) -> list[Run]:
        """The active experts' segments grouped into runs of consecutive experts, in order: a run's rows are one
        contiguous range ``[start, end)`` of at most ``max_rows`` rows, or a single expert with more."""
        out: list[Run] = []
        for seg in self.segments():
            if out and seg[2] - out[-1].start <= max_rows:
                out[-1] = Run(out[-1].segments + (seg,), out[-1].start, seg[2])
            else:
                out.append(Run((seg,), seg[1], seg[2]))
        return out

    @property
    def nbytes(self) -> int:
        return self.order.nbytes + self.inverse.nbytes + self.token.nbytes


def validate_routing(
    topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int, num_experts: int
) -> None:
    """Raise :class:`EngineError` naming the problem when ids/weights cannot be routed."""
    if topk_ids.dtype != torch.int64:
        raise EngineError(f"topk_ids must be int64; got {topk_ids.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise EngineError(f"topk_ids must be [T, k] with T = {num_tokens}; got {tuple(topk_ids.shape)}")
    if tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise EngineError(
            f"topk_weights must have the shape of topk_ids {tuple(topk_ids.shape)}; got {tuple(topk_weights.shape)}"
        )
    if not topk_weights.is_floating_point():
        raise EngineError(f"topk_weights must be floating point; got {topk_weights.dtype}")
    k = topk_ids.shape[1]
    if k < 1 or k > num_experts:
        raise EngineError(f"top-k must be in [1, E = {num_experts}]; got k = {k}")
    if topk_ids.numel() == 0:
        return
    lo, hi = int(topk_ids.min()), int(topk_ids.max())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise EngineError(f"expert id {bad} out of range: ids must be in [0, {num_experts - 1}]")
    if k > 1:
        srt = topk_ids.sort(dim=1).values
        dup = (srt[:, 1:] == srt[:, :-1]).any(dim=1)
        if bool(dup.any()):
            t = int(dup.nonzero()[0, 0])
            raise EngineError(
                f"token {t} lists an expert twice in its top-k: {topk_ids[t].tolist()}; each token's k experts "
                "must be distinct"
            )


def dispatch(topk_ids: torch.Tensor, num_experts: int) -> Dispatch:
    """Sort the ``[T, k]`` routed slots by expert (stable, so ties keep slot order: deterministic)."""
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), dtype=order.dtype)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return Dispatch(
        num_tokens=t,
        top_k=k,
        order=order,
        inverse=inverse,
        token=torch.div(order, k, rounding_mode="floor"),
        counts=tuple(counts),
    )


def gather_sorted(rows: torch.Tensor, disp: Dispatch, out: torch.Tensor) -> torch.Tensor:
    """rows ``[T, D]`` -> ``out [N, D]``: each sorted row gets its token's row."""
    return torch.index_select(rows, 0, disp.token, out=out)


def sorted_weights(topk_weights: torch.Tensor, disp: Dispatch) -> torch.Tensor:
    """topk_weights ``[T, k]`` -> ``[N]`` in sorted order."""
    return topk_weights.reshape(-1).index_select(0, disp.order)


def to_slots(sorted_rows: torch.Tensor, disp: Dispatch, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[N, ...]`` in sorted order -> ``[N, ...]`` in slot order (``t * k + j``)."""
    if out is None:
        return sorted_rows.index_select(0, disp.inverse)
    return torch.index_select(sorted_rows, 0, disp.inverse, out=out)


def combine(
    sorted_rows: torch.Tensor, disp: Dispatch, topk_weights: torch.Tensor, scratch: torch.Tensor
) -> torch.Tensor:
    """y[t] = sum_j w[t, j] * rows[slot(t, j)]: ``[N, H]`` sorted -> ``[T, H]`` (fresh tensor).

    ``scratch`` ``[N, H]`` receives the slot-ordered rows; one batched ``[1, k] x [k, H]`` product per token
    does the weighted sum (deterministic, no scatter-add).
    """
    t, k, h = disp.num_tokens, disp.top_k, sorted_rows.shape[1]
    slots = to_slots(sorted_rows, disp, out=scratch).view(t, k, h)
    return torch.bmm(topk_weights.to(slots.dtype).view(t, 1, k), slots).view(t, h)


def sum_slots(sorted_rows: torch.Tensor, disp: Dispatch, scratch: torch.Tensor) -> torch.Tensor:
    """grad_x[t] = sum_j rows[slot(t, j)]: ``[N, H]`` sorted -> ``[T, H]`` (fresh tensor)."""
    t, k, h = disp.num_tokens, disp.top_k, sorted_rows.shape[1]
    return to_slots(sorted_rows, disp, out=scratch).view(t, k, h).sum(dim=1)
