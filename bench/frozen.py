"""Frozen experts against expert LoRA: forward and backward CPU time, interleaved in one process.

    python bench/frozen.py [--experts 32 --tokens 128 512 2048 --threads 1 --reps 5]

The engine benchmark's layer shape (H = 2048, I = 768, k = 8, r = 8, bf16 weights, retain policy) with
``--experts`` experts. Each rep runs the lora engine then the frozen one on the same batch, so machine noise
falls on both alike; printed per T: the minimum process CPU time of forward and backward for each, and
lora / frozen (the issue-13 target is >= 1.3x at every T), then the same from wall-clock minima. On a shared
machine CPU time is the steadier (time spent descheduled does not count); with several threads it includes
their waiting, so there the wall-clock ratio on a quiet machine is the measure. ``--per-expert-lora`` adds a
third engine, LoRA with ``EngineOptions(batch_lora=False)`` (each expert's LoRA products one by one, as before
``engine.lora_batch``), and prints per-expert / batched: the A/B of ``docs/performance.md``, "Small T".
"""

from __future__ import annotations

import argparse
import time

import torch

from moetune.bench.runners import make_batch, make_weights
from moetune.engine import DenseExperts, EngineOptions, ExpertEngine
from moetune.engine.threads import set_engine_threads
from moetune.sysinfo import cpu_info


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--per-expert-lora", action="store_true", help="also time LoRA with batch_lora=False")
    args = p.parse_args()
    threads = set_engine_threads(args.threads)
    h, i, k, r = 2048, 768, 8, 8
    cpu = cpu_info()
    print(
        f"bench/frozen.py | {cpu.model} ({', '.join(cpu.isa)}), {threads} threads, E={args.experts} H={h} I={i}"
    )
    weights = make_weights(args.experts, h, i, r, 16, torch.bfloat16, 0)
    dense = DenseExperts(weights.gate_up, weights.down)
    engines = {"lora": ExpertEngine(dense, lora=weights.lora), "frozen": ExpertEngine(dense)}
    if args.per_expert_lora:
        engines["lora-per-expert"] = ExpertEngine(
            dense, lora=weights.lora, options=EngineOptions(batch_lora=False)
        )
    for t in args.tokens:
        b = make_batch(t, args.experts, k, h, torch.bfloat16, t)
        times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in engines}
        wall: dict[str, list[float]] = {name: [] for name in engines}
        for rep in range(args.reps + 1):  # the first round warms up (workspaces, kernel choice)
            for name, engine in engines.items():
                w0, c0 = time.perf_counter(), time.process_time()
                _, saved = engine.forward(b.x, b.topk_ids, b.topk_weights)
                c1 = time.process_time()
                engine.backward(saved, b.grad_y)
                c2 = time.process_time()
                if rep:
                    wall[name].append((time.perf_counter() - w0) * 1e3)
                    times[name][0].append((c1 - c0) * 1e3)
                    times[name][1].append((c2 - c1) * 1e3)
        best = {name: (min(f), min(b_)) for name, (f, b_) in times.items()}
        (lf, lb), (ff, fb) = best["lora"], best["frozen"]
        print(
            f"T={t}: lora fwd {lf:.0f} + bwd {lb:.0f} ms, frozen fwd {ff:.0f} + bwd {fb:.0f} ms (CPU, min of "
            f"{args.reps}); lora / frozen {(lf + lb) / (ff + fb):.2f}x (fwd {lf / ff:.2f}x, bwd {lb / fb:.2f}x); "
            f"wall min {min(wall['lora']):.0f} / {min(wall['frozen']):.0f} ms = "
            f"{min(wall['lora']) / min(wall['frozen']):.2f}x"
        )
        if args.per_expert_lora:
            ef, eb = best["lora-per-expert"]
            print(
                f"    lora-per-expert fwd {ef:.0f} + bwd {eb:.0f} ms; per-expert / batched "
                f"{(ef + eb) / (lf + lb):.2f}x (CPU), {min(wall['lora-per-expert']) / min(wall['lora']):.2f}x (wall)"
            )


if __name__ == "__main__":
    main()
