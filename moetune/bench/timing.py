"""Wall-clock timing for benchmarks: warm-up, repetitions under a time budget, and skipping calls that would
run for too long.

Some baselines run for minutes per call on CPUs without native bf16 (bf16 GEMMs there are emulated), so
repetitions stop once they have used ``budget_s`` and a call predicted to exceed ``max_call_s`` is not run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TimingPolicy:
    """How a measurement is taken.

    ``warmup`` untimed calls, then up to ``reps`` timed ones; repetitions stop early once the timed calls add
    up to ``budget_s`` (at least one is kept). A warm-up call that alone takes ``budget_s`` or more becomes the
    only sample: repeating it would cost more than the budget, and first-call costs (allocation, kernel
    selection) are a small part of a call that long.
    """

    warmup: int = 1
    reps: int = 3
    budget_s: float = 20.0
    max_call_s: float = 120.0  # skip a baseline predicted to take longer per call (see CallBudget)


@dataclass(frozen=True)
class Timing:
    """Median forward and backward times of the samples, in milliseconds; ``best_ms`` is the fastest total."""

    fwd_ms: float
    bwd_ms: float
    best_ms: float
    samples: int

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


def _once(forward: Callable[[], Any], backward: Callable[[Any], None] | None) -> tuple[float, float]:
    t0 = time.perf_counter()
    state = forward()
    t1 = time.perf_counter()
    if backward is not None:
        backward(state)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def measure(
    forward: Callable[[], Any], backward: Callable[[Any], None] | None, policy: TimingPolicy
) -> Timing:
    """Time ``backward(forward())`` (or ``forward()`` alone) under ``policy``; forward and backward apart."""
    samples: list[tuple[float, float]] = []
    for _ in range(policy.warmup):
        f, b = _once(forward, backward)
        if f + b >= policy.budget_s:
            samples.append((f, b))
            break
    while not samples or (len(samples) < policy.reps and sum(f + b for f, b in samples) < policy.budget_s):
        samples.append(_once(forward, backward))
    return Timing(
        fwd_ms=1e3 * statistics.median(f for f, _ in samples),
        bwd_ms=1e3 * statistics.median(b for _, b in samples),
        best_ms=1e3 * min(f + b for f, b in samples),
        samples=len(samples),
    )


class CallBudget:
    """Predicts a call's time from the last measured call of the same kind and says whether to skip it.

    Calls of one kind (``key``) are measured in increasing ``size`` (FLOPs); time is taken to grow linearly
    with size, which holds for GEMM-bound work once sizes are past the smallest.
    """

    def __init__(self, max_call_s: float) -> None:
        self.max_call_s = max_call_s
        self._last: dict[Hashable, tuple[float, float]] = {}  # key -> (size, seconds per call)

    def predicted_s(self, key: Hashable, size: float) -> float | None:
        """Predicted seconds of one call of ``size``, or None when nothing of this kind was measured yet."""
        last = self._last.get(key)
        return None if last is None else last[1] * size / last[0]

    def skip_reason(self, key: Hashable, size: float) -> str | None:
        """Why a call of ``size`` should not run (predicted too long), or None to run it."""
        predicted = self.predicted_s(key, size)
        if predicted is None or predicted <= self.max_call_s:
            return None
        return f"skipped: predicted {predicted:.0f} s per call > max {self.max_call_s:g} s"

    def record(self, key: Hashable, size: float, seconds: float) -> None:
        """Remember a measured call (the larger of this and any earlier size of the kind is kept)."""
        last = self._last.get(key)
        if last is None or size >= last[0]:
            self._last[key] = (size, seconds)


def interleaved_min_ms(calls: Mapping[str, Callable[[int], None]], items: int, reps: int) -> dict[str, float]:
    """Milliseconds per item for each labelled call: the minimum over ``reps`` of the mean of ``call(i)`` over
    ``i < items``. Each rep runs every call in turn, so machine noise falls on all of them alike (the side-by-side
    ratios of ``bench/bf16_products.py`` and ``bench/kernel_ab.py``); warm-up is the caller's."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(reps):
        for label, call in calls.items():
            t0 = time.perf_counter()
            for i in range(items):
                call(i)
            best[label] = min(best[label], (time.perf_counter() - t0) / items * 1e3)
    return best
