"""How much of a LoRA change survives a merge into quantized weights, per format and size of the change.

    python bench/merge_precision.py [--rows 1024 --cols 2048 --rank 8 --weight-std 0.02 --b-std 1e-4 1e-3 1e-2]

A random weight (Gaussian, ``--weight-std``) is quantized as each release stores it (FP8 128 x 128 blocks as
DeepSeek-V3, compressed-tensors INT4 groups of 32 as Kimi-K2-Thinking, MXFP4 as gpt-oss) and dequantized: the
stored weight ``W``. A rank-``r`` LoRA change ``D = (alpha / r) B A`` (A as PEFT draws it, kaiming-uniform; B
Gaussian of std ``--b-std``: B grows from zero during training) is added and the sum quantized again by the
format's own writer, the way ``moetune export --merge --quantized requantize`` writes it, and in bf16, the way the
default ``--quantized bfloat16`` writes it. Printed per format and B std: ``|D| / |W|``, the share of D kept
(``<written - W, D> / |D|^2``, what ``MergeResult.kept`` reports) and the error relative to D
(``|written - W - D| / |D|``). Numerics only: no timing, so the machine does not matter (printed anyway).
"""

from __future__ import annotations

import argparse
import math

import torch

from moetune.loading.quant.base import QuantizedWeight
from moetune.loading.quant.compressed_tensors import CompressedInt4
from moetune.loading.quant.fp8 import Fp8Method
from moetune.loading.quant.mxfp4 import Mxfp4Method
from moetune.sysinfo import cpu_info
from moetune.tensorfile import TensorInfo


def _weight(o: int, d: int, parts: dict[str, tuple[str, tuple[int, ...]]]) -> QuantizedWeight:
    infos = {role: TensorInfo(f"w.{role}", "w", dtype, shape, 0) for role, (dtype, shape) in parts.items()}
    return QuantizedWeight(TensorInfo("w", "w", "X", (o, d), 0), infos)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--cols", type=int, default=2048)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16.0)
    p.add_argument("--weight-std", type=float, default=0.02)
    p.add_argument("--b-std", type=float, nargs="+", default=[1e-4, 1e-3, 1e-2])
    args = p.parse_args()
    machine = cpu_info()
    print(f"bench/merge_precision.py | {machine.model} ({', '.join(machine.isa) or 'no SIMD flags found'})")
    o, d, r = args.rows, args.cols, args.rank
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(o, d, generator=gen) * args.weight_std
    formats = {  # name -> (method, its weight, the weight as the method's logical shape)
        "fp8_block": (
            Fp8Method(),
            _weight(o, d, {"weight": ("F8_E4M3", (o, d)), "scale_inv": ("F32", ())}),
            False,
        ),
        "compressed-int4": (
            CompressedInt4(group_size=32, ignore=()),
            _weight(o, d, {"packed": ("I32", ()), "scale": ("BF16", ()), "shape": ("I32", ())}),
            False,
        ),
        "mxfp4": (Mxfp4Method(()), _weight(d, o, {"blocks": ("U8", ()), "scales": ("U8", ())}), True),
    }
    print(f"W [{o}, {d}] std {args.weight_std}, LoRA r={r}, alpha={args.alpha}")
    print(
        f"{'format':>16} {'B std':>8} {'|D|/|W|':>9} {'kept':>6} {'err/|D|':>8} {'bf16 kept':>9} {'bf16 err':>8}"
    )
    for name, (method, weight, transposed) in formats.items():
        logical = w.t().contiguous() if transposed else w  # MXFP4's logical weight is [D, O]
        stored = method.dequantize_parts(weight, method.quantize(weight, logical))
        for b_std in args.b_std:
            a = (torch.rand(r, d, generator=gen) * 2 - 1) / math.sqrt(d)
            b = torch.randn(o, r, generator=gen) * b_std
            delta = (args.alpha / r) * b @ a
            delta = delta.t().contiguous() if transposed else delta
            written = method.dequantize_parts(weight, method.quantize(weight, stored + delta))
            in_bf16 = (stored + delta).to(torch.bfloat16).float()
            rows = []
            for got in (written, in_bf16):
                change = got - stored
                rows += [
                    float((change * delta).sum() / (delta * delta).sum()),
                    float((change - delta).norm() / delta.norm()),
                ]
            print(
                f"{name:>16} {b_std:>8.0e} {float(delta.norm() / stored.norm()):>9.2e} {rows[0]:>6.2f} {rows[1]:>8.2f} "
                f"{rows[2]:>9.2f} {rows[3]:>8.3f}"
            )


if __name__ == "__main__":
    main()
