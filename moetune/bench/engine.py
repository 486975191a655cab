"""The engine benchmark: one MoE layer's routed experts, forward + backward, engine against baselines, with
this machine's roofline. ``moetune bench engine`` and ``bench/engine.py`` run :func:`run_engine_bench`.

Per case (E experts, T tokens, mode, activation policy) it reports the engine's fwd/bwd times, TFLOP/s, the
roofline time and the fraction of it reached, and ``vs_loop`` / ``vs_hf``: a baseline's fwd+bwd time over the
engine's, measured in the same run on the same weights and batch. Each baseline is measured once per
(E, T, mode) and shared by both policies. The method is in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import fnmatch
import gc
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import torch

from moetune.bench.flops import expert_flops, expert_weight_bytes
from moetune.bench.machine import Roofline, measure_peak_gemm, measure_read_bandwidth
from moetune.bench.report import dtype_name, print_header, print_notes, print_row, print_table_head
from moetune.bench.runners import RUNNERS, BenchBatch, BenchWeights, cast_bench, make_batch, make_weights
from moetune.bench.timing import CallBudget, Timing, TimingPolicy, measure
from moetune.engine import ActivationPolicy, EngineOptions, TrainMode, resolve_compute_dtype
from moetune.engine.threads import set_engine_threads
from moetune.errors import ConfigError
from moetune.sysinfo import cpu_info

WEIGHT_DTYPE = torch.bfloat16  # how large MoE checkpoints ship, and what the baselines train on
BENCH_MODES = (TrainMode.LORA, TrainMode.FROZEN)
BASELINES = ("loop", "hf")

REQUIRED_KEYS = (
    "case", "E", "k", "T", "H", "I", "rank", "policy", "mode", "fwd_ms", "bwd_ms", "tflops",
    "roofline_ms", "roofline_fraction", "vs_loop", "vs_hf",
)  # fmt: skip


@dataclass(frozen=True)
class EngineBenchConfig:
    """The case grid and how to measure it. The defaults are the full benchmark (Qwen3-30B-A3B's layer)."""

    experts: tuple[int, ...] = (64, 128)  # E
    tokens: tuple[int, ...] = (128, 512, 2048)  # T
    hidden: int = 2048  # H
    intermediate: int = 768  # I
    top_k: int = 8  # k
    rank: int = 8  # r
    alpha: int = 16  # LoRA alpha (scaling alpha / r), as PEFT's LoraConfig takes it
    modes: tuple[TrainMode, ...] = BENCH_MODES
    policies: tuple[ActivationPolicy, ...] = (ActivationPolicy.RETAIN, ActivationPolicy.RECOMPUTE)
    baselines: tuple[str, ...] = BASELINES
    cases: tuple[str, ...] = ()  # shell-style patterns on case names ("E64-*-lora-*"); empty: every case
    timing: TimingPolicy = field(default_factory=TimingPolicy)
    gemm_rows: tuple[int, ...] = (256, 1024, 4096)  # M of the peak GEMM shapes
    bandwidth_bytes: int = 1 << 30
    threads: int | None = None  # None: physical cores (the engine's default)
    # dtype the loop/HF baselines compute in (weights upcast from bf16, same values). None: the dtype the engine
    # computes bf16 experts in on this CPU, so baselines run at their fastest too (bf16 GEMMs are emulated,
    # 6-30x slower than fp32, on CPUs without AMX-BF16/AVX512-BF16)
    baseline_dtype: torch.dtype | None = None
    seed: int = 0

    @property
    def baseline_compute_dtype(self) -> torch.dtype:
        return self.baseline_dtype or resolve_compute_dtype(WEIGHT_DTYPE)

    def validate(self) -> None:
        """Raise :class:`ConfigError` listing every bad field at once."""
        problems = []
        for name in ("experts", "tokens", "gemm_rows"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values):
                problems.append(f"{name} must be one or more positive integers; got {list(values)}")
        for name in ("hidden", "intermediate", "top_k", "rank", "bandwidth_bytes"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be a positive integer; got {getattr(self, name)}")
        if self.experts and self.top_k > min(self.experts):
            problems.append(f"top_k must be <= the smallest E {min(self.experts)}; got {self.top_k}")
        for mode in self.modes:
            if mode not in BENCH_MODES:
                problems.append(f"modes: {mode.value!r} is not benchmarked; allowed: lora, frozen")
        unknown = [b for b in self.baselines if b not in BASELINES]
        if unknown:
            problems.append(f"baselines {unknown} are unknown; allowed: {', '.join(BASELINES)}")
        if not self.modes or not self.policies:
            problems.append("modes and policies must each list at least one value")
        if self.timing.reps < 1 or self.timing.warmup < 0:
            problems.append(
                f"reps must be >= 1 and warmup >= 0; got {self.timing.reps} and {self.timing.warmup}"
            )
        if self.threads is not None and self.threads < 1:
            problems.append(f"threads must be >= 1; got {self.threads}")
        if problems:
            raise ConfigError("engine benchmark: " + "; ".join(problems))


QUICK = EngineBenchConfig(
    experts=(64,),
    tokens=(128, 512),
    policies=(ActivationPolicy.RETAIN,),
    timing=TimingPolicy(warmup=1, reps=2, budget_s=3.0, max_call_s=30.0),
    gemm_rows=(256,),
)
"""``--quick``: E=64, T=128 and 512, lora and frozen, retain, short budgets (about a minute on 2 cores)."""


@dataclass(frozen=True)
class Case:
    """One row of the table: E experts, T tokens, a training mode and an activation policy."""

    experts: int
    tokens: int
    mode: TrainMode
    policy: ActivationPolicy

    @property
    def name(self) -> str:
        return f"E{self.experts}-T{self.tokens}-{self.mode.value}-{self.policy.value}"


def select_cases(config: EngineBenchConfig) -> list[Case]:
    """Every case of the grid matching ``config.cases``, grouped by (E, mode, T) with T ascending."""
    grid = [
        Case(e, t, m, p)
        for e in config.experts
        for m in config.modes
        for t in sorted(config.tokens)
        for p in config.policies
    ]
    if not config.cases:
        return grid
    chosen = [c for c in grid if any(fnmatch.fnmatchcase(c.name, pat) for pat in config.cases)]
    if not chosen:
        raise ConfigError(
            f"--cases {list(config.cases)} matched no case; names look like {grid[0].name!r} "
            f"(E in {list(config.experts)}, T in {sorted(config.tokens)}, mode lora|frozen, policy retain|recompute)"
        )
    return chosen


@dataclass
class _Baseline:
    timing: Timing | None
    note: str = ""  # why it was not measured


@dataclass(frozen=True)
class _Machine:
    roofline: Roofline
    threads: int
    load: float | None  # 1-minute load average before the run


def _groups(cases: list[Case]) -> Iterator[tuple[int, TrainMode, int, list[Case]]]:
    keys: dict[tuple[int, TrainMode, int], list[Case]] = {}
    for c in cases:
        keys.setdefault((c.experts, c.mode, c.tokens), []).append(c)
    for (e, m, t), group in keys.items():
        yield e, m, t, group


def _measure_baselines(
    config: EngineBenchConfig,
    weights: BenchWeights,
    batch: BenchBatch,
    mode: TrainMode,
    options: EngineOptions,
    budget: CallBudget,
    flops: int,
) -> dict[str, _Baseline]:
    out = {}
    e = weights.gate_up.shape[0]
    weights, batch = cast_bench(weights, batch, config.baseline_compute_dtype)
    for name in config.baselines:
        key = (name, e, mode)
        reason = budget.skip_reason(key, flops)
        if reason is not None:
            out[name] = _Baseline(None, f"{reason} (raise it with --max-call-s)")
            continue
        step = RUNNERS.get(name)(weights, batch, mode, options)
        timing = measure(step.forward, step.backward, config.timing)
        budget.record(key, flops, timing.total_ms / 1e3)
        out[name] = _Baseline(timing)
        del step
        gc.collect()  # a PEFT baseline holds a merged copy of the layer until its graph is freed
    return out


def _record(
    case: Case,
    config: EngineBenchConfig,
    machine: _Machine,
    timing: Timing,
    held_bytes: int | None,
    batch: BenchBatch,
    baselines: dict[str, _Baseline],
) -> dict[str, Any]:
    rank = config.rank if case.mode is TrainMode.LORA else 0
    fl = expert_flops(
        case.tokens, config.top_k, config.hidden, config.intermediate, rank, case.mode, case.policy
    )
    active = int(batch.topk_ids.unique().numel())
    wbytes = expert_weight_bytes(active, config.hidden, config.intermediate, WEIGHT_DTYPE.itemsize)
    roofline = machine.roofline
    roof_ms = roofline.time_ms(fl.total, wbytes)
    peak = roofline.peak
    rec: dict[str, Any] = {
        "case": case.name,
        "E": case.experts,
        "k": config.top_k,
        "T": case.tokens,
        "H": config.hidden,
        "I": config.intermediate,
        "rank": rank,
        "policy": case.policy.value,
        "mode": case.mode.value,
        "weight_dtype": dtype_name(WEIGHT_DTYPE),
        "compute_dtype": dtype_name(resolve_compute_dtype(WEIGHT_DTYPE)),
        "baseline_dtype": dtype_name(config.baseline_compute_dtype),
        "threads": machine.threads,
        "load_avg_1m": machine.load,
        "fwd_ms": timing.fwd_ms,
        "bwd_ms": timing.bwd_ms,
        "samples": timing.samples,
        "saved_mib": None if held_bytes is None else held_bytes / 2**20,
        "flops_fwd": fl.forward,
        "flops_bwd": fl.backward,
        "tflops": fl.total / timing.total_ms / 1e9,
        "active_experts": active,
        "weight_bytes": wbytes,
        "peak_tflops": peak.best,
        "peak_bf16_tflops": peak.by_dtype[torch.bfloat16],
        "peak_fp32_tflops": peak.by_dtype[torch.float32],
        "bandwidth_gbs": roofline.bandwidth_gbs,
        "roofline_ms": roof_ms,
        "roofline_fraction": roof_ms / timing.total_ms,
    }
    for name in BASELINES:
        base = baselines.get(name, _Baseline(None, "not run (--baselines)"))
        rec[f"{name}_ms"] = None if base.timing is None else base.timing.total_ms
        rec[f"vs_{name}"] = None if base.timing is None else base.timing.total_ms / timing.total_ms
        rec[f"{name}_note"] = base.note
    return rec


def run_engine_bench(config: EngineBenchConfig, out: TextIO | None = None) -> list[dict[str, Any]]:
    """Measure this machine's roofline, then every selected case; prints the table to ``out`` (stdout) as rows
    finish and returns one record per case (the keys of ``REQUIRED_KEYS`` and more).

    Runs on ``config.threads`` torch threads and restores the process's thread count afterwards.
    """
    config.validate()
    cases = select_cases(config)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None  # before we add our own
    threads_before = torch.get_num_threads()
    threads = set_engine_threads(config.threads)  # baselines and engine on the same threads
    try:
        return _run(config, cases, threads, load, out or sys.stdout)
    finally:
        torch.set_num_threads(threads_before)


def _run(
    config: EngineBenchConfig, cases: list[Case], threads: int, load: float | None, out: TextIO
) -> list[dict[str, Any]]:
    peak = measure_peak_gemm(config.hidden, config.intermediate, config.gemm_rows, config.timing)
    machine = _Machine(Roofline(peak, measure_read_bandwidth(config.bandwidth_bytes)), threads, load)
    compute_dtype = resolve_compute_dtype(WEIGHT_DTYPE)
    print_header(out, cpu_info(), threads, WEIGHT_DTYPE, compute_dtype, machine.roofline, load)
    print_table_head(out)

    records: list[dict[str, Any]] = []
    budget = CallBudget(config.timing.max_call_s)
    options = EngineOptions()
    weights: BenchWeights | None = None
    for e, mode, t, group in _groups(cases):
        if weights is None or weights.gate_up.shape[0] != e:
            weights = None  # free the previous layer before drawing the next
            gc.collect()
            weights = make_weights(
                e, config.hidden, config.intermediate, config.rank, config.alpha, WEIGHT_DTYPE, config.seed
            )
        batch = make_batch(t, e, config.top_k, config.hidden, WEIGHT_DTYPE, config.seed + t)
        rank = config.rank if mode is TrainMode.LORA else 0
        size = expert_flops(
            t, config.top_k, config.hidden, config.intermediate, rank, mode, ActivationPolicy.RETAIN
        )
        baselines = _measure_baselines(config, weights, batch, mode, options, budget, size.total)
        for case in group:
            step = RUNNERS.get("engine")(weights, batch, mode, replace(options, policy=case.policy))
            timing = measure(step.forward, step.backward, config.timing)
            rec = _record(case, config, machine, timing, step.held_bytes, batch, baselines)
            records.append(rec)
            print_row(out, rec)
    print_notes(out, records)
    return records
