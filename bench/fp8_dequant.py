"""FP8 block dequantization side by side: ``dequantize_fp8`` (the engine's integer decoding, row blocks) against
torch's e4m3 -> fp32 conversion followed by the same block multiply (``scale_blocks``; what it replaced).

    python bench/fp8_dequant.py [--threads 1 2] [--reps 7] [--shrink 1]

For DeepSeek-V3's shapes (an expert's gate ``[2048, 7168]`` and down ``[7168, 2048]``, ``kv_a_proj_with_mqa``
``[576, 7168]``): milliseconds (the best of ``--reps``, each rep running both in turn), values per second, the
speed-up, and whether both give the bits of ``dequantize_reference`` (the tests' reference). Each call returns a
fresh fp32 tensor, as the merge and the loader use it, so its page faults are in both times. Prints the CPU and
its ISA first.
"""

from __future__ import annotations

import torch

from moetune.bench.runtime import script_header, sweep_args
from moetune.bench.timing import interleaved_min_ms
from moetune.engine.formats.fp8_block import grid, scale_blocks
from moetune.loading.quant.fp8 import dequantize_fp8
from moetune.testing.fp8_checkpoint import dequantize_reference


def _torch_conversion(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = codes.to(torch.float32)
    scale_blocks(out, scale)
    return out


def main() -> None:
    args = sweep_args(__doc__, reps=7)
    print(script_header("bench/fp8_dequant.py"))
    gen = torch.Generator().manual_seed(0)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in [(2048 // args.shrink, 7168), (7168 // args.shrink, 2048), (576 // args.shrink, 7168)]:
            codes = (torch.randn(shape, generator=gen) * 64).to(torch.float8_e4m3fn)
            scale = torch.rand(grid(*shape), generator=gen) * 1e-2
            want = dequantize_reference(codes, scale)
            same = torch.equal(dequantize_fp8(codes, scale), want) and torch.equal(
                _torch_conversion(codes, scale), want
            )
            calls = {
                "torch": lambda _, c=codes, s=scale: _torch_conversion(c, s),
                "decode": lambda _, c=codes, s=scale: dequantize_fp8(c, s),
            }
            ms = interleaved_min_ms(calls, 1, args.reps)
            old, new = ms["torch"] / 1e3, ms["decode"] / 1e3
            n = codes.numel()
            print(
                f"{threads} thread(s) | {list(shape)}: torch's conversion {old * 1e3:.1f} ms ({n / old / 1e9:.2f} G/s), "
                f"dequantize_fp8 {new * 1e3:.1f} ms ({n / new / 1e9:.2f} G/s): {old / new:.2f}x, same bits: {same}"
            )


if __name__ == "__main__":
    main()
