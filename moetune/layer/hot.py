"""Hot experts: a few routed experts per layer held and computed on the model's device, the rest in the engine.

``gpu_experts`` (``moetune.config.experts``) names a hot set of expert ids per MoE layer. Its experts get a dense
device copy of their base weights (and biases) in the model's dtype, made once from the engine's weights (any
format: ``ExpertFormat.tile``, one expert at a time); the engine keeps its own copy of every expert (host RAM is
unchanged, nothing is re-read) but computes only the slots routed to the others (``SlotSubset``). Per call:

1. the host copies of the routing are queued and waited for (ids are tiny); :meth:`HotExperts.route` splits the
   ``T * k`` slots into hot ones, grouped by expert with their counts known on the host (so the device path
   needs no device-to-host synchronisation), and cold ones;
2. the device path (:meth:`HotExperts.forward`) is queued on the device as ordinary autograd ops: per hot expert
   the same gated MLP as the engine, ``act`` being the engine's own activation object (torch ops, any device),
   with the call's expert LoRA restricted to the hot rows (``index_select`` of the ``[E, ...]`` tensors: the
   gradient flows to the same PEFT parameters, so the saved adapter keeps its layout);
3. the engine computes the cold slots on the host meanwhile, on a worker thread (``moetune.layer.hot_overlap``),
   and the two outputs are summed.

Backward is autograd's: the device path's ops, queued (computed, with ``device="cpu"`` standing in) on the calling
thread while the worker runs the engine's backward for the cold slots (``moetune.layer.hot_overlap``). Results equal
the all-CPU ones up to summation order (fp32: rounding level).
Costs: the engine's inputs become one row per cold slot (``[N_cold, H]`` with ``k = 1``), so what its forward
keeps for backward holds ``N_cold`` rows of x instead of ``T`` (up to k times more for x alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moetune.layer.transfer import to_device

if TYPE_CHECKING:
    from moetune.engine import ExpertEngine, ExpertLoRA


@dataclass(frozen=True)
class SlotSubset:
    """Some of the ``T * k`` routed slots of a call, as rows of their own (``k = 1``) for the engine.

    ``slots`` ``[N]`` int64 host: flat slot indices ``t * k + j`` in ascending order; ``top_k``: k.
    """

    slots: torch.Tensor
    top_k: int

    @property
    def token(self) -> torch.Tensor:
        """``[N]`` int64: the token of each slot."""
        return torch.div(self.slots, self.top_k, rounding_mode="floor")

    def take(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[T, H]``, ids and weights ``[T, k]`` -> the subset's rows ``[N, H]``, ids ``[N, 1]``, weights ``[N, 1]``."""
        return (
            x.index_select(0, self.token),
            ids.reshape(-1).index_select(0, self.slots).unsqueeze(1),
            weights.reshape(-1).index_select(0, self.slots).unsqueeze(1),
        )

    def add_rows(self, rows: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """rows ``[N, H]`` -> ``[T, H]``: each token the sum of its rows (zeros for a token with none)."""
        return rows.new_zeros(num_tokens, rows.shape[1]).index_add_(0, self.token, rows)

    def put_slots(self, values: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """values ``[N, 1]`` -> ``[T, k]``: each at its slot, zeros at the slots not in the subset."""
        out = values.new_zeros(num_tokens * self.top_k)
        return out.index_copy_(0, self.slots, values.reshape(-1)).view(num_tokens, self.top_k)


@dataclass(frozen=True)
class HotRoute:
    """One call's split of its slots: ``hot`` (slots routed to hot experts, grouped by hot expert in hot-id
    order, ``counts[h]`` slots each) and ``cold`` (the engine's)."""

    hot: SlotSubset
    counts: list[int]
    cold: SlotSubset


class HotExperts(nn.Module):
    """The hot experts of one layer: dense device weights and their forward.

    ``ids``: the hot expert ids (sorted, distinct); weights are copied from ``engine`` to ``device`` in ``dtype``:
    gate_up ``[Hn, 2I, H]`` (gate rows first, as the engine), down ``[Hn, H, I]``, biases ``[Hn, 2I]`` /
    ``[Hn, H]``. Buffers, not parameters (they are frozen; full and freeze training refuse hot experts) and not
    persistent (a state dict never carries them: the engine's copy is the one that is saved).
    """

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None

    def __init__(
        self, engine: ExpertEngine, ids: tuple[int, ...], device: torch.device, dtype: torch.dtype
    ) -> None:
        super().__init__()
        assert list(ids) == sorted(set(ids)) and ids and ids[-1] < engine.num_experts, ids
        self.ids = torch.tensor(ids, dtype=torch.int64)  # [Hn] host
        self.act = engine.act
        local = torch.full((engine.num_experts,), -1, dtype=torch.int64)
        local[self.ids] = torch.arange(len(ids))
        self.local = local  # [E] host: expert id -> hot index, -1 for the engine's
        weights = engine.weights
        stacked = {}
        for proj in ("gate_up", "down"):
            rows, cols = weights.shape(proj)
            buf = torch.empty(rows, cols, dtype=dtype)  # a conversion (or dequantization) writes here
            stacked[proj] = torch.stack([weights.tile(proj, e, dtype, buf).clone() for e in ids])
        self.register_buffer("gate_up", stacked["gate_up"].to(device), persistent=False)
        self.register_buffer("down", stacked["down"].to(device), persistent=False)
        for name, bias in (("gate_up_bias", engine.gate_up_bias), ("down_bias", engine.down_bias)):
            held = None if bias is None else bias.detach().index_select(0, self.ids).to(device, dtype)
            self.register_buffer(name, held, persistent=False)

    @property
    def nbytes(self) -> int:
        """Device bytes of the hot weights and biases."""
        return sum(b.nbytes for b in self.buffers())

    def route(self, topk_ids: torch.Tensor) -> HotRoute:
        """topk_ids ``[T, k]`` int64 host -> the split of its slots into hot (grouped by hot expert) and cold."""
        k = topk_ids.shape[1]
        local = self.local[topk_ids.reshape(-1)]  # [N]
        hot = (local >= 0).nonzero().squeeze(1)
        hot = hot[torch.sort(local[hot], stable=True).indices]  # grouped by hot expert, slot order within
        counts = torch.bincount(local[hot], minlength=len(self.ids)).tolist()
        return HotRoute(SlotSubset(hot, k), counts, SlotSubset((local < 0).nonzero().squeeze(1), k))

    def _lora(self, lora: ExpertLoRA, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The hot rows of ``lora`` on the device: A1 ``[Hn, r, H]``, B1 ``[Hn, 2I, r]`` (engine row order), A2
        ``[Hn, r, I]``, B2 ``[Hn, H, r]``; differentiable back to ``lora``'s tensors."""
        a1, b1, a2, b2 = (t.index_select(0, self.ids) for t in lora.tensors())
        if lora.gate_up_rows is not None:
            b1 = b1.index_select(1, lora.gate_up_rows)
        if device.type == "cpu":
            return tuple(t.to(dtype) for t in (a1, b1, a2, b2))
        # through pinned memory: a copy from pageable memory would first wait for the device's queued work
        return tuple(t.pin_memory().to(device, dtype, non_blocking=True) for t in (a1, b1, a2, b2))

    def forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        route: HotRoute,
        lora: ExpertLoRA | None,
        training: bool,
    ) -> torch.Tensor:
        """x ``[T, H]`` and topk_weights ``[T, k]`` on the device -> the hot experts' share of y ``[T, H]`` (x's
        dtype), for the slots of ``route.hot``."""
        t = x.shape[0]
        slots = route.hot
        token = to_device(slots.token, x.device)  # [N_hot]
        xs = x.index_select(0, token)  # [N_hot, H]
        ws = topk_weights.reshape(-1).index_select(0, to_device(slots.slots, x.device)).to(x.dtype)  # [N_hot]
        ab = self._lora(lora, x.device, x.dtype) if lora is not None else None
        p = lora.dropout if lora is not None and training else 0.0
        outs, start = [], 0
        for h, n in enumerate(route.counts):
            if not n:
                continue
            xe = xs[start : start + n]
            start += n
            gu = self._project(xe, self.gate_up[h], self.gate_up_bias, h, ab, 0, lora, p)
            outs.append(self._project(self.act(gu), self.down[h], self.down_bias, h, ab, 2, lora, p))
        if not outs:
            return x.new_zeros(t, x.shape[1])
        ys = torch.cat(outs) * ws.unsqueeze(1)  # [N_hot, H]
        return x.new_zeros(t, x.shape[1]).index_add(0, token, ys)

    def _project(
        self,
        inp: torch.Tensor,
        w: torch.Tensor,
        bias: torch.Tensor | None,
        h: int,
        ab: tuple[torch.Tensor, ...] | None,
        first: int,
        lora: ExpertLoRA | None,
        p: float,
    ) -> torch.Tensor:
        """inp ``[n, D_in]`` @ w ``[D_out, D_in]``^T (+ bias of hot expert h) (+ its LoRA term, A and B at
        ``ab[first]``, ``ab[first + 1]``, the input dropped out with ``p`` as the engine does) -> ``[n, D_out]``."""
        out = inp @ w.t()
        if bias is not None:
            out = out + bias[h]
        if ab is not None and lora is not None:
            a, b = ab[first][h], ab[first + 1][h]
            dropped = F.dropout(inp, p) if p > 0 else inp
            out = out + lora.scaling * ((dropped @ a.t()) @ b.t())
        return out
