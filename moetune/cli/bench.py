"""``moetune bench engine``: the expert engine against a plain autograd loop and transformers' experts module;
``moetune bench all``: every benchmark at one size into one JSON and one Markdown table
(``moetune.bench.suite``).

``engine`` parses the options into an ``EngineBenchConfig`` (``--quick`` starts from the small preset; any option given
overrides it), runs ``moetune.bench.engine.run_engine_bench`` and, with ``--json PATH``, writes its records.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from moetune.atomic import write_text_atomically
from moetune.errors import ConfigError

if TYPE_CHECKING:
    from moetune.bench.engine import EngineBenchConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``bench`` and its ``engine`` sub-command."""
    bench = subparsers.add_parser("bench", help="run a benchmark", description="Run a moetune benchmark.")
    which = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    which.required = True
    p = which.add_parser(
        "engine",
        help="time the CPU expert engine against a plain loop and transformers' grouped_mm experts",
        description="Time one MoE layer's routed experts, forward + backward, in the expert engine and in two "
        "baselines on the same bf16 weights, with this machine's roofline. The method is in docs/benchmarks.md.",
    )
    p.add_argument(
        "--quick", action="store_true", help="a small subset: E=64, T=128 and 512, lora and frozen, retain"
    )
    p.add_argument("--json", type=Path, metavar="PATH", help="write one JSON record per case to PATH")
    p.add_argument(
        "--cases", nargs="+", metavar="PATTERN", help="run only cases whose name matches, e.g. 'E64-T128-*'"
    )
    p.add_argument("--reps", type=int, help="timed repetitions per measurement (median reported)")
    p.add_argument("--warmup", type=int, help="untimed calls before the timed ones")
    p.add_argument(
        "--budget-s", type=float, help="stop repeating once timed calls add up to this many seconds"
    )
    p.add_argument(
        "--max-call-s", type=float, help="skip baselines and GEMMs predicted to take longer per call"
    )
    grid = p.add_argument_group("case grid (defaults: the full benchmark, or --quick's)")
    grid.add_argument("--experts", type=int, nargs="+", metavar="E", help="numbers of experts")
    grid.add_argument("--tokens", type=int, nargs="+", metavar="T", help="tokens per batch")
    grid.add_argument("--hidden", type=int, metavar="H", help="hidden size")
    grid.add_argument("--intermediate", type=int, metavar="I", help="expert intermediate size")
    grid.add_argument("--top-k", type=int, metavar="K", help="experts per token")
    grid.add_argument("--rank", type=int, metavar="R", help="LoRA rank")
    grid.add_argument("--modes", nargs="+", choices=["lora", "frozen"], help="training modes")
    grid.add_argument("--policies", nargs="+", choices=["retain", "recompute"], help="activation policies")
    grid.add_argument(
        "--baselines", nargs="*", choices=["loop", "hf"], help="baselines to run (none: engine only)"
    )
    machine = p.add_argument_group("roofline measurement")
    machine.add_argument("--gemm-rows", type=int, nargs="+", metavar="M", help="M of the peak GEMM shapes")
    machine.add_argument(
        "--bandwidth-mib", type=int, help="size of the tensor summed to measure read bandwidth"
    )
    p.add_argument(
        "--threads",
        type=int,
        nargs="+",
        metavar="N",
        help="torch threads (default: physical cores); two or more counts (e.g. 1 2 4 8) measure thread scaling "
        "instead: each case's step on every count, the engine's expert pool against one expert at a time",
    )
    p.add_argument(
        "--workers",
        type=int,
        nargs="+",
        metavar="W",
        help="with two or more --threads: also time W experts at a time on N / W intra-op threads each, per W",
    )
    p.add_argument(
        "--python-ops",
        action="store_true",
        help="with two or more --threads: also time the default with each expert's op sequences in Python "
        "(experts-py) instead of compiled, the A/B of kernels/ops.h",
    )
    p.add_argument(
        "--baseline-dtype",
        choices=["bfloat16", "float32"],
        help="dtype the loop/HF baselines compute in (default: the engine's compute dtype for bf16 experts "
        "on this CPU: bfloat16 with AMX-BF16/AVX512-BF16, else float32)",
    )
    p.set_defaults(func=run)
    add_all_parser(which)


