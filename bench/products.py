"""Each weight format's fused kernel against dense bf16's, per product, side by side in one run.

    python bench/products.py [--formats int8 int8-a8 int4-g64 int4-g64-a8 fp8_block mxfp4] [--rows 1 8 32 128]
                             [--experts 24] [--reps 3] [--threads 1 2] [--hidden 2048] [--inter 768]

For one layer's expert matrices, gate_up ``[2I, H]`` and down ``[H, I]`` (default: Qwen3-30B-A3B's), forward
``x [n, K] @ W^T`` and backward ``g [n, O] @ W``, with n rows: the milliseconds per product of bf16's kernel
(``bf16_gemm`` on the loader's padded rows) and of each format's (``ExpertFormat.fused_operands``; an ``-a8``
label takes the kernel's ``<kernel>_a8`` form, what ``int8_activations`` runs). Each kernel multiplies
``--experts`` different weights in turn, so that every product streams its weight from memory as an engine step
does, and each rep runs every kernel once, in turn (``interleaved_min_ms``: the minimum over reps of the mean over
experts), so machine noise falls on all of them alike. Printed per product, rows and thread count: bf16's ms, each
format's ms and bf16 / format (> 1: faster than bf16); with more than one ``--threads``, then each kernel's speed-up
at each thread count over the first. Formats are the labels of ``bench/formats.py`` without compressed-int4 (the
same kernel as int4-g64). Where no kernel variant runs it says so and exits 0; the ``-a8`` labels need one with
8-bit rows for the format that computes in this CPU's default variant's dtype (the variant the engine takes for
``int8_activations``: AVX512-BF16, on AMX CPUs too; int4 on an AVX2-only CPU: AVX2, in fp32).
Prints the CPU, its ISA and the variants it ran. ``moetune bench all`` runs it (``moetune.bench.suite``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from moetune.bench.timing import interleaved_min_ms
from moetune.bench.weight_formats import FORMAT_BUILDS, LABEL_OPTIONS, label_refused
from moetune.engine.formats.base import Projection
from moetune.engine.gemm import int8_rows_kernels
from moetune.engine.kernels import a8_kernel, load_fused, variant_named
from moetune.engine.threads import set_engine_threads
from moetune.sysinfo import cpu_info

LABELS = [label for label in FORMAT_BUILDS if label not in ("bf16", "compressed-int4")]
PROJS: tuple[Projection, ...] = ("gate_up", "down")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", choices=LABELS, default=LABELS, help="bf16 always runs")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--experts", type=int, default=24)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    args = ap.parse_args()
    machine = cpu_info()
    kernels = load_fused()
    if kernels is None:  # nothing to compare (as bench/row_padding.py: not a failure of `moetune bench all`)
        print(
            f"bench/products.py | {machine.model} | no kernel variant builds or runs here (moetune doctor says why)"
        )
        return
    variant = variant_named(kernels.variant)
    assert variant is not None
    # an -a8 label this CPU has no kernels for: refused before any weights are built
    for label in args.formats:
        why = label_refused(label, variant.compute, tuple(machine.isa))
        if why:
            raise SystemExit(f"bench/products.py: --formats {label}: {why}")
    gen = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    down = torch.randn(e, h, i, generator=gen) / i**0.5
    labels = ["bf16", *args.formats]
    formats = {}
    modules = {}  # label -> the built variant its products run on (an -a8 label: the one the engine takes)
    for label in labels:
        build, dtype = FORMAT_BUILDS[label]
        formats[label] = build(gate_up.to(dtype), down.to(dtype))
        modules[label] = kernels
        if label in LABEL_OPTIONS:
            modules[label] = int8_rows_kernels(formats[label], variant.compute, tuple(machine.isa), True)
    del gate_up, down
    a8 = sorted({m.variant for m in modules.values()} - {variant.name})
    print(
        f"bench/products.py | {machine.model} ({', '.join(machine.isa)}) | variant {variant.name}"
        + (f" (a8 labels: {', '.join(a8)})" if a8 else "")
        + f" | E {args.experts}, H {args.hidden}, I {args.inter}, {args.reps} reps"
    )
    threads = [set_engine_threads(t) for t in args.threads]
    print(f"{'product':28} {'n':>4} {'thr':>3} {'bf16 ms':>8}" + "".join(f" {lb:>20}" for lb in labels[1:]))
    scaling: list[str] = []
    for proj in PROJS:
        for forward in (True, False):
            for n in args.rows:
                o, k = formats["bf16"].shape(proj)
                a = torch.randn(n, k if forward else o, generator=gen).to(variant.compute)  # (AVX2: fp32)
                out = torch.zeros(n, o if forward else k, dtype=variant.compute)
                calls: dict[str, Callable[[int], None]] = {}
                for label, fmt in formats.items():
                    name = fmt.fused_operands(proj, 0)[0]
                    fn = getattr(modules[label], a8_kernel(name) if label in LABEL_OPTIONS else name)
                    weights = [fmt.fused_operands(proj, x)[1] for x in range(e)]
                    calls[label] = lambda x, fn=fn, w=weights, f=forward, a=a, out=out: fn(
                        f, a, out, *w[x], False
                    )
                what = f"{proj} [{o}, {k}] {'forward' if forward else 'backward'}"
                ms: dict[int, dict[str, float]] = {}
                for t in threads:
                    set_engine_threads(t)
                    for call in calls.values():  # warm-up at this thread count
                        call(0)
                    ms[t] = interleaved_min_ms(calls, e, args.reps)
                    cells = "".join(
                        f" {ms[t][lb]:8.3f} ({ms[t]['bf16'] / ms[t][lb]:5.2f}x)" for lb in labels[1:]
                    )
                    print(f"{what:28} {n:>4} {t:>3} {ms[t]['bf16']:8.3f}{cells}", flush=True)
                for t in threads[1:]:
                    ups = " ".join(f"{lb} {ms[threads[0]][lb] / ms[t][lb]:.2f}x" for lb in labels)
                    scaling.append(f"{what:28} {n:>4} {threads[0]} -> {t} threads: {ups}")
    if scaling:
        print("speed-up over the first thread count (ms at it / ms at these threads):")
        print("\n".join(scaling))


if __name__ == "__main__":
    main()
