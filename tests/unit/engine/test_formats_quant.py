"""Per-format facts the shared battery cannot state generically: stored layouts, per-element error bounds
of the quantizers, FP8's convention (partial edge blocks, separate gate/up grids, every code exact), and
constructor errors that name the field and what is allowed."""

from __future__ import annotations

import math

import pytest
import torch

from moetune.engine import resolve_compute_dtype
from moetune.engine.formats import Fp8BlockExperts, Int4Experts, Int8Experts
from moetune.engine.formats import base as formats_base
from moetune.engine.formats.fp8_block import FP8, grid
from moetune.errors import EngineError
from tests.unit.engine.test_formats import gaussian

# ---- resolve_compute_dtype


@pytest.mark.parametrize("storage", [torch.int8, torch.uint8, torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("native", [True, False])
def test_quantized_storage_computes_like_bf16(monkeypatch, storage, native):
    class Cpu:
        native_bf16_gemm = native

    monkeypatch.setattr("moetune.engine.plan.cpu_info", lambda: Cpu())
    assert resolve_compute_dtype(storage) == (torch.bfloat16 if native else torch.float32)
    assert resolve_compute_dtype(torch.float16) == torch.float32  # unchanged
    assert resolve_compute_dtype(storage, torch.float64) == torch.float64  # a request wins


def test_from_dense_is_part_of_the_contract():
    assert "from_dense" in formats_base.ExpertFormat.__abstractmethods__


# ---- int8


def test_int8_codes_scales_and_per_element_bound():
    gate_up, down = gaussian(e=2, h=64, i=32)
    gate_up[1, 5] = 0  # an all-zero row: scale 1, codes 0, exact
    fmt = Int8Experts.from_dense(gate_up, down)
    assert fmt.gate_up.dtype == torch.int8 and fmt.gate_up_scale.shape == (2, 64)
    assert fmt.down.shape == (2, 64, 32) and fmt.down_scale.shape == (2, 64)
    assert int(fmt.gate_up.abs().max()) == 127  # the row max lands on the grid's end
    gq, dq = fmt.dequantize()
    for got, ref, scale in ((gq, gate_up, fmt.gate_up_scale), (dq, down, fmt.down_scale)):
        assert torch.all((got - ref).abs() <= scale[..., None] * (0.5 + 1e-6))  # round to nearest
    assert torch.equal(gq[1, 5], torch.zeros(64)) and fmt.gate_up_scale[1, 5] == 1


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("gate_up", torch.zeros(2, 8, 16, dtype=torch.int16), r"gate_up must be torch.int8 \[E, 2I, H\]"),
        ("gate_up", torch.zeros(2, 7, 16, dtype=torch.int8), "gate_up has 2I rows .* even count; got 7"),
        ("gate_up_scale", torch.ones(2, 8, dtype=torch.bfloat16), "gate_up_scale must be torch.float32"),
        (
            "down_scale",
            torch.ones(2, 4),
            r"down_scale must be torch.float32 \[E, H\] = \(2, 16\); got .*\(2, 4\)",
        ),
        (
            "down",
            torch.zeros(2, 16, 5, dtype=torch.int8),
            r"down must be torch.int8 \[E, H, I\] = \(2, 16, 4\)",
        ),
    ],
)
def test_int8_constructor_names_the_bad_field(field, value, match):
    args = {
        "gate_up": torch.zeros(2, 8, 16, dtype=torch.int8),
        "gate_up_scale": torch.ones(2, 8),
        "down": torch.zeros(2, 16, 4, dtype=torch.int8),
        "down_scale": torch.ones(2, 16),
    }
    args[field] = value
    with pytest.raises(EngineError, match=match):
        Int8Experts(**args)


# ---- int4


