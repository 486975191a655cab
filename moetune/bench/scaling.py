"""How the engine scales with CPU threads: ``moetune bench engine --threads 1 2 4 ...`` (two or more counts).

For every selected case (E, T, mode, policy) and every thread count N it times one engine step (forward +
backward) two ways on the same weights and batch:

- ``experts``: the engine's default, experts computed in parallel on a pool of W = min(N, 4) workers of N / W
  intra-op threads each (``moetune.engine.threads.ExpertPool``, ``split_threads``);
- ``intra``: one expert at a time, every GEMM on N intra-op threads (``EngineOptions(expert_workers=1)``: the
  engine before it had a pool, and what torch's threading alone gives);
- ``W-workers`` for each W of ``workers`` (``--workers``): W experts at a time, each on N / W intra-op threads
  (``EngineOptions(expert_workers=W)``), at every N >= W;
- ``experts-py`` with ``python_ops`` (``--python-ops``): the default with each expert's op sequences run in Python
  (``EngineOptions(native_ops=False)``), the reference the compiled sequences (``kernels/ops.h``) replace.

The variants and thread counts are interleaved: each round times one step of every (variant, N) before the next
round starts, so a change in machine load hits all of them alike. Per (case, variant, N) it reports the median
step time and the spread (min and max over the rounds), the speedup over the same variant on 1 thread, the
efficiency (speedup / N) and ``experts`` over ``intra`` at the same N.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, TextIO

import torch

from moetune.bench.report import dtype_name
from moetune.bench.runners import RUNNERS, Step, make_batch, make_weights
from moetune.engine import EngineOptions, TrainMode, resolve_compute_dtype
from moetune.sysinfo import cpu_info

# variant -> EngineOptions.expert_workers, EngineOptions.native_ops
VARIANTS: dict[str, tuple[int | None, bool | None]] = {"experts": (None, None), "intra": (1, None)}


def variants(
    workers: tuple[int, ...] = (), python_ops: bool = False
) -> dict[str, tuple[int | None, bool | None]]:
    """The variants timed: ``VARIANTS``, one ``{W}-workers`` per W of ``workers`` (W > 1) and, with
    ``python_ops``, ``experts-py``."""
    out = {**VARIANTS, **{f"{w}-workers": (w, None) for w in sorted(set(workers)) if w > 1}}
    return out | ({"experts-py": (None, False)} if python_ops else {})


def _step_s(step: Step, threads: int) -> float:
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    step.backward(step.forward())
    return time.perf_counter() - t0


def _case_records(
    steps: dict[tuple[str, int], Step], rounds: int, warmup: int, base: dict[str, Any]
) -> list[dict[str, Any]]:
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    for _ in range(warmup):
        for (_, n), step in steps.items():
            _step_s(step, n)
    for _ in range(rounds):
        for key, step in steps.items():
            samples[key].append(_step_s(step, key[1]))
    med = {key: statistics.median(s) * 1e3 for key, s in samples.items()}
    records = []
    for (variant, n), s in samples.items():
        one = med.get((variant, 1)) if (variant, 1) in med else med.get(("intra", 1))
        speedup = None if one is None else one / med[(variant, n)]
        records.append(
            {
                **base,
                "variant": variant,
                "threads": n,
                "step_ms": med[(variant, n)],
                "min_ms": min(s) * 1e3,
                "max_ms": max(s) * 1e3,
                "samples": len(s),
                "speedup": speedup,
                "efficiency": None if speedup is None else speedup / n,
                "vs_intra": med[("intra", n)] / med[(variant, n)],
            }
        )
    return records


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run_thread_scaling(
    config: Any,
    thread_counts: tuple[int, ...],
    out: TextIO,
    workers: tuple[int, ...] = (),
    python_ops: bool = False,
) -> list[dict[str, Any]]:
    """Time every case of ``config`` (an ``EngineBenchConfig``; its baselines and roofline are not measured) on
    each of ``thread_counts``, the variants (:func:`variants` of ``workers`` and ``python_ops``) interleaved; print a table and
    return one record per (case, variant, thread count). Restores the process's thread count afterwards."""
    from moetune.bench.engine import WEIGHT_DTYPE, select_cases  # the grid is the engine benchmark's

    config.validate()
    counts = tuple(sorted(set(thread_counts)))
    cases = select_cases(config)
    cpu = cpu_info()
    before = torch.get_num_threads()
    print(
        f"moetune bench engine, thread scaling | {cpu.model} ({', '.join(cpu.isa) or 'no SIMD flags found'}), "
        f"{cpu.logical_cpus} logical CPUs | {dtype_name(WEIGHT_DTYPE)} weights, engine computes in "
        f"{dtype_name(resolve_compute_dtype(WEIGHT_DTYPE))} | threads {list(counts)}, {config.timing.reps} "
        "interleaved rounds",
        file=out,
    )
    if counts[-1] > cpu.logical_cpus:
        print(f"warning: {counts[-1]} threads on {cpu.logical_cpus} CPUs oversubscribes them", file=out)
    timed = variants(workers, python_ops)
    head = f"{'case':28}{'variant':>11}{'N':>4}{'median ms':>11}{'min-max ms':>17}{'speedup':>9}{'eff.':>7}{'vs intra':>10}"
    print(head + "\n" + "-" * len(head), file=out, flush=True)
    records: list[dict[str, Any]] = []
    try:
        weights = None
        for case in cases:
            if weights is None or weights.gate_up.shape[0] != case.experts:
                weights = None
                gc.collect()
                weights = make_weights(
                    case.experts,
                    config.hidden,
                    config.intermediate,
                    config.rank,
                    config.alpha,
                    WEIGHT_DTYPE,
                    config.seed,
                )
            batch = make_batch(
                case.tokens,
                case.experts,
                config.top_k,
                config.hidden,
                WEIGHT_DTYPE,
                config.seed + case.tokens,
            )
            steps = {
                (variant, n): RUNNERS.get("engine")(
                    weights,
                    batch,
                    case.mode,
                    EngineOptions(policy=case.policy, expert_workers=pool, native_ops=native),
                )
                for n in counts
                for variant, (pool, native) in timed.items()
                if pool is None or pool <= n
            }
            base = {
                "case": case.name,
                "E": case.experts,
                "T": case.tokens,
                "mode": case.mode.value,
                "policy": case.policy.value,
                "rank": config.rank if case.mode is TrainMode.LORA else 0,
            }
            recs = _case_records(steps, config.timing.reps, config.timing.warmup, base)
            for rec in recs:
                spread = f"{rec['min_ms']:.1f}-{rec['max_ms']:.1f}"
                print(
                    f"{rec['case']:28}{rec['variant']:>11}{rec['threads']:>4}{rec['step_ms']:>11.1f}{spread:>17}"
                    f"{_fmt(rec['speedup'], '.2f'):>9}{_fmt(rec['efficiency'], '.0%'):>7}"
                    f"{_fmt(rec['vs_intra'], '.2f'):>9}x",
                    file=out,
                    flush=True,
                )
            records += [_rounded(r) for r in recs]
            del steps
    finally:
        torch.set_num_threads(before)
    print(
        "\nspeedup = the variant's median on 1 thread / on N; eff. = speedup / N; vs intra = intra's median / "
        "this variant's at the same N. experts: the engine's default (min(N, 4) workers of N / min(N, 4) intra-op threads); intra: "
        "one expert at a time on N intra-op threads; W-workers: W experts at a time on N / W intra-op threads each "
        "(speedup over intra on 1 thread); experts-py: experts with the per-expert op sequences in Python. Other processes on the machine make every number noisy: "
        "compare the rows of one run, not runs.",
        file=out,
    )
    return records


def _rounded(rec: dict[str, Any]) -> dict[str, Any]:
    """The record with its floats rounded to 4 significant digits (timings are not more precise than that)."""
    return {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in rec.items()}
