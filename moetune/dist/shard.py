"""Which routed experts this process holds: all of them, or its shard (``expert_parallel: sharded``).

:func:`expert_shard` is the one place the option meets the process group: with ``sharded`` and a process group
of ``world > 1`` ranks it returns this rank's :class:`ExpertShard` (rank r holds experts ``[r E/world,
(r+1) E/world)`` of every MoE layer, ``moetune.dist.exchange.ExpertOwners``) and a gloo group of its own for the
token exchange; otherwise None (every expert here). The exchange has its own group so that its collectives never
queue behind, or between, DDP's gradient all-reduces on the default group: every rank issues the exchanges in
the same order (the same layers, forward then backward), DDP issues its buckets in its own order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from moetune.config.experts import ExpertParallel
from moetune.dist.exchange import ExpertOwners
from moetune.dist.group import collective_timeout
from moetune.errors import ConfigError

logger = logging.getLogger(__name__)

_exchange_group: Any = None


@dataclass(frozen=True)
class ExpertShard:
    """This rank's place among the ranks that split every MoE layer's experts (``world`` > 1)."""

    rank: int
    world: int
    group: Any  # the exchange's process group (gloo), shared by every layer

    def owners(self, num_experts: int, where: str) -> ExpertOwners:
        """The owners of a layer's ``num_experts`` experts; ``ConfigError`` naming ``expert_parallel``, E and the
        number of processes when they do not split evenly (raised from headers, before any expert is read)."""
        if num_experts % self.world:
            divisors = [d for d in range(2, num_experts + 1) if num_experts % d == 0]
            raise ConfigError(
                f"expert_parallel: sharded splits each MoE layer's experts evenly over the processes, but {where} "
                f"has E = {num_experts} experts and {self.world} processes were launched; launch a number of "
                f"processes that divides {num_experts} (e.g. {', '.join(map(str, divisors[:6]))}) or use "
                "expert_parallel: replicated"
            )
        return ExpertOwners(num_experts, self.world)

    def experts(self, num_experts: int) -> range:
        """The global ids of the experts this rank holds."""
        per = num_experts // self.world
        return range(self.rank * per, (self.rank + 1) * per)


def expert_shard(parallel: ExpertParallel) -> ExpertShard | None:
    """This rank's shard under ``parallel``, or None when this process holds every expert (``replicated``, or
    one process: ``sharded`` then logs that it holds them all). Creates the exchange group on first use: every
    rank must call it at the same point (``load_model`` does, before any expert is read)."""
    global _exchange_group
    if parallel is not ExpertParallel.SHARDED:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        logger.info("moetune: expert_parallel: sharded with one process: this process holds every expert")
        return None
    if _exchange_group is None:  # with the run's ddp_timeout where moetune.dist.start set up the group
        _exchange_group = dist.new_group(backend="gloo", timeout=collective_timeout())
    return ExpertShard(dist.get_rank(), dist.get_world_size(), _exchange_group)


def experts_held(model: Any) -> dict[str, Any]:
    """What this rank holds of the routed experts, for the run summary: ``expert_parallel`` (``sharded`` when its
    experts modules hold a shard, else ``replicated``), the experts per MoE layer (``"4 of 8"``, the first
    layer's) and the bytes of every engine's weights, in GiB; with ``expert_residency: disk`` also what its
    residency window did (``disk_residency``: its budget and the most it held, in GiB, its hits and misses)."""
    from moetune.engine.residency import PagedExperts
    from moetune.layer import CpuExperts
    from moetune.layer.sharded import ShardedExperts

    modules = [m for m in model.modules() if isinstance(m, CpuExperts)]
    sharded = any(isinstance(m, ShardedExperts) for m in modules)
    first = modules[0] if modules else None
    held: dict[str, Any] = {
        "expert_parallel": (ExpertParallel.SHARDED if sharded else ExpertParallel.REPLICATED).value,
        "experts_per_layer": f"{first.engine.num_experts} of {first.num_experts}" if first is not None else None,
        "engines_gb": round(sum(m.engine.weights.nbytes for m in modules) / 2**30, 6),
    }
    if first is not None and isinstance(first.engine.weights, PagedExperts):  # one window serves every layer
        window = first.engine.weights.window
        held["disk_residency"] = {
            "budget_gb": round(window.budget / 2**30, 6),
            "peak_gb": round(window.stats.peak_bytes / 2**30, 6),
            "hits": window.stats.hits,
            "misses": window.stats.misses,
        }
    return held
