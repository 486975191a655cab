"""How one engine spreads a pass's experts over the CPU threads: runs of consecutive experts, or chunks of
them, one after another in the calling thread or in parallel on the process's expert pool
(``threads.expert_pool``). ``threads`` holds the pool itself and the thread split; this module decides which
tasks a pass makes and where they run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moetune.engine.threads import MIN_POOL_EXPERT_PARAMS, expert_pool, split_threads

if TYPE_CHECKING:
    from moetune.engine.lora_batch import Chunk, LoraBatch
    from moetune.engine.routing import Dispatch, Run

# A run's rows at most (``Dispatch.runs``): the activation, router dot and weighting run once per run of experts
# instead of once per expert (about 10 ops each, ~40-60 us of dispatch per expert at T = 128, E = 128), while a
# run's [rows, 2I] activations stay about L2-sized (256 x 1536 bf16: 768 KiB).
RUN_ROWS = 256
# With the expert pool, runs are cut to give each worker at least this many, so largest-first can balance them.
RUNS_PER_WORKER = 4


@dataclass(frozen=True)
class ExpertSchedule:
    """One engine's schedule: ``requested`` is ``EngineOptions.expert_workers`` (None: ``split_threads``'
    default), ``expert_params`` one expert's 3 H I parameters (experts under ``MIN_POOL_EXPERT_PARAMS`` run one
    after another unless workers are asked for)."""

    requested: int | None
    expert_params: int

    def workers(self, tasks: int) -> tuple[int, int]:
        """``(workers, intra)`` for ``tasks`` expert tasks on the calling thread's intra-op thread count."""
        requested = self.requested
        if requested is None and self.expert_params < MIN_POOL_EXPERT_PARAMS:
            requested = 1  # tiny experts: the pool's hand-offs would cost more than their GEMMs
        return split_threads(torch.get_num_threads(), tasks, requested)

    def each_run(self, disp: Dispatch, fn: Callable[[Run], object]) -> None:
        """``fn(run)`` for runs of consecutive active experts (``Dispatch.runs``) covering them all: one after
        another in this thread, or in parallel on an ``ExpertPool`` (largest first, so the last to finish are
        small). A run's experts each take their own GEMMs; the elementwise work between them (activation, router
        dot, weighting) runs once over the run's rows. Every run writes only its own rows (and its experts' LoRA
        or base gradient slices), so the order changes no result."""
        workers, _ = self.workers(len(disp.counts) - disp.counts.count(0))
        rows = RUN_ROWS
        if workers > 1:  # several runs per worker, so that largest-first can balance them
            rows = min(RUN_ROWS, max(1, sum(disp.counts) // (RUNS_PER_WORKER * workers)))
        runs = disp.runs(rows)
        workers, intra = self.workers(len(runs))
        if workers == 1:
            for run in runs:
                fn(run)
            return
        expert_pool(workers, intra).run(fn, sorted(runs, key=lambda run: run.start - run.end))

    def each_chunk(self, batch: LoraBatch, fn: Callable[[Chunk], object]) -> None:
        """``fn(chunk)`` for chunks of consecutive experts covering all E, one per worker of the expert pool."""
        workers, intra = self.workers(batch.num_experts)
        chunks = batch.chunks(workers)
        if workers == 1:
            fn(chunks[0])
            return
        expert_pool(workers, intra).run(fn, chunks)