def _unpack_reference(packed: torch.Tensor) -> torch.Tensor:
    """[..., D/2] uint8 -> [..., D] codes, by the documented layout: byte j = u[j] | u[j + D/2] << 4."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_layout_is_the_documented_one(symmetric):
    gen = torch.Generator().manual_seed(1)
    e, h, i, g = 2, 64, 32, 32
    packed_gu = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=gen)
    packed_dn = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=gen)
    scale_gu = torch.rand(e, 2 * i, h // g, generator=gen).bfloat16()
    scale_dn = torch.rand(e, h, i // g, generator=gen).bfloat16()
    zeros = {}
    if not symmetric:
        zeros = {
            "gate_up_zero": torch.randint(0, 16, (e, 2 * i, h // g), dtype=torch.uint8, generator=gen),
            "down_zero": torch.randint(0, 16, (e, h, i // g), dtype=torch.uint8, generator=gen),
        }
    fmt = Int4Experts(packed_gu, scale_gu, packed_dn, scale_dn, group_size=g, **zeros)
    assert fmt.symmetric is symmetric
    gq, dq = fmt.dequantize(torch.float64)
    for got, packed, scale, zero in (
        (gq, packed_gu, scale_gu, zeros.get("gate_up_zero")),
        (dq, packed_dn, scale_dn, zeros.get("down_zero")),
    ):
        z = torch.full_like(scale, 8.0) if zero is None else zero.double()
        want = (
            _unpack_reference(packed).double() - z.repeat_interleave(g, -1)
        ) * scale.double().repeat_interleave(g, -1)
        assert torch.equal(got, want)


@pytest.mark.parametrize("symmetric,bound", [(True, 0.5), (False, 1.0)])
def test_int4_per_element_bound_and_exact_zeros(symmetric, bound):
    """Symmetric: nothing clips, so |error| <= step/2. Asymmetric: the top of the range may round one code
    past 15 and clip, so <= 1 step. Zeros stay exact (asymmetric: 0 is a grid point by construction)."""
    gate_up, down = gaussian(e=2, h=128, i=64)
    gate_up[0, 3, :64] = 0  # a zero group
    down[1, ::2, :] = 0  # zeros among non-zeros
    fmt = Int4Experts.from_dense(gate_up, down, group_size=64, symmetric=symmetric)
    gq, dq = fmt.dequantize()
    for got, ref, scale in ((gq, gate_up, fmt.gate_up_scale), (dq, down, fmt.down_scale)):
        step = scale.float().repeat_interleave(64, -1)
        assert torch.all((got - ref).abs() <= step * bound * (1 + 1e-6))
        assert torch.all(got[ref == 0] == 0)
    if not symmetric:
        assert fmt.gate_up_zero is not None and int(fmt.gate_up_zero.max()) <= 15


@pytest.mark.parametrize(
    "kwargs,h,i,match",
    [
        ({"group_size": 48}, 128, 64, r"group_size must be one of \[32, 64, 128\]; got 48"),
        ({"group_size": True}, 128, 64, r"group_size must be one of \[32, 64, 128\]; got True"),
        ({"group_size": 64}, 96, 64, r"H = 96 is not a multiple of group_size 64.*divide both: \[32\]"),
        (
            {"group_size": 128},
            256,
            64,
            r"I = 64 is not a multiple of group_size 128.*divide both: \[32, 64\]",
        ),
        ({"group_size": 32}, 80, 40, "H = 80 is not a multiple.*none of them does: use int8 or fp8_block"),
    ],
)
def test_int4_group_size_errors(kwargs, h, i, match):
    gate_up, down = gaussian(e=1, h=h, i=i)
    with pytest.raises(EngineError, match=match):
        Int4Experts.from_dense(gate_up, down, **kwargs)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("gate_up", torch.zeros(1, 64, 32, dtype=torch.int8), r"gate_up must be torch.uint8 \[E, 2I, H/2\]"),
        ("down_scale", torch.ones(1, 64, 2), r"down_scale must be torch.bfloat16 \[E, H, I/group_size\]"),
        (
            "gate_up_zero",
            torch.zeros(1, 64, 2, dtype=torch.uint8),
            "gate_up_zero and down_zero come together",
        ),
        ("zeros", 16, r"gate_up_zero values must be in \[0, 15\]; got 16"),
    ],
)
def test_int4_constructor_names_the_bad_field(field, value, match):
    fmt = Int4Experts.from_dense(*gaussian(e=1, h=64, i=32), group_size=32)
    args = {
        "gate_up": fmt.gate_up,
        "gate_up_scale": fmt.gate_up_scale,
        "down": fmt.down,
        "down_scale": fmt.down_scale,
        "group_size": 32,
    }
    if field == "zeros":
        args["gate_up_zero"] = torch.full((1, 64, 2), value, dtype=torch.uint8)
        args["down_zero"] = torch.zeros(1, 64, 1, dtype=torch.uint8)
    else:
        args[field] = value
    with pytest.raises(EngineError, match=match):
        Int4Experts(**args)


# ---- fp8_block


def _fp8_reference(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """One matrix [O, D] by the convention, block by block: fp8 value * scale_inv of its 128 x 128 block."""
    out = codes.double()
    for a in range(scale_inv.shape[0]):
        for b in range(scale_inv.shape[1]):
            out[a * 128 : (a + 1) * 128, b * 128 : (b + 1) * 128] *= float(scale_inv[a, b])
    return out


def test_fp8_partial_edge_blocks_and_separate_gate_up_grids():
    """H = 200, I = 72: partial blocks on every edge; gate and up each have their own 1 x 2 grid, so the up
    rows start a fresh block at row I (a fused grid over 2I rows would not)."""
    e, h, i = 2, 200, 72
    gate_up, down = gaussian(e=e, h=h, i=i)
    fmt = Fp8BlockExperts.from_dense(gate_up, down)
    assert fmt.gate_up.dtype == FP8 and fmt.down.dtype == FP8  # the bytes stay FP8
    assert fmt.gate_up_scale_inv.shape == (e, 2 * grid(i, h)[0], grid(i, h)[1]) == (e, 2, 2)
    assert fmt.down_scale_inv.shape == (e, *grid(h, i)) == (e, 2, 1)
    gq, dq = fmt.dequantize(torch.float64)
    for x in range(e):
        gate = _fp8_reference(fmt.gate_up[x, :i], fmt.gate_up_scale_inv[x, :1])
        up = _fp8_reference(fmt.gate_up[x, i:], fmt.gate_up_scale_inv[x, 1:])
        # fp32 product of two fp32 numbers, widened: equal to the fp64 product rounded to fp32
        assert torch.equal(gq[x], torch.cat([gate, up]).float().double())
        assert torch.equal(dq[x], _fp8_reference(fmt.down[x], fmt.down_scale_inv[x]).float().double())
    # scale_inv = block max-abs / 448 (DeepSeek-V3): every block's largest weight maps to +-448
    assert fmt.gate_up[0, :i, :128].float().abs().max() == 448


def test_fp8_per_element_bound():
    """Round to nearest: |error| <= 2^-4 |w| (half an ulp of 3 mantissa bits) for normal codes, and
    <= 2^-10 scale_inv (half the subnormal step 2^-9) below 2^-6 scale_inv."""
    gate_up, down = gaussian(e=2, h=256, i=128)
    fmt = Fp8BlockExperts.from_dense(gate_up, down)
    gq, _ = fmt.dequantize()
    s = fmt.gate_up_scale_inv[:, :, :, None, None].expand(2, 2, 2, 128, 128)
    s = s.permute(0, 1, 3, 2, 4).reshape(2, 256, 256)
    bound = torch.maximum(gate_up.abs() * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)
    assert torch.all((gq - gate_up).abs() <= bound)


def test_fp8_every_finite_code_dequantizes_exactly():
    """The bit-move dequantization against torch's own e4m3fn -> fp32 conversion, for all 254 finite codes
    (subnormals and both zeros included) and a non-power-of-two block scale."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # drop the two NaN codes
    row = torch.cat([codes, codes[:2]]).view(FP8)  # 256 columns: two column blocks
    gate_up = row.expand(1, 4, 256).contiguous()  # I = 2: gate rows 0-1 use grid row 0, up rows 2-3 row 1
    down = row[:2].expand(1, 256, 2).contiguous()
    scale = torch.tensor([[[0.37, 3.0], [2.0**-20, 1.0]]])
    fmt = Fp8BlockExperts(gate_up, scale, down, torch.ones(1, 2, 1))
    gq, dq = fmt.dequantize()
    want = row.float()
    assert torch.equal(gq[0, 1, :128], want[:128] * 0.37)
    assert torch.equal(gq[0, 1, 128:], want[128:] * 3.0)
    assert torch.equal(gq[0, 2, :128], want[:128] * 2.0**-20)
    assert torch.equal(gq[0, 2, 128:], want[128:])
    assert torch.equal(dq[0], down[0].float())


