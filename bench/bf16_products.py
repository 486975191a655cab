"""Dense bf16 expert products with few rows: the kernels' ``bf16_gemm`` against oneDNN (torch's bf16 GEMM, as the
engine calls it), per product, side by side in one run.

    python bench/bf16_products.py [--rows 1 4 8 12 16 24 32] [--experts 48] [--reps 5] [--threads 1]
                                  [--variant AVX512-BF16]

For a 2048-wide model's gate_up ``[1536, 2048]`` and down ``[2048, 768]``, ``--experts`` distinct matrices are
multiplied in turn, so every product streams its weight from memory as an engine step does. Forward is
``out [n, O] = x @ W^T`` (oneDNN: ``W @ x^T`` written transposed, ``BlockedGemm.matmul_wt``'s few-row form),
backward ``out [n, K] = g @ W``. Per n: ms per product (the minimum over reps of the mean over experts; each rep
runs every variant once, in turn, so machine noise falls on all alike) and oneDNN / kernel (> 1: the kernel is
faster). This is what ``DenseExperts.FUSED_MAX_ROWS`` (the engine's threshold per kernel variant) is read from;
``--variant`` names the variant to build (default AVX512-BF16: on an AMX CPU, the AVX512 loops against oneDNN's
AMX kernels).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType

import torch

from moetune.bench.timing import interleaved_min_ms
from moetune.engine.kernels import load_variant
from moetune.sysinfo import cpu_info

SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}  # W [O, K]


def products(
    kernels: ModuleType, weights: torch.Tensor, x: torch.Tensor, g: torch.Tensor
) -> dict[str, Callable[[int], None]]:
    """The four products of expert e's weight, by label: forward and backward, oneDNN and the kernel."""
    n, (o, k) = x.shape[0], weights.shape[1:]
    y, gx = torch.empty(n, o, dtype=torch.bfloat16), torch.empty(n, k, dtype=torch.bfloat16)
    tmp = torch.empty(o, n, dtype=torch.bfloat16)

    def onednn_fwd(e: int) -> None:
        torch.mm(weights[e], x.t(), out=tmp)
        y.copy_(tmp.t())

    return {
        "fwd oneDNN": onednn_fwd,
        "fwd kernel": lambda e: kernels.bf16_gemm(True, x, y, weights[e], False),
        "bwd oneDNN": lambda e: torch.mm(g, weights[e], out=gx),
        "bwd kernel": lambda e: kernels.bf16_gemm(False, g, gx, weights[e], False),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 12, 16, 24, 32])
    ap.add_argument("--experts", type=int, default=48, help="distinct weights multiplied in turn")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variant", default="AVX512-BF16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load_variant(args.variant)
    cpu = cpu_info()
    print(f"bench/bf16_products.py | {cpu.model} ({', '.join(cpu.isa) or 'no SIMD flags found'})")
    print(
        f"variant {args.variant}, {args.threads} thread(s), {args.experts} experts per shape, ms per product"
    )
    print(
        f"{'shape':8} {'n':>3} {'fwd oneDNN':>10} {'kernel':>7} {'ratio':>6}   {'bwd oneDNN':>10} {'kernel':>7} {'ratio':>6}"
    )
    gen = torch.Generator().manual_seed(0)
    for name, (o, k) in SHAPES.items():
        weights = torch.randn(args.experts, o, k, generator=gen).bfloat16()
        for n in args.rows:
            x = torch.randn(n, k, generator=gen).bfloat16()
            g = torch.randn(n, o, generator=gen).bfloat16()
            variants = products(kernels, weights, x, g)
            for fn in variants.values():  # warm-up: oneDNN builds its kernel for this shape
                fn(0)
            f0, f1, b0, b1 = interleaved_min_ms(variants, args.experts, args.reps).values()
            print(
                f"{name:8} {n:>3} {f0:>10.3f} {f1:>7.3f} {f0 / f1:>5.2f}x   {b0:>10.3f} {b1:>7.3f} {b0 / b1:>5.2f}x"
            )


if __name__ == "__main__":
    main()
