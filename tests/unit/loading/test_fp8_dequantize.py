"""loading.quant.fp8.dequantize_fp8 (the engine's integer decoding in row blocks) against torch's own e4m3 -> fp32
conversion times the block scale (``dequantize_reference``): the same fp32 bits, every code, partial blocks."""

from __future__ import annotations

import pytest
import torch

from moetune.engine.formats.fp8_block import grid
from moetune.loading.quant.fp8 import dequantize_fp8
from moetune.testing.fp8_checkpoint import dequantize_reference


def _codes(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Random e4m3fn codes, every finite byte (subnormals and both zeros included) equally likely."""
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    picks = torch.randint(0, len(finite), shape, generator=torch.Generator().manual_seed(seed))
    return finite[picks].view(torch.float8_e4m3fn)


@pytest.mark.parametrize("shape", [(576, 7168), (320, 256), (192, 200), (1, 5), (130, 129), (1100, 64)])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_same_bits_as_torchs_conversion(shape, scale_dtype):
    codes = _codes(shape, seed=shape[0])
    scale = (torch.rand(grid(*shape), generator=torch.Generator().manual_seed(1)) * 1e-2).to(scale_dtype)
    scale.view(-1)[0] = 2.0**-14  # a tiny scale: subnormal codes times it land in fp32's subnormal range
    want = dequantize_reference(codes, scale.float())
    got = dequantize_fp8(codes, scale)
    assert got.dtype == torch.float32 and torch.equal(got.view(torch.int32), want.view(torch.int32))
    transposed = codes.t().contiguous().t()  # a strided view reads the same
    assert torch.equal(dequantize_fp8(transposed, scale).view(torch.int32), want.view(torch.int32))


def test_nan_codes_and_infinite_scales_stay_non_finite():
    codes = _codes((256, 256), seed=3)
    codes.view(torch.uint8)[5, 7] = 0xFF
    codes.view(torch.uint8)[200, 9] = 0x7F
    scale = torch.rand(2, 2)
    got = dequantize_fp8(codes, scale)
    assert torch.equal(got.isnan(), dequantize_reference(codes, scale).isnan())
    assert got.isnan().nonzero().tolist() == [[5, 7], [200, 9]]
    scale[1, 1] = float("inf")
    assert torch.equal(dequantize_fp8(codes, scale).isfinite(), dequantize_reference(codes, scale).isfinite())