def _row_blocks(fmt, proj, dtype):
    """Expert 0's ``proj`` tile in ``dtype``, assembled from 128-row ``tile`` calls (the engine's row blocks)."""
    d_out, d_in = fmt.shape(proj)
    out = torch.empty(d_out, d_in, dtype=dtype)
    for r0 in range(0, d_out, 128):
        rows = slice(r0, min(r0 + 128, d_out))
        fmt.tile(proj, 0, dtype, out[rows], rows=rows)
    return out


# block scales at the edges: fp32's smallest subnormal, subnormal, smallest normal, non-powers of two, and the
# largest whose multiplier scale_inv * 2^8 stays finite (an fp32 block's max-abs / 448 is below 2^119.2)
_FP8_EDGE_SCALES = (2.0**-149, 2.0**-133, 2.0**-126, 0.37, 1.0, 3.0, 2.0**100, 1.75 * 2.0**119)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_tiles_are_the_rounded_product_on_every_code_and_edge_scale(dtype):
    """All 256 code bytes: the two NaN codes are refused, and every finite one (subnormals and both zeros
    included), under every edge scale, tiles in whole matrices and in 128-row blocks to fp8 value * scale_inv
    rounded once to fp32 (the fp64 product is exact), then to ``dtype``: what the integer decoding must
    reproduce bit for bit, infinities where the product overflows included."""
    codes = torch.arange(256, dtype=torch.uint8)
    nan = (codes & 0x7F) == 0x7F
    assert nan.sum() == 2
    for code in codes[nan].tolist():
        bad = torch.zeros(1, 256, 128, dtype=torch.uint8)
        bad[0, 3, 5] = code
        with pytest.raises(EngineError, match="holds NaN codes"):
            Fp8BlockExperts(
                bad.view(FP8), torch.ones(1, 2, 1), torch.zeros(1, 128, 128, dtype=FP8), torch.ones(1, 1, 1)
            )
    finite = codes[~nan]
    row = torch.cat([finite, finite[:2]])  # 256 columns: two column blocks
    rows = torch.stack([row.roll(x) for x in range(512)]).view(FP8)  # every code in every column
    scales = torch.tensor(_FP8_EDGE_SCALES + _FP8_EDGE_SCALES[::-1], dtype=torch.float32)  # 16 blocks each
    gate_up = rows[:512].view(1, 512, 256)  # I = 256: gate's grid rows 0-1, up's 2-3; H = 256: 2 columns
    down = rows[:256].view(1, 256, 256).contiguous()
    fmt = Fp8BlockExperts(gate_up, scales[:8].view(1, 4, 2), down, scales[8:].roll(3)[:4].view(1, 2, 2))
    for proj in ("gate_up", "down"):
        codes_, scale_inv = (
            (fmt.gate_up, fmt.gate_up_scale_inv) if proj == "gate_up" else (fmt.down, fmt.down_scale_inv)
        )
        want = _fp8_reference(codes_[0], scale_inv[0]).float().to(dtype)
        assert torch.isinf(want).any() and (want != 0).any()  # the extremes were really exercised
        whole = fmt.tile(proj, 0, dtype, torch.empty(fmt.shape(proj), dtype=dtype))
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        assert torch.equal(whole.view(bits), want.view(bits)), proj  # signed zeros and subnormals included
        assert torch.equal(_row_blocks(fmt, proj, dtype).view(bits), want.view(bits)), proj


