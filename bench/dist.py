"""Routed experts over several processes: the MoE layer's training step, sharded vs replicated vs one process.

    python bench/dist.py [--experts 16 --hidden 1024 --inter 512 --top-k 4 --tokens 1024 --layers 2 --rank 8
                          --reps 5 --procs 2]
    python bench/dist.py --whole-step [--procs-list 1,2,4] [--fsdp] [--global-batch 4 --seq 256] [sizes as above]

``--whole-step``: a whole training step through ``moetune train``'s library path over 1, 2 and 4 processes, each
pinned to its cores, with tokens/s, time in and bytes handed to collectives per step, and the scaling model's
table (``moetune.bench.dist_step``; docs/distributed.md). Without it, the MoE layer alone:

A Qwen3-MoE checkpoint with experts of that size (fp32, random) is written to a temporary folder and loaded with
``moetune.load_model`` by each configuration, in fresh processes (``torchrun --standalone`` for several):

* ``single``: one process, every expert, all ``--tokens`` tokens;
* ``replicated``: ``--procs`` processes, each holding every expert and computing its ``tokens / procs`` tokens,
  then the all-reduce of the expert LoRA gradients that DDP runs;
* ``sharded``: ``--procs`` processes, each holding ``E / procs`` experts (``expert_parallel: sharded``), tokens
  exchanged with their owners (``moetune.layer.sharded``), then the same all-reduce (the expert LoRA stays whole
  on every rank: docs/distributed.md).

Each rank's engine threads are ``cores // procs`` (one process: every core). A step is the first MoE layer's
forward and backward with expert LoRA of rank ``--rank`` on uniformly random routing; printed per configuration:
median step time over ``--reps`` (the slowest rank's), tokens/s (all ranks' tokens), the time of the exchange
alone (``sharded_experts`` with an identity in place of the experts: the count and row all_to_alls plus sorting)
and of the LoRA-gradient all-reduce, bytes each rank sends to others per step (rows there and back, forward and
backward), the bytes of each rank's expert engines (every MoE layer) and the anonymous memory its ``load_model``
added (after a small model's load warmed the code paths; the experts plus the dense weights). The CPU and its ISA
come first. Nothing here is a test: numbers vary with the machine and its load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from moetune.dist import start
    from moetune.dist.exchange import ExpertOwners, sharded_experts
    from moetune.engine import ExpertLoRA
    from moetune.layer import CpuExperts
    from moetune.loading import load_model
    from moetune.testing.memory import rss_anon

    ranks = start(cpu=True, timeout_s=600)
    threads = max(1, (os.cpu_count() or 1) // ranks.local_world)
    kwargs: dict[str, Any] = dict(
        device="cpu",
        dtype="float32",
        num_threads=threads,
        progress=False,
        expert_parallel="sharded" if args.mode == "sharded" else "replicated",
    )
    load_model(args.warm, **kwargs)  # a small model first: code paths and the allocator warm, so
    gc.collect()  # the measured load adds its own weights only
    before = rss_anon()
    model = load_model(args.model, **kwargs)
    gc.collect()
    held = rss_anon() - before
    modules = [m for m in model.modules() if isinstance(m, CpuExperts)]
    engines = sum(m.engine.weights.nbytes for m in modules)
    experts = modules[0]
    e, h, i, r = args.experts, args.hidden, args.inter, args.rank
    gen = torch.Generator().manual_seed(0)
    lora = {  # the whole layer's expert LoRA, as PEFT holds it on every rank
        "gate_up_A": torch.randn(e, r, h, generator=gen) * 0.01,
        "gate_up_B": torch.randn(e, 2 * i, r, generator=gen) * 0.01,
        "down_A": torch.randn(e, r, i, generator=gen) * 0.01,
        "down_B": torch.randn(e, h, r, generator=gen) * 0.01,
    }
    for t in lora.values():
        t.requires_grad_()
    call_lora = ExpertLoRA(**lora, scaling=2.0)
    tokens = args.tokens // ranks.world
    gen.manual_seed(1 + ranks.rank)
    x = torch.randn(tokens, h, generator=gen).requires_grad_()
    ids = torch.topk(torch.rand(tokens, e, generator=gen), args.top_k).indices  # [T, k] uniform routing
    w = torch.softmax(torch.randn(tokens, args.top_k, generator=gen), -1).requires_grad_()
    grads = list(lora.values())

    def reduce_grads() -> float:
        if not ranks.distributed:
            return 0.0
        t0 = time.perf_counter()
        for g in grads:
            assert g.grad is not None
            dist.all_reduce(g.grad)
        return time.perf_counter() - t0

    def step() -> tuple[float, float]:
        for g in grads:
            g.grad = None
        if ranks.distributed:
            dist.barrier()
        t0 = time.perf_counter()
        experts.train()(x, ids, w, lora=call_lora).sum().backward()
        reduced = reduce_grads()
        return time.perf_counter() - t0, reduced

    def exchange_only() -> float:
        owners = ExpertOwners(e, ranks.world)
        dist.barrier()
        t0 = time.perf_counter()
        sharded_experts(x, ids, w, owners, lambda rows, local_ids: rows * 1.0, experts.group).sum().backward()
        return time.perf_counter() - t0

    step()  # warm-up: pools, buffers, first-touch pages
    times, reduce_s = zip(*(step() for _ in range(args.reps)))
    exchange = [exchange_only() for _ in range(args.reps)] if args.mode == "sharded" else [0.0]
    owners_of = torch.div(ids.reshape(-1), e // ranks.world, rounding_mode="floor")
    elsewhere = int((owners_of != ranks.rank).sum()) if args.mode == "sharded" else 0
    result = {
        "rank": ranks.rank,
        "step_s": statistics.median(times),
        "reduce_s": statistics.median(reduce_s),
        "exchange_s": statistics.median(exchange),
        "sent_bytes": elsewhere * h * 4 * 4 + elsewhere * 8,  # rows there and back, forward and backward; ids
        "held_bytes": held,
        "engine_bytes": engines,
        "threads": threads,
    }
    gathered: list[Any] = [None] * ranks.world
    if ranks.distributed:
        dist.all_gather_object(gathered, result)
        dist.destroy_process_group()
    else:
        gathered = [result]
    if ranks.is_main:
        print("RESULT " + json.dumps(gathered), flush=True)


def _run(cmd: list[str]) -> list[dict[str, Any]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1024, help="global tokens per step (split over ranks)")
    parser.add_argument("--layers", type=int, default=2, help="MoE layers in the checkpoint (RAM measured)")
    parser.add_argument("--rank", type=int, default=8, help="expert LoRA rank")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument(
        "--whole-step",
        action="store_true",
        help="a whole training step (moetune train's library path) over --procs-list processes instead of the layer",
    )
    parser.add_argument("--procs-list", default="1,2,4", help="--whole-step: process counts")
    parser.add_argument("--fsdp", action="store_true", help="--whole-step: the dense part under FSDP2")
    parser.add_argument(
        "--global-batch", type=int, default=4, help="--whole-step: packed rows per step (all ranks)"
    )
    parser.add_argument("--seq", type=int, default=256, help="--whole-step: tokens per packed row")
    parser.add_argument("--warmup", type=int, default=2, help="--whole-step: steps not timed")
    parser.add_argument("--timed", type=int, default=3, help="--whole-step: steps timed (tokens/s)")
    parser.add_argument("--profiled", type=int, default=2, help="--whole-step: steps profiled (collectives)")
    parser.add_argument("--step-worker", help=argparse.SUPPRESS)
    parser.add_argument("--step-out", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["single", "replicated", "sharded"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--warm", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.step_worker:
        from moetune.bench.dist_step import worker

        worker(args.step_worker, args.step_out, args.warmup, args.timed, args.profiled)
        return
    if args.worker:
        args.mode = args.worker
        _worker(args)
        return

    from moetune.bench.dist_step import bench_model
    from moetune.sysinfo import cpu_info
    from moetune.testing.tiny import save_tiny_model

    cpu = cpu_info()
    print(
        f"CPU: {cpu.model}; ISA: {', '.join(cpu.isa) or 'none of note'}; {cpu.physical_cores} physical cores"
    )
    if args.whole_step:
        _whole_step(args)
        return
    print(
        f"layer: E={args.experts} H={args.hidden} I={args.inter} k={args.top_k}, LoRA r={args.rank}, fp32, "
        f"{args.tokens} tokens per step over all ranks; {args.layers} MoE layers loaded"
    )
    layer_keys = ("experts", "hidden", "inter", "top_k", "tokens", "layers", "rank", "reps", "procs")
    options = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in layer_keys]
    with tempfile.TemporaryDirectory() as tmp:
        model = bench_model(args, Path(tmp) / "m")
        warm = save_tiny_model("qwen3_moe", Path(tmp) / "warm", tokenizer=False, num_experts=args.experts)
        me = [str(Path(__file__).resolve()), *options, f"--model={model}", f"--warm={warm}"]
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={args.procs}",
        ]
        runs = {
            "single (1 process)": _run([sys.executable, *me, "--worker=single"]),
            f"replicated ({args.procs} processes)": _run([*torchrun, *me, "--worker=replicated"]),
            f"sharded ({args.procs} processes)": _run([*torchrun, *me, "--worker=sharded"]),
        }
    header = f"{'configuration':26} {'step ms':>8} {'tokens/s':>9} {'exchange ms':>11} {'all-reduce ms':>13} "
    print(header + f"{'sent MB/rank':>12} {'engines MB/rank':>15} {'load RSS MB/rank':>16} threads")
    for name, ranks in runs.items():
        step = max(r["step_s"] for r in ranks)
        print(
            f"{name:26} {step * 1e3:8.1f} {args.tokens / step:9.0f} "
            f"{max(r['exchange_s'] for r in ranks) * 1e3:11.1f} {max(r['reduce_s'] for r in ranks) * 1e3:13.1f} "
            f"{max(r['sent_bytes'] for r in ranks) / 1e6:12.2f} "
            f"{'/'.join(format(r['engine_bytes'] / 1e6, '.0f') for r in ranks):>15} "
            f"{'/'.join(format(r['held_bytes'] / 1e6, '.0f') for r in ranks):>16} {ranks[0]['threads']}"
        )


def _whole_step(args: argparse.Namespace) -> None:
    from moetune.bench.dist_step import LINKS, measured_costs, print_table, run, scaling_table

    print(
        f"whole step: qwen3_moe E={args.experts} H={args.hidden} I={args.inter} k={args.top_k}, "
        f"{args.layers} MoE layers, LoRA r=8 on every target (experts included), AdamW, fp32; "
        f"{args.global_batch} packed rows of {args.seq} tokens per step over all ranks; dense part "
        f"{'FSDP2' if args.fsdp else 'DDP'}, experts replicated"
    )
    results = run(args)
    print_table(results)
    costs = measured_costs(results, args)
    tokens = args.global_batch * args.seq
    print(
        f"\nscaling model (moetune.bench.dist_step.expected_step) from these costs: {costs.s_per_token * 1e3:.3f} "
        f"ms/token, all-reduce {costs.allreduce_bytes / 1e6:.2f} MB/step, {tokens} tokens/step, sharded experts:"
    )
    print(scaling_table(costs, tokens, LINKS, (2, 4, 8, 16)))


if __name__ == "__main__":
    main()
