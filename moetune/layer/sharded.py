"""``ShardedExperts``: the experts module of a rank that holds only its share of a layer's routed experts.

With ``expert_parallel: sharded`` under several processes (``moetune.dist.shard``), rank r's engine holds experts
``[r E/world, (r+1) E/world)`` of the layer (``moetune.loading`` reads only those). Its forward keeps the
transformers v5 experts call, ``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``, and
runs :func:`moetune.dist.exchange.sharded_experts`: every slot travels to its expert's owner, the owner's engine
computes what it received as rows of their own (``k = 1``, weight 1, through :class:`CpuExperts`' own forward:
the autograd Function, the forward memo, LoRA), the rows come back and the routing weights combine them on the
token's rank, so the router's gradient stays there. Every rank must run the same layers in the same order: each
call holds collectives on the exchange's group, also with no token at all.

Other call forms (``ExpertsCall``: Llama 4's pre-scaled dense rows, DBRX's ``[B, S, H]``, LongCat-Flash's
zero-computation experts, Muse Spark's per-expert norm) each have one module: the family's module of one process
over :class:`ShardedExperts` (``SHARDED_MODULES``). The family's arithmetic runs on the token's rank as in one
process, and where it calls the engine, ``super().forward`` now reaches the exchange.

Expert LoRA: the PEFT layers around this module (``moetune.adapters.expert_layer``) hold only this rank's
experts' rows (``moetune.adapters.expert_rows``: ``[E / world, r, in]`` / ``[E / world, out, r]`` in the engine
layout; on the last rank LongCat-Flash's gate_up also keeps the zero-computation experts' unused rows after its
own) and pass its experts' rows with each call. Those rows receive the gradient of every rank's tokens (the exchange
brings them here), so no other rank has a gradient for them: ``moetune.train.sharded_lora`` keeps them out of
every all-reduce, divides their gradient by the number of ranks (the Trainer scales each rank's loss by it),
keeps their optimizer state here and gathers them to the main process for every save, where the adapter is
the whole one a single process writes.

Activation checkpointing: a recompute runs the layer again, exchange included; every rank recomputes the same
layers in the same order (the same model, the same backward), so the exchanges pair up. The memo of the owner's
engine (``moetune.layer.memo``) sits inside the local compute, keyed on the rows it received (which the recompute
reproduces), so it skips the engine's second forward as in one process; hit or miss is local to the rank and
changes no collective, and a miss only recomputes.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from moetune.arch.spec import ExpertsCall
from moetune.dist.exchange import ExpertOwners, sharded_experts
from moetune.engine import ExpertEngine, ExpertLoRA
from moetune.layer.cpu_experts import (
    BatchedExperts,
    CpuExperts,
    IdentityExperts,
    PostNormExperts,
    PrescaledDenseExperts,
)

if TYPE_CHECKING:
    from moetune.arch.detect import ExpertsLayout

_LORA_FIELDS = ("gate_up_A", "gate_up_B", "down_A", "down_B")


class ShardedExperts(CpuExperts):
    """A :class:`CpuExperts` whose engine holds experts ``first .. first + engine.num_experts - 1`` of
    ``owners.num_experts``; tokens are exchanged with the other ranks over ``group`` (module docstring)."""

    def __init__(
        self,
        engine: ExpertEngine,
        layout: ExpertsLayout | None = None,
        *,
        owners: ExpertOwners,
        rank: int,
        group: Any,
    ) -> None:
        super().__init__(engine, layout)
        assert engine.num_experts == owners.per_rank, (engine.num_experts, owners)
        self.owners, self.rank, self.group = owners, rank, group
        self.first = rank * owners.per_rank

    @property
    def num_experts(self) -> int:
        """The layer's experts over every rank (E; the engine holds E / world of them)."""
        return self.owners.num_experts

    def local_lora(self, lora: ExpertLoRA | None) -> ExpertLoRA | None:
        """This rank's experts' LoRA: as given when it holds their rows only (A ``[E / world, r, in]``, the PEFT
        layers' case), or the rows of a whole layer's LoRA (A ``[E, r, in]``, B ``[E, out, r]``) as views, whose
        gradients flow back into the whole tensors."""
        if lora is None or lora.gate_up_A.shape[0] == self.owners.per_rank:
            return lora
        assert lora.gate_up_A.shape[0] == self.owners.num_experts, (lora.gate_up_A.shape, self.owners)
        mine = slice(self.first, self.first + self.owners.per_rank)
        return dataclasses.replace(lora, **{name: getattr(lora, name)[mine] for name in _LORA_FIELDS})

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[T, H]``, top_k_index ``[T, k]`` (global expert ids), top_k_weights ``[T, k]`` ->
        ``[T, H]`` in hidden_states' dtype; ``lora``: the whole layer's expert LoRA (as :class:`CpuExperts`)."""
        mine = self.local_lora(lora)
        own = super().forward

        def local(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            # rows [M, H] from every rank, local_ids [M] in [0, E / world): one row per slot, weight 1
            ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)  # [M, 1]
            return own(rows, local_ids.unsqueeze(1), ones, lora=mine)

        return sharded_experts(
            hidden_states, top_k_index.to(torch.int64), top_k_weights, self.owners, local, self.group
        )

    def extra_repr(self) -> str:
        last = self.first + self.owners.per_rank - 1
        return f"experts {self.first}-{last} of {self.owners.num_experts} (rank {self.rank}), {super().extra_repr()}"


# its forward takes Llama 4's call (routed_in), not the TOPK one, as PrescaledDenseExperts over CpuExperts
class ShardedPrescaledDenseExperts(PrescaledDenseExperts, ShardedExperts):  # type: ignore[misc]
    """Llama 4's call, ``experts(routed_in [E*T, H]) -> [E*T, H]``, on a rank holding a shard: each non-zero row
    (token t pre-scaled for expert e, e global) goes to e's owner as a row of its own with weight 1, as
    :class:`PrescaledDenseExperts` hands them to the engine in one process; the zero rows stay zero here."""


class ShardedIdentityExperts(IdentityExperts, ShardedExperts):
    """LongCat-Flash's call on a rank holding a shard: the zero-computation experts' share (ids ``>= E``, the token
    itself times its weights) is computed by the token's own rank, with no exchange (no rank owns them); only the
    slots of routed experts travel to their owners (:class:`IdentityExperts`)."""


class ShardedPostNormExperts(PostNormExperts, ShardedExperts):
    """Muse Spark's call on a rank holding a shard: every (token, slot) row travels to its expert's owner with
    weight 1 and comes back unweighted; the ``post_expert_norm`` and the routing weight apply on the token's rank
    (:class:`PostNormExperts`), where the norm is a device module of the model like any other."""


class ShardedBatchedExperts(BatchedExperts, ShardedExperts):
    """DBRX's call, ``experts(hidden [B, S, H], top_k_index [B*S, k], top_k_weights [B*S, k]) -> [B, S, H]``, on a
    rank holding a shard: the tokens are flattened, exchanged as in the TOPK call and the shape restored."""


SHARDED_MODULES: dict[ExpertsCall, type[ShardedExperts]] = {
    ExpertsCall.TOPK: ShardedExperts,
    ExpertsCall.PRESCALED_DENSE: ShardedPrescaledDenseExperts,
    ExpertsCall.TOPK_WITH_IDENTITY: ShardedIdentityExperts,
    ExpertsCall.TOPK_POST_NORM: ShardedPostNormExperts,
    ExpertsCall.TOPK_BATCHED: ShardedBatchedExperts,
}
"""The module of a rank holding a shard of a layer's experts, by how the family's block calls its experts
(``ArchSpec.call``): each call form's module of one process (``moetune.layer.EXPERTS_MODULES``) over
:class:`ShardedExperts`, whose ``forward`` the form's own arithmetic calls where one process calls the engine
(Python's method order: the form's class, then ``ShardedExperts``, then ``CpuExperts``)."""