def test_fp8_from_per_expert_equals_stacked():
    e, h, i = 3, 160, 96
    fmt = Fp8BlockExperts.from_dense(*gaussian(e=e, h=h, i=i))
    gi = grid(i, h)[0]
    per = Fp8BlockExperts.from_per_expert(
        gate=[fmt.gate_up[x, :i] for x in range(e)],
        gate_scale_inv=[fmt.gate_up_scale_inv[x, :gi] for x in range(e)],
        up=[fmt.gate_up[x, i:] for x in range(e)],
        up_scale_inv=[fmt.gate_up_scale_inv[x, gi:] for x in range(e)],
        down=[fmt.down[x] for x in range(e)],
        down_scale_inv=[fmt.down_scale_inv[x] for x in range(e)],
    )
    for a, b in zip(per.dequantize(), fmt.dequantize()):
        assert torch.equal(a, b)


def test_fp8_from_per_expert_names_the_bad_tensor():
    fmt = Fp8BlockExperts.from_dense(*gaussian(e=2, h=128, i=64))
    lists = {
        "gate": [fmt.gate_up[x, :64] for x in range(2)],
        "gate_scale_inv": [fmt.gate_up_scale_inv[x, :1] for x in range(2)],
        "up": [fmt.gate_up[x, 64:] for x in range(2)],
        "up_scale_inv": [fmt.gate_up_scale_inv[x, 1:] for x in range(2)],
        "down": [fmt.down[x] for x in range(2)],
        "down_scale_inv": [fmt.down_scale_inv[x] for x in range(2)],
    }
    bad = dict(lists, up=[lists["up"][0], lists["up"][1].float()])
    with pytest.raises(
        EngineError, match=r"up\[1\] must be torch.float8_e4m3fn \[I, H\] = \(64, 128\); got torch.float32"
    ):
        Fp8BlockExperts.from_per_expert(**bad)
    with pytest.raises(EngineError, match="one tensor per expert.*down=1"):
        Fp8BlockExperts.from_per_expert(**dict(lists, down=lists["down"][:1]))


