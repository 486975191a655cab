"""``QuantMethod.quantize``: a merged weight written back in its checkpoint's format, read back by the release's
own definition (the testing module's independent dequantizers), within half a quantization step."""

from __future__ import annotations

import pytest
import torch

from moetune.loading.quant.base import QuantizedWeight
from moetune.loading.quant.compressed_tensors import CompressedInt4, unpack_codes
from moetune.loading.quant.fp8 import Fp8Method
from moetune.tensorfile import TensorInfo
from moetune.testing import kimi
from moetune.testing.fp8_checkpoint import dequantize_reference


def _weight(o: int, d: int, parts: dict[str, tuple[str, tuple[int, ...]]]) -> QuantizedWeight:
    infos = {
        role: TensorInfo(f"w.{role}", "model.safetensors", dtype, shape, 0)
        for role, (dtype, shape) in parts.items()
    }
    return QuantizedWeight(TensorInfo("w.weight", "model.safetensors", "X", (o, d), 0), infos)


def _matrix(o: int, d: int) -> torch.Tensor:
    w = torch.randn(o, d, generator=torch.Generator().manual_seed(0)) * 0.02
    w[:128, :128] = 0  # an all-zero block
    w[128:, :128] *= 1e-6  # a block below e4m3's normal range after scaling, in part
    return w


@pytest.mark.parametrize("scale_dtype", ["F32", "BF16", "F16"])
def test_fp8_blocks_round_trip_within_half_a_step(scale_dtype) -> None:
    o, d = 320, 200  # partial edge blocks both ways
    w = _matrix(o, d)
    weight = _weight(o, d, {"weight": ("F8_E4M3", (o, d)), "scale_inv": (scale_dtype, (3, 2))})
    parts = Fp8Method().quantize(weight, w)
    codes, scale = parts["weight"], parts["scale_inv"]
    assert codes.dtype == torch.float8_e4m3fn and codes.shape == (o, d)
    assert scale.dtype == {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}[scale_dtype]
    assert torch.isfinite(codes.float()).all() and codes.float().abs().max() <= 448
    got = dequantize_reference(codes, scale.float())
    per = scale.float().repeat_interleave(128, 0)[:o].repeat_interleave(128, 1)[:, :d]
    assert ((got - w).abs() <= w.abs() * 2.0**-4 + per * 2.0**-10).all()
    assert not got[:128, :128].any()


def test_compressed_int4_round_trips_within_half_a_group_step() -> None:
    o, d, g = 64, 256, 32
    w = _matrix(o, d)[:o]
    method = CompressedInt4(group_size=g, ignore=())
    weight = _weight(
        o, d, {"packed": ("I32", (o, d // 8)), "scale": ("BF16", (o, d // g)), "shape": ("I32", (2,))}
    )
    parts = method.quantize(weight, w)
    packed, scale = parts["packed"], parts["scale"]
    assert set(parts) == {"packed", "scale"} and packed.dtype == torch.int32 and packed.shape == (o, d // 8)
    assert scale.dtype == torch.bfloat16 and scale.shape == (o, d // g)
    assert unpack_codes(packed).min() >= 1  # symmetric: codes 1..15 (q in -7..7)
    got = kimi.dequantize_int4(packed, scale, g)
    assert ((got - w).abs() <= scale.float().repeat_interleave(g, dim=1) * 0.5 * (1 + 1e-6)).all()
