"""The CPU threads the expert engine's GEMMs run on.

The engine multiplies with torch on the CPU, so its threads are torch's intra-op pool, which is one per
process: sizing it is the caller's decision, made once (``load_model``, ``moetune convert``, the benchmarks),
never a side effect of building an engine.

Within that budget the engine runs experts in parallel (``ExpertPool``): with P threads, W = min(P, 4) worker
threads each compute whole experts on P // W intra-op threads (``split_threads``), instead of one expert at a
time with every GEMM split over P threads. Experts that received 8-64 rows make GEMMs too small to split well
over many threads, and the per-expert Python of one worker overlaps the GEMMs of the others (torch releases
the GIL in its ops). More than 4 workers cost more than they gain: each torch op a worker calls takes the GIL
back when it returns, and with many workers those hand-offs queue (``DEFAULT_MAX_WORKERS``).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch

from moetune.errors import ConfigError
from moetune.sysinfo import default_num_threads

T = TypeVar("T")


def set_engine_threads(requested: int | None = None) -> int:
    """Size torch's intra-op pool (process-wide) to ``requested`` threads, or to ``default_num_threads()``
    (the physical cores visible to the process, capped by its CPU quota) when None; returns the count.

    Raises ConfigError for anything but a positive int or None.
    """
    positive_int = isinstance(requested, int) and not isinstance(requested, bool) and requested >= 1
    if requested is not None and not positive_int:
        raise ConfigError(f"num_threads must be a positive int or None; got {requested!r}")
    threads = default_num_threads() if requested is None else requested
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


# Unless asked for, experts smaller than this (3 H I parameters) run one after another: a pool task costs about
# 0.2-0.5 ms of CPU in thread hand-offs and GIL contention (measured on 2 cores with H = 64, I = 32: 2.6x the
# CPU time of the sequential path), more than such an expert's GEMMs; an expert of 1 Mi parameters streams
# 2 MiB of bf16 weights per projection pass, several times that cost even for one row.
MIN_POOL_EXPERT_PARAMS = 1 << 20


# Workers of the expert pool unless asked for. Measured with `moetune bench engine --threads 1 16 --workers 2 4 8`
# (E = 128, H = 2048, I = 768, k = 8, T = 128/512/2048, lora and frozen) on a 16-core AMX Xeon: 4 workers of 4
# intra-op threads were the fastest of 1, 2, 4, 8 and 16 workers in all six cases, 1.2-2.4x faster than 16
# workers of one thread (which ran slower than 4 such workers: GIL hand-offs) and 1.3-2.1x faster than one
# expert at a time on 16 threads; on 2 and 4 threads one worker per thread beat one expert at a time
# (docs/performance.md, "Thread scaling on 16 cores").
DEFAULT_MAX_WORKERS = 4


def split_threads(threads: int, tasks: int, workers: int | None = None) -> tuple[int, int]:
    """``(workers, intra)``: how ``threads`` CPU threads run ``tasks`` independent expert tasks.

    ``workers`` experts run at once, each on ``intra`` intra-op threads (``workers * intra <= threads``).
    Unset, ``min(threads, DEFAULT_MAX_WORKERS)`` workers sharing the threads evenly (a count not divisible by
    the workers leaves the remainder idle): a GEMM of an expert with 8-64 rows split over a few cores needs
    little synchronisation between them, and a few workers keep their Python out of each other's way. Fewer
    tasks than workers: the largest power of two of the tasks, each worker on a share of the threads, so a process keeps at most
    log2(threads) such pools however the number of active experts varies. 1: the experts one after another in
    the calling thread on all its threads (the sequential path).
    """
    want = min(threads, DEFAULT_MAX_WORKERS) if workers is None else max(1, min(workers, threads))
    if tasks >= want:
        return want, max(1, threads // want)
    n = 1 << (max(1, tasks).bit_length() - 1)  # a power of two: few distinct pools
    return n, max(1, threads // n)


class ExpertPool:
    """``workers`` threads, each with its own intra-op pool of ``intra`` threads, that run expert tasks.

    torch releases the GIL inside its ops, so the workers' GEMMs run in parallel while another worker's
    Python (the per-expert bookkeeping) runs. torch's intra-op thread count is per thread: each worker sizes
    its own once, when it starts; the caller's count is left as it was.
    """

    def __init__(self, workers: int, intra: int) -> None:
        self.workers, self.intra = workers, intra
        self._executor = ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix=f"moetune-experts-{workers}x{intra}"
        )
        caller = torch.get_num_threads()
        started = threading.Barrier(workers)
        # start every worker now (each waits for all, so each task lands on its own thread) and size its pool
        wait([self._executor.submit(self._start, started) for _ in range(workers)])
        # a worker's set_num_threads also sets the count threads started later begin with; put the caller's back
        torch.set_num_threads(caller)

    def _start(self, started: threading.Barrier) -> None:
        # ATen sizes a thread's OpenMP pool from the process-wide count on the thread's first parallel op,
        # unless that first sizing already happened: get_num_threads does it, so the count set next stays
        torch.get_num_threads()
        torch.set_num_threads(self.intra)
        started.wait()

    def run(self, fn: Callable[[T], object], items: Sequence[T]) -> None:
        """``fn(item)`` for every item, at most ``workers`` at once, in the caller's grad and inference modes;
        items start in the order given (put the longest first). Waits for all, then raises the first error
        (an error in one item does not stop the others: none may still be writing when the caller goes on).

        Each worker takes the next item from a shared counter until none is left: one hand-off per worker
        and call, not one future per item."""
        grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        todo = list(items)
        counter = itertools.count()  # next() on it is atomic under the GIL
        errors: list[BaseException] = []

        def drain() -> None:
            # both modes are per thread: a generation under inference_mode writes into inference tensors
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                while (i := next(counter)) < len(todo):
                    try:
                        fn(todo[i])
                    except BaseException as err:  # re-raised in the caller below
                        errors.append(err)

        wait([self._executor.submit(drain) for _ in range(min(self.workers, len(todo)))])
        if errors:
            raise errors[0]


_pools: dict[tuple[int, int], ExpertPool] = {}
_pools_lock = threading.Lock()


def _forget_pools_in_child() -> None:
    """A forked child has none of the parent's threads: its engines start pools of their own."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pools_in_child)


def expert_pool(workers: int, intra: int) -> ExpertPool:
    """The process's pool of ``workers`` threads with ``intra`` intra-op threads each (made on first use)."""
    with _pools_lock:
        pool = _pools.get((workers, intra))
        if pool is None:
            pool = _pools[(workers, intra)] = ExpertPool(workers, intra)
        return pool
