"""Which experts' LoRA rows a PEFT expert-LoRA layer holds, and moving tensors between whole and held rows.

Stock PEFT (``ParamWrapper``, and moetune's ``ExpertsLora`` in its layout) keeps one projection's expert LoRA as
``lora_A.weight [E * r, in]`` (expert-major rows: expert e owns rows ``e r .. e r + r - 1``) and
``lora_B.weight [out, r * E]`` (expert-minor columns: expert e owns columns ``j E + e``; viewed ``[out, r, E]``).
With ``expert_parallel: sharded`` a rank holds experts ``first .. first + count - 1`` of E and keeps only their
rows: ``lora_A [count * r, in]`` and ``lora_B [out, r * count]`` in the same layout for ``count`` experts, so
``engine_view`` reads them as ``[count, r, in]`` / ``[count, out, r]``. Every tensor shaped like such a weight
(its gradient, AdamW's moments) moves the same way: :func:`held_part` cuts a whole tensor to a rank's rows,
:func:`joined` puts every rank's parts (in rank order) back into the whole one. Both only index and copy, so a
round trip is exact.

Which rank holds what (:func:`share`): the layer's E routed experts evenly, ``E / world`` each; a LoRA sized for
Z more experts than the E routed ones (LongCat-Flash's gate_up: stock PEFT counts its zero-computation experts,
``[E + Z, 2I, H]``, whose Z rows the engine never reads) keeps those Z rows, which come after the routed ones, on
the last rank, beside its own experts' rows: ``E / world + Z`` there. The parts are then uneven;
:func:`rank_counts` gives every rank's count from any one rank's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

Kind = Literal["A", "B"]


@dataclass(frozen=True)
class HeldRows:
    """Experts ``first .. first + count - 1`` of ``total`` (a layer's E), LoRA rank ``r``, of a ``kind`` tensor."""

    kind: Kind
    r: int
    first: int
    count: int
    total: int

    @property
    def whole(self) -> bool:
        """Every expert's rows are held (one process, or replicated experts)."""
        return self.count == self.total

    def whole_shape(self, held: torch.Size | tuple[int, ...]) -> tuple[int, int]:
        """The whole tensor's shape given a held tensor's."""
        return self.shape_for(held, self.total)

    def shape_for(self, held: torch.Size | tuple[int, ...], experts: int) -> tuple[int, int]:
        """The shape of a part holding ``experts`` experts' rows, given a held tensor's shape."""
        if self.kind == "A":
            return (self.r * experts, held[1])
        return (held[0], self.r * experts)

    def is_whole(self, tensor: torch.Tensor) -> bool:
        """``tensor`` holds every expert's rows (not only this rank's)."""
        dim = 0 if self.kind == "A" else 1
        return tensor.ndim == 2 and tensor.shape[dim] == self.r * self.total


def share(routed: int, total: int, world: int, rank: int) -> tuple[int, int]:
    """(first, count): the experts whose LoRA rows rank ``rank`` of ``world`` holds, of a LoRA sized for ``total``
    experts on a layer of ``routed`` (``routed % world == 0``): its ``routed / world`` routed experts, and on the
    last rank also the ``total - routed`` extra rows after them (zero-computation experts, which no engine
    computes but the adapter holds)."""
    assert routed % world == 0 and total >= routed, (routed, total, world)
    per = routed // world
    return rank * per, per + (total - routed if rank == world - 1 else 0)


def rank_counts(rows: HeldRows, rank: int, world: int) -> list[int]:
    """Every rank's count of experts (rank order) of the tensor whose part ``rows`` is rank ``rank``'s, as
    :func:`share` splits it: equal counts, the last rank's with the extra rows."""
    if world == 1:
        return [rows.count]
    per = rows.count if rank < world - 1 else rows.first // rank
    return [per] * (world - 1) + [rows.total - (world - 1) * per]


def held_part(whole: torch.Tensor, rows: HeldRows) -> torch.Tensor:
    """A: ``[E r, in]`` -> ``[count r, in]``; B: ``[out, r E]`` -> ``[out, r count]``: the held experts' rows,
    a contiguous copy in the same dtype."""
    end = rows.first + rows.count
    if rows.kind == "A":
        return whole.view(rows.total, rows.r, -1)[rows.first : end].reshape(rows.count * rows.r, -1).clone()
    out = whole.shape[0]
    return (
        whole.view(out, rows.r, rows.total)[:, :, rows.first : end].reshape(out, rows.r * rows.count).clone()
    )


def joined(parts: list[torch.Tensor], rows: HeldRows, into: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's held part (rank order, together all ``rows.total`` experts; the counts may differ, as
    :func:`share` splits them) -> the whole tensor; ``into``: a
    contiguous tensor of the whole's number of elements and dtype to write it into (a reused buffer)."""
    shape = rows.whole_shape(parts[0].shape)
    if rows.kind == "A":
        return torch.cat(parts, dim=0, out=None if into is None else into.view(shape))
    out = parts[0].shape[0]
    whole = None if into is None else into.view(out, rows.r, rows.total)
    return torch.cat([p.view(out, rows.r, -1) for p in parts], dim=2, out=whole).reshape(shape)


def expert_axis(tensor: torch.Tensor, rows: HeldRows) -> torch.Tensor:
    """A view of a held (or whole) tensor with the experts on their own axis: A ``[count, r, in]`` (axis 0),
    B ``[out, r, count]`` (axis 2)."""
    if rows.kind == "A":
        return tensor.view(-1, rows.r, tensor.shape[1])
    return tensor.view(tensor.shape[0], rows.r, -1)