@pytest.mark.parametrize(
    "field,value,match",
    [
        (
            "gate_up",
            torch.zeros(1, 8, 16, dtype=torch.bfloat16),
            r"gate_up must be torch.float8_e4m3fn \[E, 2I, H\]",
        ),
        (
            "gate_up_scale_inv",
            torch.ones(1, 1, 1),
            r"gate_up_scale_inv must be torch.float32 \[E, 2 ceil\(I/128\), ceil\(H/128\)\] = \(1, 2, 1\); got .*\(1, 1, 1\)",
        ),
        ("down_scale_inv", torch.ones(1, 1, 1, dtype=torch.float64), "down_scale_inv must be torch.float32"),
        ("down_scale_inv", torch.full((1, 1, 1), math.inf), "down_scale_inv holds non-finite values"),
        ("nan", 0xFF, r"gate_up\[0\] holds NaN codes"),
        ("nan", 0x7F, r"gate_up\[0\] holds NaN codes"),
    ],
)
def test_fp8_constructor_names_the_bad_field(field, value, match):
    args = {
        "gate_up": torch.zeros(1, 8, 16, dtype=FP8),
        "gate_up_scale_inv": torch.ones(1, 2, 1),
        "down": torch.zeros(1, 16, 4, dtype=FP8),
        "down_scale_inv": torch.ones(1, 1, 1),
    }
    if field == "nan":
        args["gate_up"].view(torch.uint8)[0, 5, 3] = value
    else:
        args[field] = value
    with pytest.raises(EngineError, match=match):
        Fp8BlockExperts(**args)


def test_fp8_nan_check_finds_the_expert_past_the_word_boundary():
    # 3 experts of 3 x 5 bytes: 45 bytes, so the NaN in the last expert's final byte sits in the non-word tail
    gate_up = torch.zeros(3, 2, 5, dtype=FP8)
    down = torch.zeros(3, 5, 1, dtype=FP8)
    down.view(torch.uint8)[2, 4, 0] = 0xFF
    with pytest.raises(EngineError, match=r"down\[2\] holds NaN codes"):
        Fp8BlockExperts(gate_up, torch.ones(3, 2, 1), down, torch.ones(3, 1, 1))
