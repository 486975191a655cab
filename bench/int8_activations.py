"""int8_activations per product: the int8 and int4 kernels' default against their 8-bit rows, side by side.

    python bench/int8_activations.py [--rows 1 4 8 16 32] [--experts 32] [--reps 3] [--threads 1]

For gate_up ``[1536, 2048]`` and down ``[2048, 768]`` (Qwen3-30B-A3B's experts), int8 (per-row scales) and int4
(groups of 64, symmetric), forward and backward: the AVX512-BF16 variant's default kernel (``int8_gemm``: 16-bit
integer rows; ``int4_gemm``: bf16) and its ``<kernel>_a8`` (``kernels/int8_rows.h``), each timed over ``--experts``
different weights in turn, so the codes come from memory as in the engine (cycled: each weight once per pass),
the two kernels alternating per pass; the best pass per kernel (ms per product) and the ratio. Prints the CPU and
ISA it ran on; needs AVX512-BF16.
"""

from __future__ import annotations

import argparse
import time

import torch

from moetune.engine.formats import Int4Experts, Int8Experts
from moetune.engine.kernels import load_variant
from moetune.engine.threads import set_engine_threads
from moetune.sysinfo import cpu_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32])
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    threads = set_engine_threads(args.threads)
    machine = cpu_info()
    print(f"bench/int8_activations.py | {machine.model} ({', '.join(machine.isa)}) | threads={threads}")
    kernels = load_variant("AVX512-BF16")
    gen = torch.Generator().manual_seed(0)
    e, h, i = args.experts, 2048, 768
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    down = torch.randn(e, h, i, generator=gen) / i**0.5
    formats = {
        "int8": Int8Experts.from_dense(gate_up, down),
        "int4 g64": Int4Experts.from_dense(gate_up, down, group_size=64),
    }
    del gate_up, down
    print(f"{'product':34} {'rows':>4} {'default ms':>10} {'a8 ms':>8} {'a8 speed':>8}")
    for label, fmt in formats.items():
        for proj in ("gate_up", "down"):
            o, k = fmt.shape(proj)
            kernel = fmt.fused_operands(proj, 0)[0]
            weights = [fmt.fused_operands(proj, x)[1] for x in range(e)]
            for forward in (True, False):
                for n in args.rows:
                    a = torch.randn(n, k if forward else o, generator=gen).bfloat16()
                    out = torch.zeros(n, o if forward else k, dtype=torch.bfloat16)
                    best = {kernel: float("inf"), f"{kernel}_a8": float("inf")}
                    for _ in range(args.reps):
                        for name in best:
                            fn = getattr(kernels, name)
                            t0 = time.perf_counter()
                            for w in weights:
                                fn(forward, a, out, *w, False)
                            best[name] = min(best[name], (time.perf_counter() - t0) / e * 1e3)
                    base, a8 = best.values()
                    what = f"{label} {proj} [{o}, {k}] {'forward' if forward else 'backward'}"
                    print(f"{what:34} {n:>4} {base:>10.3f} {a8:>8.3f} {base / a8:>7.2f}x")


if __name__ == "__main__":
    main()
