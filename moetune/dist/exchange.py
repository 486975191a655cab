"""Expert parallelism on CPUs: the routed slots of a layer go to the ranks that own their experts and back.

Each of ``world`` ranks owns a contiguous block of ``E / world`` experts (:class:`ExpertOwners`). For one MoE
layer on every rank (T tokens, k slots each, the model's own routing):

1. each slot's destination is its expert's owner; slots are sorted by destination (stable) and the per-owner
   counts are exchanged first (``all_to_all_single`` of one int64 per rank), so every buffer is sized exactly;
2. the slot rows ``[N, H]`` and their experts' local ids ``[N]`` go to the owners (``all_to_all_single`` over
   the group: gloo on the CPU);
3. the owner computes its experts on what it received (``local(rows [M, H], local_ids [M]) -> [M, H]``: the
   engine, or any function autograd can differentiate) and the results travel back the same way;
4. the rows return to slot order and the routing weights combine them: ``y[t] = sum_j w[t, j] out[t, j]``.

Backward is the same exchange in reverse (:class:`_AllToAll`): the gradient of the returned rows goes back to
the owners, whose experts' backward produces their weights' gradients (summed over every rank's tokens, so no
all-reduce is needed for sharded expert parameters) and the gradient of the rows they received, which goes
back to the ranks the tokens came from. The routing weights' gradient is the row dot product of step 4, on the
rank of the token. Every rank must call :func:`sharded_experts` for the same layer in the same order (each call
holds collectives), also with T = 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moetune.errors import DistError


@dataclass(frozen=True)
class ExpertOwners:
    """Which rank owns which experts: rank r owns experts ``[r * per_rank, (r + 1) * per_rank)``."""

    num_experts: int
    world: int

    def __post_init__(self) -> None:
        if self.world < 1 or self.num_experts % self.world:
            raise DistError(
                f"{self.num_experts} routed experts cannot be split evenly over {self.world} processes; "
                "sharded experts need the number of processes to divide the number of experts"
            )

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.world


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows ``[N, H]`` with ``send`` rows to each rank and ``recv`` from each; its
    backward sends the gradients back with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        return _exchange(grad.contiguous(), ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: Any) -> torch.Tensor:
    import torch.distributed as dist

    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


def sharded_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    owners: ExpertOwners,
    local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    group: Any = None,
) -> torch.Tensor:
    """The routed experts' output ``y [T, H]`` (x's dtype) for ``x [T, H]``, ``ids [T, k]`` int64 global expert
    ids and ``weights [T, k]`` routing weights, with this rank computing only its own experts through
    ``local`` (module docstring); differentiable in ``x``, ``weights`` and whatever ``local`` uses."""
    import torch.distributed as dist

    t, k = ids.shape
    hidden = x.shape[-1]
    flat = ids.reshape(-1)  # [N = T*k] slot s = token s // k, choice s % k
    dest = torch.div(flat, owners.per_rank, rounding_mode="floor")  # [N] owning rank of each slot
    order = torch.sort(dest, stable=True).indices  # [N] slots grouped by owner
    send_counts = torch.bincount(dest, minlength=owners.world)  # [world] int64
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # exact buffer sizes before the rows move
    send, recv = send_counts.tolist(), recv_counts.tolist()
    local_ids = _exchange((flat[order] % owners.per_rank).unsqueeze(1), send, recv, group).squeeze(1)  # [M]
    rows = _AllToAll.apply(x[torch.div(order, k, rounding_mode="floor")], send, recv, group)  # [M, H]
    back = _AllToAll.apply(local(rows, local_ids), recv, send, group)  # [N, H] in owner order
    out = back[torch.argsort(order)]  # [N, H] back in slot order
    # [T, 1, k] x [T, k, H]: one small product per token, in the rows' dtype
    return torch.bmm(weights.to(out.dtype).unsqueeze(1), out.view(t, k, hidden)).squeeze(1)
