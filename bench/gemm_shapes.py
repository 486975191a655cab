"""Expert GEMMs in row pieces of fixed sizes against whole-row GEMMs, with a fresh routing every step.

    python bench/gemm_shapes.py [--experts 32 128 --tokens 128 512 2048 --modes lora frozen --threads 1 --reps 5]

The engine benchmark's layer shape (H = 2048, I = 768, k = 8, r = 8, bf16 weights, retain policy). A training
run routes every batch differently, so each expert's row count, and with it the shape of each of its GEMMs,
changes from step to step; ``moetune bench engine`` times one batch over and over, so its shapes repeat.
Here every round draws a new routing (``--routing fresh``, the default; ``fixed`` reuses the first, as the
engine benchmark does) and times one forward + backward of the same engine two ways, interleaved (the order
alternates round by round): ``split`` (the default for bf16: rows in pieces from ``engine.shapes``) and
``whole`` (``EngineOptions(split_rows=False)``: one GEMM per expert and projection, a new oneDNN kernel for
every new row count). Printed per case: median process CPU ms of each (the steadier measure on a shared
machine), min-max, and whole / split; then wall-clock medians. The first round warms up.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moetune.bench.runners import make_batch, make_weights
from moetune.engine import DenseExperts, EngineOptions, ExpertEngine
from moetune.engine.threads import set_engine_threads
from moetune.sysinfo import cpu_info

H, I, K, R = 2048, 768, 8, 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, nargs="+", default=[32])
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--modes", nargs="+", choices=["lora", "frozen"], default=["lora"])
    p.add_argument("--routing", choices=["fresh", "fixed"], default="fresh")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--variants",
        nargs="+",
        choices=["split", "whole"],
        default=["split", "whole"],
        help="one alone, to count its kernel builds: ONEDNN_VERBOSE=all ... | grep -c create:cache_miss",
    )
    args = p.parse_args()
    threads = set_engine_threads(args.threads)
    cpu = cpu_info()
    print(
        f"bench/gemm_shapes.py | {cpu.model} ({', '.join(cpu.isa)}), {threads} threads, H={H} I={I} k={K} r={R}, "
        f"bf16, {args.routing} routing per round"
    )
    print(
        f"{'case':<22}{'split CPU ms':>22}{'whole CPU ms':>22}{'whole/split':>13}{'wall split/whole ms':>24}"
    )
    for e in args.experts:
        weights = make_weights(e, H, I, R, 16, torch.bfloat16, 0)
        dense = DenseExperts(weights.gate_up, weights.down)
        for mode in args.modes:
            lora = weights.lora if mode == "lora" else None
            engines = {
                name: ExpertEngine(dense, lora=lora, options=EngineOptions(split_rows=name == "split"))
                for name in args.variants
            }
            for t in args.tokens:
                cpu_ms: dict[str, list[float]] = {name: [] for name in engines}
                wall_ms: dict[str, list[float]] = {name: [] for name in engines}
                for rep in range(args.reps + 1):
                    b = make_batch(t, e, K, H, torch.bfloat16, rep if args.routing == "fresh" else 0)
                    order = list(engines) if rep % 2 == 0 else list(reversed(engines))
                    for name in order:
                        w0, c0 = time.perf_counter(), time.process_time()
                        _, saved = engines[name].forward(b.x, b.topk_ids, b.topk_weights)
                        engines[name].backward(saved, b.grad_y)
                        if rep:  # the first round warms up workspaces
                            cpu_ms[name].append((time.process_time() - c0) * 1e3)
                            wall_ms[name].append((time.perf_counter() - w0) * 1e3)
                med = {name: statistics.median(v) for name, v in cpu_ms.items()}
                cells = {name: f"{med[name]:.0f} ({min(v):.0f}-{max(v):.0f})" for name, v in cpu_ms.items()}
                wall = {name: f"{statistics.median(v):.0f}" for name, v in wall_ms.items()}
                ratio = f"{med['whole'] / med['split']:.2f}x" if len(med) == 2 else "-"
                case = f"E{e}-T{t}-{mode}"
                print(
                    f"{case:<22}{cells.get('split', '-'):>22}{cells.get('whole', '-'):>22}{ratio:>13}"
                    f"{' / '.join(wall.get(n, '-') for n in ('split', 'whole')):>24}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
