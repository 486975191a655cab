"""Dense bf16 expert weights with contiguous rows against rows padded by one cache line, side by side in one process.

    python bench/row_padding.py [--products] [--engine] [--cols 2048 768] [--pad 32] [--rows 1 8 32 128]
                                [--tokens 128 512 2048] [--experts 128] [--reps 5] [--threads 1] [--variant NAME]

``formats/dense.py`` stores bf16 weight rows whose bytes are a multiple of 4 KiB one line further apart
(``row_stride``): the kernels' backward reads 64 rows at the same columns, and rows 4 KiB apart share one L1 set.
This prints what that layout buys, on this CPU:

* ``--products``: the kernel's ``bf16_gemm`` (the variant that loads here, or ``--variant``) on 32 experts of
  ``[1536, K]`` per ``--cols`` K, forward ``x [n, K] @ W^T`` and backward ``g [n, 1536] @ W``, W contiguous and W's
  rows ``K + --pad`` apart; ms per product (minimum over reps of the mean over experts), contiguous / padded
  (> 1: padding is faster), and whether the outputs are equal bit for bit (``=``).
* ``--engine``: one engine step (forward + backward, process CPU time) of a layer of ``--experts`` experts
  (H = 2048, I = 768, k = 8 or E if fewer, LoRA r = 8 or frozen) on the same weights held contiguous and as
  ``DenseExperts.empty`` lays them out; median and minimum over reps, reps interleaved.

Neither is a test: the ratios are this machine's, at the moment it ran (``docs/performance.md``, "Weight rows 4 KiB
apart").
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from types import ModuleType

import torch

from moetune.bench.runners import EngineStep, as_loaded, make_batch
from moetune.bench.timing import interleaved_min_ms
from moetune.engine import DenseExperts, EngineOptions, ExpertEngine, ExpertLoRA
from moetune.engine.kernels import load_fused, load_variant
from moetune.sysinfo import cpu_info

O = 1536  # the products' weight rows (a 2048-wide model's gate_up)
H, I, TOP_K, RANK = 2048, 768, 8, 8  # the engine's layer


def product(
    kernels: ModuleType, forward: bool, a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, e: int
) -> None:
    """Expert e's product: forward ``out = a @ w[e]^T``, backward ``out = a @ w[e]``."""
    kernels.bf16_gemm(forward, a, out, w[e], False)


def products(args: argparse.Namespace) -> None:
    kernels = load_variant(args.variant) if args.variant else load_fused()
    if kernels is None:
        print("products: no kernel variant builds or runs here")
        return
    dtype = torch.float32 if kernels.variant == "AVX2" else torch.bfloat16  # the variant's compute dtype
    print(f"products: bf16_gemm of the {kernels.variant} variant, 32 experts of [{O}, K], pad {args.pad}")
    gen = torch.Generator().manual_seed(0)
    for k in args.cols:
        flat = torch.randn(32, O, k, generator=gen).bfloat16()
        padded = torch.full((32, O, k + args.pad), float("nan"), dtype=torch.bfloat16)[:, :, :k]
        padded.copy_(flat)
        for n in args.rows:
            for forward in (True, False):
                a = torch.randn(n, k if forward else O, generator=gen).to(dtype)
                outs = {w: torch.empty(n, O if forward else k, dtype=dtype) for w in ("flat", "padded")}

                calls = {
                    name: partial(product, kernels, forward, a, w, outs[name])
                    for name, w in (("flat", flat), ("padded", padded))
                }
                for c in calls.values():
                    c(0)  # warm-up
                ms = interleaved_min_ms(calls, 32, args.reps)
                same = "=" if torch.equal(outs["flat"], outs["padded"]) else "!"
                print(
                    f"  K {k:5d} n {n:4d} {'forward ' if forward else 'backward'}  contiguous {ms['flat']:7.3f}  "
                    f"padded {ms['padded']:7.3f} ms  {ms['flat'] / ms['padded']:.2f}x {same}",
                    flush=True,
                )


def engine(args: argparse.Namespace) -> None:
    e, k = args.experts, min(TOP_K, args.experts)
    gen = torch.Generator().manual_seed(0)
    flat = (
        torch.randn(e, 2 * I, H, generator=gen).mul_(H**-0.5).bfloat16(),
        torch.randn(e, H, I, generator=gen).mul_(I**-0.5).bfloat16(),
    )
    padded = as_loaded(*flat)
    print(
        f"engine: E {e}, H {H}, I {I}, k {k}; padded row strides {padded[0].stride(1)} / {padded[1].stride(1)}"
    )
    lora = ExpertLoRA.init(e, H, I, RANK, 2 * RANK, dtype=torch.float32, generator=gen)
    lora.gate_up_B.normal_(0, 0.02, generator=gen)
    lora.down_B.normal_(0, 0.02, generator=gen)
    for t in args.tokens:
        batch = make_batch(t, e, k, H, torch.bfloat16, t)
        for mode in ("lora", "frozen"):
            steps = {
                name: EngineStep(
                    ExpertEngine(
                        DenseExperts(*w), lora=lora if mode == "lora" else None, options=EngineOptions()
                    ),
                    batch,
                )
                for name, w in (("flat", flat), ("padded", padded))
            }
            times: dict[str, list[float]] = {name: [] for name in steps}
            for rep in range(args.reps + 1):  # the first a warm-up
                for name, step in steps.items():
                    t0 = time.process_time()
                    step.backward(step.forward())
                    if rep:
                        times[name].append((time.process_time() - t0) * 1e3)
            med = {k: statistics.median(v) for k, v in times.items()}
            low = {k: min(v) for k, v in times.items()}
            print(
                f"  T {t:5d} {mode:6s}  contiguous median {med['flat']:8.1f} min {low['flat']:8.1f} | padded median "
                f"{med['padded']:8.1f} min {low['padded']:8.1f} ms | {med['flat'] / med['padded']:.3f}x median, "
                f"{low['flat'] / low['padded']:.3f}x min",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--products", action="store_true", help="the kernel's products (default: both parts)")
    ap.add_argument("--engine", action="store_true", help="engine steps (default: both parts)")
    ap.add_argument("--cols", type=int, nargs="+", default=[2048, 768])
    ap.add_argument(
        "--pad", type=int, default=32, help="elements between rows beyond K (32: one 64-byte line)"
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--variant", default=None, help="a kernel variant by name (default: the one that loads here)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    print(
        f"bench/row_padding.py | {cpu.model} ({', '.join(cpu.isa) or 'no SIMD flags found'}) | threads {args.threads}"
    )
    both = not (args.products or args.engine)
    if args.products or both:
        products(args)
    if args.engine or both:
        engine(args)


if __name__ == "__main__":
    main()