def add_all_parser(which: argparse._SubParsersAction) -> None:
    """Register ``bench all``."""
    p = which.add_parser(
        "all",
        help="run every benchmark and write one JSON and one Markdown table with the runtime tuple",
        description="Run every moetune benchmark (engine, scaling, model, train_step, pipeline and the bench/ "
        "scripts) at one size; write bench-all.json and bench-all.md (CPU, ISA, cores, threads, torch/oneDNN "
        "versions, shapes, git commit) into --out. The default size is meant for minutes on 2 idle cores (16 measured on a heavily shared 2-core machine).",
    )
    p.add_argument(
        "--out", type=Path, required=True, metavar="DIR", help="folder for the two files (made if missing)"
    )
    p.add_argument(
        "--size",
        choices=["tiny", "small", "full"],
        default="small",
        help="tiny: seconds (a smoke run); small (default): minutes; full: each benchmark's full preset (hours)",
    )
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these benchmarks (default: every one)")
    p.add_argument("--threads", type=int, help="torch threads (default: physical cores)")
    p.set_defaults(func=run_all)


def run_all(args: argparse.Namespace) -> int:
    from moetune.bench.suite import run_suite  # here, not at the top: --help stays fast

    argv = ["moetune", "bench", "all", "--out", str(args.out), "--size", args.size]
    argv += ["--only", *args.only] if args.only else []
    argv += ["--threads", str(args.threads)] if args.threads else []
    result = run_suite(args.out, args.size, args.threads, tuple(args.only or ()), " ".join(argv))
    failed = [b["name"] for b in result["benchmarks"] if b["status"] != "ok"]
    if failed:
        print(
            f"moetune bench all: {len(failed)} failed: {', '.join(failed)} (their errors are in the report)"
        )
    return 1 if failed else 0


def config_from_args(args: argparse.Namespace) -> EngineBenchConfig:
    """The preset (full or ``--quick``) with every option the user gave applied on top."""
    import torch

    from moetune.bench.engine import QUICK, EngineBenchConfig  # here, not at the top: --help stays fast
    from moetune.engine import ActivationPolicy, TrainMode

    config = QUICK if args.quick else EngineBenchConfig()
    timing = {
        name: getattr(args, name)
        for name in ("reps", "warmup", "budget_s", "max_call_s")
        if getattr(args, name) is not None
    }
    fields = {
        "experts": tuple(args.experts) if args.experts else None,
        "tokens": tuple(args.tokens) if args.tokens else None,
        "hidden": args.hidden,
        "intermediate": args.intermediate,
        "top_k": args.top_k,
        "rank": args.rank,
        "modes": tuple(TrainMode(m) for m in args.modes) if args.modes else None,
        "policies": tuple(ActivationPolicy(p) for p in args.policies) if args.policies else None,
        "baselines": tuple(args.baselines) if args.baselines is not None else None,
        "cases": tuple(args.cases) if args.cases else None,
        "gemm_rows": tuple(args.gemm_rows) if args.gemm_rows else None,
        "bandwidth_bytes": args.bandwidth_mib * 2**20 if args.bandwidth_mib is not None else None,
        "threads": args.threads[0] if args.threads and len(args.threads) == 1 else None,
        "baseline_dtype": getattr(torch, args.baseline_dtype) if args.baseline_dtype else None,
        "timing": dataclasses.replace(config.timing, **timing) if timing else None,
    }
    return dataclasses.replace(config, **{k: v for k, v in fields.items() if v is not None})


def run(args: argparse.Namespace) -> int:
    from moetune.bench.engine import run_engine_bench

    config = config_from_args(args)
    if args.json is not None and not args.json.parent.is_dir():
        raise ConfigError(f"--json {args.json}: directory {args.json.parent} does not exist")
    if args.threads and len(args.threads) > 1:
        from moetune.bench.scaling import run_thread_scaling

        if any(n < 1 for n in args.threads):
            raise ConfigError(f"--threads must be positive integers; got {args.threads}")
        if args.workers and any(w < 1 for w in args.workers):
            raise ConfigError(f"--workers must be positive integers; got {args.workers}")
        records = run_thread_scaling(
            config, tuple(args.threads), sys.stdout, tuple(args.workers or ()), args.python_ops
        )
    else:
        records = run_engine_bench(config)
    if args.json is not None:
        write_text_atomically(args.json, json.dumps(records, indent=2) + "\n", durable=False)
        print(f"wrote {len(records)} records to {args.json}")
    return 0
