"""The engine's fixed cost per active expert: Python bookkeeping and op dispatch, with GEMMs made negligible.

    python bench/overhead.py [--experts 128 --tokens 2048 --hidden 64 --inter 32 --top-k 8 --rank 8 --reps 7]

A layer so narrow (H = 64, I = 32 by default) that its GEMMs cost next to nothing is run forward + backward
with every expert active, in lora and frozen mode; step time / active experts is then the per-expert overhead
the engine adds to any layer. Variants, interleaved round by round so machine noise falls on all alike:
``sequential-1``: one expert at a time on 1 thread; ``pool-N``: the expert pool with N workers (N = 2 ..
``--threads``); each also as ``...-py`` with the per-expert op sequences in Python (``EngineOptions.native_ops``
False) instead of compiled where the kernels load. Printed per variant: median wall-clock ms per step and per expert (us), and the process CPU time
per step (steadier on a shared machine: time spent descheduled does not count), with min-max over the rounds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from moetune.bench.runners import RUNNERS, Step, make_batch, make_weights
from moetune.engine import EngineOptions, TrainMode
from moetune.sysinfo import cpu_info


def _time(step: Step, threads: int) -> tuple[float, float]:
    torch.set_num_threads(threads)
    w0, c0 = time.perf_counter(), time.process_time()
    step.backward(step.forward())
    return time.perf_counter() - w0, time.process_time() - c0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--inter", type=int, default=32)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2, help="largest pool measured (pool-2 .. pool-N)")
    args = p.parse_args()
    cpu = cpu_info()
    print(
        f"{cpu.model} ({', '.join(cpu.isa)}), {cpu.logical_cpus} logical CPUs; load {os.getloadavg()[0]:.1f}"
    )
    weights = make_weights(args.experts, args.hidden, args.inter, args.rank, 2 * args.rank, torch.bfloat16, 0)
    batch = make_batch(args.tokens, args.experts, args.top_k, args.hidden, torch.bfloat16, 1)
    active = int(batch.topk_ids.unique().numel())
    print(
        f"E={args.experts} T={args.tokens} H={args.hidden} I={args.inter} k={args.top_k} r={args.rank}: "
        f"{active} active experts, bf16; {args.reps} interleaved rounds"
    )
    print(f"{'mode':8}{'variant':>14}{'ms/step':>10}{'us/expert':>11}{'CPU ms/step':>13}{'min-max ms':>16}")
    for mode in (TrainMode.LORA, TrainMode.FROZEN):
        variants = {"sequential-1": (1, 1)} | {f"pool-{n}": (n, n) for n in range(2, args.threads + 1)}
        steps = {
            name + suffix: (
                RUNNERS.get("engine")(
                    weights, batch, mode, EngineOptions(expert_workers=w, native_ops=native)
                ),
                n,
            )
            for name, (n, w) in variants.items()
            for suffix, native in (("", None), ("-py", False))
        }
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
        for rnd in range(args.reps + 1):  # round 0 warms up
            for name, (step, n) in steps.items():
                s = _time(step, n)
                if rnd:
                    samples[name].append(s)
        for name, s in samples.items():
            wall = statistics.median(w for w, _ in s) * 1e3
            cpu_ms = statistics.median(c for _, c in s) * 1e3
            spread = f"{min(w for w, _ in s) * 1e3:.1f}-{max(w for w, _ in s) * 1e3:.1f}"
            print(
                f"{mode.value:8}{name:>14}{wall:>10.1f}{wall * 1e3 / active:>11.0f}{cpu_ms:>13.1f}{spread:>16}"
            )


if __name__ == "__main__":
    main()
