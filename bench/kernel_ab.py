"""The kernels of a git revision against the working tree's, per product, side by side in one process.

    python bench/kernel_ab.py --base REV [--variant AVX512-BF16 | AMX-BF16 | AVX2] [--formats bf16 int8 int4 int4-asym fp8 mxfp4 int8-a8 int4-a8]
                              [--rows 1 8 16 32] [--experts 48] [--reps 5] [--threads 1]

For work on ``moetune/engine/kernels``: the variant's sources at ``REV`` (``git show``, into a temporary folder,
built with that revision's ``CFLAGS``) and in the working tree are both built (torch's ``cpp_extension``, keyed by
their text and flags, so a rebuild happens only when a source or a flag changed), then every product runs on both,
reps interleaved so that machine noise falls on both alike. Shapes: a 2048-wide model's gate_up ``[1536, 2048]`` and down ``[2048, 768]``, ``--experts`` distinct
weights multiplied in turn (each product streams its weight from memory, as an engine step does); forward
``x [n, K] @ W^T``, backward ``g [n, O] @ W``. Per row: ms per product (minimum over reps of the mean over experts)
for the revision and the tree, base / tree (> 1: the tree is faster), and whether the two outputs are equal bit
for bit (``=``) or not (``!``, with the largest difference relative to the largest output).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from types import ModuleType

import torch

from moetune.bench.kernel_builds import build_at, build_tree
from moetune.bench.timing import interleaved_min_ms
from moetune.engine.kernels.loader import variant_named
from moetune.sysinfo import cpu_info

SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}  # W [O, K]
FORMATS = ("bf16", "int8", "int4", "int4-asym", "fp8", "mxfp4")
# other int4 groups and zero points, on request: int4 is g64 symmetric, int4-asym g32 with zero points
MORE_FORMATS = ("int4-g32", "int4-g128", "int4-asym-g64", "int4-asym-g128")
# and the 8-bit activation rows' kernels (``<kernel>_a8``, int8_activations) of int8 and int4 (g64): int8-a8, int4-a8
A8_FORMATS = ("int8-a8", "int4-a8")

Product = Callable[[ModuleType, bool, torch.Tensor, torch.Tensor, int], None]


def weights(fmt: str, e: int, o: int, k: int, gen: torch.Generator) -> Product:
    """``e`` experts' ``[o, k]`` weights in ``fmt`` (random codes and scales in the formats' ranges) and the call
    that multiplies expert ``i``'s (``-a8``: the kernel's 8-bit activation rows' form)."""
    a8 = "_a8" if fmt.endswith("-a8") else ""
    fmt = fmt.removesuffix("-a8")
    if fmt == "bf16":
        w = torch.randn(e, o, k, generator=gen).bfloat16()
        return lambda m, fwd, a, out, i: m.bf16_gemm(fwd, a, out, w[i], False)
    if fmt == "int8":
        c8 = torch.randint(-127, 128, (e, o, k), generator=gen, dtype=torch.int8)
        s8 = torch.rand(e, o, generator=gen) * 0.01
        return lambda m, fwd, a, out, i: getattr(m, f"int8_gemm{a8}")(fwd, a, out, c8[i], s8[i], False)
    if fmt.startswith("int4"):
        parts = fmt.split("-")
        group = int(parts[-1][1:]) if parts[-1].startswith("g") else 64 if fmt == "int4" else 32
        p4 = torch.randint(0, 256, (e, o, k // 2), generator=gen, dtype=torch.uint8)
        s4 = (torch.rand(e, o, k // group, generator=gen) * 0.01).bfloat16()
        z4 = (
            torch.randint(0, 16, (e, o, k // group), generator=gen, dtype=torch.uint8)
            if "asym" in parts
            else None
        )
        return lambda m, fwd, a, out, i: getattr(m, f"int4_gemm{a8}")(
            fwd, a, out, p4[i], s4[i], None if z4 is None else z4[i], group, False
        )
    if fmt == "fp8":
        c = (torch.randn(e, o, k, generator=gen) * 0.5).to(torch.float8_e4m3fn)
        s = torch.rand(e, (o + 127) // 128, (k + 127) // 128, generator=gen) * 0.01
        return lambda m, fwd, a, out, i: m.fp8_block_gemm(fwd, a, out, c[i], s[i], 0, 0, False)
    if fmt == "mxfp4":
        pm = torch.randint(0, 256, (e, o, k // 2), generator=gen, dtype=torch.uint8)
        sm = torch.randint(118, 128, (e, o, k // 32), generator=gen, dtype=torch.uint8)
        return lambda m, fwd, a, out, i: m.mxfp4_gemm(fwd, a, out, pm[i], sm[i], False)
    raise SystemExit(f"--formats: no format {fmt!r}; the formats are {', '.join(FORMATS)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="git revision whose kernels are the baseline (e.g. HEAD~1)")
    ap.add_argument("--variant", default="AVX512-BF16")
    ap.add_argument(
        "--formats", nargs="+", default=list(FORMATS), choices=FORMATS + MORE_FORMATS + A8_FORMATS
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    variant = variant_named(args.variant)
    if variant is None:
        raise SystemExit(f"--variant: no kernel variant {args.variant!r}")
    torch.set_num_threads(args.threads)
    base = build_at(args.base, variant)
    tree = build_tree(variant)
    cpu = cpu_info()
    print(f"bench/kernel_ab.py | {cpu.model} ({', '.join(cpu.isa) or 'no SIMD flags found'})")
    print(
        f"variant {args.variant}, {args.threads} thread(s), {args.experts} experts per shape; base {args.base}"
    )
    print(
        f"{'format':9} {'shape':7} {'n':>3}  {'fwd base':>8} {'tree':>6} {'ratio':>6}    {'bwd base':>8} {'tree':>6} {'ratio':>6}"
    )
    gen = torch.Generator().manual_seed(0)
    for fmt in args.formats:
        for shape, (o, k) in SHAPES.items():
            call = weights(fmt, args.experts, o, k, gen)
            for n in args.rows:
                x, g = (  # operands in the variant's compute dtype (bf16; fp32 for AVX2)
                    torch.randn(n, k, generator=gen).to(variant.compute),
                    torch.randn(n, o, generator=gen).to(variant.compute),
                )
                line = f"{fmt:9} {shape:7} {n:>3}"
                for fwd, a, width in ((True, x, o), (False, g, k)):
                    outs = [torch.empty(n, width, dtype=variant.compute) for _ in range(2)]
                    for m, out in zip((base, tree), outs, strict=True):
                        call(m, fwd, a, out, 0)  # warm-up, and the outputs compared
                    same = torch.equal(outs[0], outs[1])
                    diff = (outs[0].float() - outs[1].float()).abs().max() / outs[0].float().abs().max()
                    best = interleaved_min_ms(
                        {
                            "base": partial(call, base, fwd, a, outs[0]),
                            "tree": partial(call, tree, fwd, a, outs[1]),
                        },
                        args.experts,
                        args.reps,
                    )
                    mark = "=" if same else f"! {float(diff):.1e}"
                    line += f"  {best['base']:>8.3f} {best['tree']:>6.3f} {best['base'] / best['tree']:>5.2f}x {mark:<2}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
