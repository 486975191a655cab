"""MXFP4 facts the shared battery cannot state generically: dequantization equal bit for bit to transformers'
own (``convert_moe_packed_tensors``, what ``from_pretrained`` runs on a CPU) on arbitrary bytes and every
finite scale, the byte layout, the OCP quantization rule (shared exponent, ties to even, saturation) and its
per-element bound, and constructor errors that name the field."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

from moetune.engine.formats import Mxfp4Experts
from moetune.engine.formats.mxfp4 import BLOCK, EMAX, SCALE_BIAS
from moetune.errors import EngineError
from tests.unit.engine.test_formats import gaussian

E, H, I = 3, 128, 64


def _transformers(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """transformers' dequantization of our ``[E, O, D/2]`` bytes and ``[E, O, D/32]`` scales, as ``[E, O, D]``
    (it takes the checkpoint's ``[E, O, D/32, 16]`` blocks and returns the run-time transpose)."""
    blocks = codes.view(*scale.shape, BLOCK // 2)
    return convert_moe_packed_tensors(blocks, scale, dtype=dtype).transpose(1, 2)


def _random_stored(seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random bytes and scales covering every scale byte from 0 to 254; in blocks with scale 253 or 254 the
    magnitudes are kept below fp32's overflow (|value| < 4 and < 2), the largest the constructor accepts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for o, d in ((2 * I, H), (H, I)):
        codes = torch.randint(0, 256, (E, o, d // 2), dtype=torch.uint8, generator=gen)
        scale = torch.randint(0, 255, (E, o, d // BLOCK), dtype=torch.uint8, generator=gen)
        scale.view(-1)[:255] = torch.arange(255, dtype=torch.uint8)  # every finite scale, 0 and 254 included
        blocks = codes.view(E, o, d // BLOCK, BLOCK // 2)
        for s, mask in ((253, 0xDD), (254, 0xBB)):  # codes <= 5 (3.0) and <= 3 (1.5) in both nibbles
            blocks[scale == s] &= mask
        out += [codes, scale]
    return tuple(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantization_equals_transformers_bit_for_bit(dtype):
    gate_up, gate_up_scale, down, down_scale = _random_stored()
    fmt = Mxfp4Experts(gate_up, gate_up_scale, down, down_scale)
    got = fmt.dequantize(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for ours, codes, scale in zip(got, (gate_up, down), (gate_up_scale, down_scale)):
        want = _transformers(codes, scale, dtype)
        assert torch.isfinite(want).all()
        assert torch.equal(ours.view(bits), want.contiguous().view(bits))  # -0.0 and subnormals included
    tiny, huge = got[0].abs()[got[0] != 0].min(), got[0].abs().max()
    assert tiny.item() == 2.0**-128 and huge.item() >= 2.0**127  # the extremes were really exercised


def test_fp64_tiles_are_the_same_numbers():
    fmt = Mxfp4Experts(*_random_stored(1))
    for wide, narrow in zip(fmt.dequantize(torch.float64), fmt.dequantize(torch.float32)):
        assert torch.equal(wide, narrow.double())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_are_the_fp32_formula_on_every_byte_and_edge_scale(dtype):
    """Every code byte (all 16 e2m1 codes in both nibbles) under the edge scale bytes 0, 1, 126, 127, 128, 200,
    252, and 253 and 254 with the codes the constructor accepts, in whole tiles and 32-row blocks:
    ``FP4[code] * 2^(s - 127)`` in fp32 (exact), then in ``dtype``, bit for bit (signed zeros, bf16 and fp32
    subnormals included)."""
    edge = {0: 0xFF, 1: 0xFF, 126: 0xFF, 127: 0xFF, 128: 0xFF, 200: 0xFF, 252: 0xFF, 253: 0xDD, 254: 0xBB}
    h, i = 512, 32  # a gate_up row holds 256 bytes: every byte once, in 16 blocks
    codes = torch.empty(1, 2 * i, h // 2, dtype=torch.uint8)
    scale = torch.empty(1, 2 * i, h // BLOCK, dtype=torch.uint8)
    for r in range(2 * i):
        s, mask = list(edge.items())[r % len(edge)]
        codes[0, r] = torch.arange(256, dtype=torch.uint8).roll(r) & mask
        scale[0, r] = s
    down = torch.randint(
        0, 256, (1, h, i // 2), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    fmt = Mxfp4Experts(codes, scale, down & 0x77, torch.full((1, h, i // BLOCK), 100, dtype=torch.uint8))
    fp4 = torch.tensor(FP4_VALUES, dtype=torch.float32)
    for c, sc, proj in ((codes, scale, "gate_up"), (fmt.down, fmt.down_scale, "down")):
        values = torch.stack((fp4[c[0].long() & 15], fp4[c[0].long() >> 4]), dim=-1).flatten(1)
        powers = torch.pow(2.0, sc[0].double() - SCALE_BIAS).float()
        want = (values.view(*sc[0].shape, BLOCK) * powers[:, :, None]).flatten(1).to(dtype)
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        got = torch.empty(fmt.shape(proj), dtype=dtype)
        fmt.tile(proj, 0, dtype, got)
        assert torch.equal(got.view(bits), want.view(bits)), proj
        for r0 in range(0, got.shape[0], 32):
            fmt.tile(proj, 0, dtype, got[r0 : r0 + 32], rows=slice(r0, r0 + 32))
        assert torch.equal(got.view(bits), want.view(bits)), proj


def test_byte_layout_low_nibble_first():
    codes = torch.zeros(1, 64, 16, dtype=torch.uint8)
    scale = torch.full((1, 64, 1), SCALE_BIAS, dtype=torch.uint8)  # 2^0
    codes[0, 5, 0] = 0x7A  # element 0: code 0xA = -1.0; element 1: code 7 = 6.0
    scale[0, 5, 0] = SCALE_BIAS + 3  # 2^3
    down_codes = torch.zeros(1, 32, 16, dtype=torch.uint8)
    down_scale = torch.full((1, 32, 1), SCALE_BIAS, dtype=torch.uint8)
    gate_up, _ = Mxfp4Experts(codes, scale, down_codes, down_scale).dequantize()
    assert gate_up.shape == (1, 64, 32)
    assert gate_up[0, 5, :3].tolist() == [-8.0, 48.0, 0.0]
    assert gate_up.count_nonzero() == 2


def test_from_dense_scale_rule_ties_saturation_and_bound():
    gate_up, down = gaussian(e=2, h=H, i=I)
    # block 0 of gate_up[0, 0]: amax 3.9 -> scale 2^(1 - 2); values at every midpoint of the e2m1 grid
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5]) * 0.5
    gate_up[0, 0, :BLOCK] = 0
    gate_up[0, 0, : len(mids)] = mids
    gate_up[0, 0, len(mids)] = -3.9
    fmt = Mxfp4Experts.from_dense(gate_up, down)
    assert int(fmt.gate_up_scale[0, 0, 0]) == SCALE_BIAS + 1 - EMAX
    row = fmt.dequantize()[0][0, 0, :BLOCK]
    # ties to the even code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; 7.5 -> 6
    assert (row[: len(mids)] / 0.5).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]
    assert row[len(mids)].item() == -3.0  # -3.9 / 0.5 = -7.8: saturated at -6 (times 0.5)
    for got, ref, scale in zip(fmt.dequantize(), (gate_up, down), (fmt.gate_up_scale, fmt.down_scale)):
        amax = ref.abs().view(*scale.shape, BLOCK).amax(-1)
        shared = torch.floor(torch.log2(amax.double())) - EMAX  # the OCP rule
        assert torch.equal(scale.double() - SCALE_BIAS, shared)
        step = torch.pow(2.0, shared).repeat_interleave(BLOCK, dim=-1)
        assert torch.all((got - ref).abs().double() <= torch.maximum(ref.abs().double(), step) / 4)


def test_from_dense_is_idempotent_and_reads_every_float_dtype():
    gate_up, down = gaussian(e=2, h=H, i=I, seed=4)
    fmt = Mxfp4Experts.from_dense(gate_up, down)
    again = Mxfp4Experts.from_dense(*fmt.dequantize(torch.bfloat16))  # the grid holds its own values
    for dtype in (torch.float64, torch.bfloat16):
        other = Mxfp4Experts.from_dense(*(t.to(dtype) for t in fmt.dequantize()))
        assert all(
            torch.equal(a, b) for a, b in zip(other.state_tensors().values(), again.state_tensors().values())
        )
    for name, t in fmt.state_tensors().items():
        assert torch.equal(t, again.state_tensors()[name]), name


def test_all_zero_block_and_zero_sign():
    gate_up, down = torch.zeros(1, 64, 32), -torch.zeros(1, 32, 32)
    gate_up[0, 1, 3] = -1e-9  # too small for the block's grid: rounds to +0, not -0
    fmt = Mxfp4Experts.from_dense(gate_up, down)
    assert fmt.down.count_nonzero() == 0 and int(fmt.down_scale.max()) == 0  # 2^-127, codes +0
    assert fmt.gate_up[0, 0].count_nonzero() == 0


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("gate_up", torch.zeros(2, 64, 16, dtype=torch.int8), r"gate_up must be torch.uint8 \[E, 2I, H/2\]"),
        ("gate_up", torch.zeros(2, 63, 16, dtype=torch.uint8), "gate_up has 2I rows .* even count; got 63"),
        ("gate_up", torch.zeros(2, 64, 24, dtype=torch.uint8), "H = 48 is not a multiple of 32"),
        ("gate_up_scale", torch.zeros(2, 64, 2, dtype=torch.uint8), r"gate_up_scale must be .* \(2, 64, 1\)"),
        (
            "down",
            torch.zeros(2, 32, 8, dtype=torch.uint8),
            r"down must be torch.uint8 \[E, H, I/2\] = \(2, 32, 16\)",
        ),
        ("down_scale", torch.full((2, 32, 1), 255, dtype=torch.uint8), r"down_scale\[0\] holds the e8m0 NaN"),
        (
            "gate_up_scale",
            torch.full((2, 64, 1), 254, dtype=torch.uint8),
            r"gate_up\[0\] has a block whose .* overflow",
        ),
    ],
)
def test_constructor_names_the_bad_field(field, value, match):
    tensors = {
        "gate_up": torch.full((2, 64, 16), 0x44, dtype=torch.uint8),  # 2.0 everywhere
        "gate_up_scale": torch.full((2, 64, 1), SCALE_BIAS, dtype=torch.uint8),
        "down": torch.zeros(2, 32, 16, dtype=torch.uint8),
        "down_scale": torch.zeros(2, 32, 1, dtype=torch.uint8),
    }
    with pytest.raises(EngineError, match=match):
        Mxfp4Experts(**{**tensors, field: value})


def test_largest_finite_blocks_are_accepted():
    gate_up = torch.full((1, 64, 16), 0x55, dtype=torch.uint8)  # 3.0: 3 * 2^126 < 2^128
    gate_up[0, 1] = 0x33  # 1.5 under scale 254: 1.5 * 2^127
    scale = torch.full((1, 64, 1), 253, dtype=torch.uint8)
    scale[0, 1] = 254
    fmt = Mxfp4Experts(
        gate_up, scale, torch.zeros(1, 32, 16, dtype=torch.uint8), torch.zeros(1, 32, 1, dtype=torch.uint8)
    )
    assert torch.isfinite(fmt.dequantize()[0]).all()
    assert FP4_VALUES[5] * 2.0**126 == fmt.dequantize()[0][0, 0, 0].item()


@pytest.mark.parametrize(
    "gate_up,down,match",
    [
        (torch.zeros(2, 64, 48), torch.zeros(2, 48, 32), "H = 48 is not a multiple of 32"),
        (torch.zeros(2, 48, 64), torch.zeros(2, 64, 24), "I = 24 is not a multiple of 32"),
        (torch.full((2, 64, 32), float("nan")), torch.zeros(2, 32, 32), r"gate_up\[0\] holds NaN or Inf"),
    ],
)
def test_from_dense_rejects(gate_up, down, match):
    with pytest.raises(EngineError, match=match):
        Mxfp4Experts.from_dense(gate_up, down)
