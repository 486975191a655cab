"""The fused kernels' fp8_block and mxfp4 decoders (``Fp8BlockRows``, ``Mxfp4Rows`` in ``kernels/decoders.h``)
against float64 products on each format's own bf16-rounded weights (``dequantize(bf16)``: each weight rounded
once, as the torch path's tiles are; the backward's group-scaled form where the variant takes it: g times the
block's scale rounded once, times the code's value, ``test_fused_kernels._reference``), with ``test_fused_kernels``'
bound: ``2^-8 |ref|`` (the output's one rounding to bf16) plus ``K * 2^-22`` times the product of magnitudes (fp32
sums). A wrong scale block (another
128 x 128 block's, gate's grid for up's rows), a swapped nibble or a dropped 2^(s - 127) is off by a factor,
far outside it. Odd shapes cover partial fp8 blocks, I not a multiple of 128 (up's grid rows start mid-block)
and K off the kernels' 16/32/64-column steps; the engine with the kernels on is compared with the torch path.
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine import ExpertFormat
from moetune.engine.formats import Fp8BlockExperts, Mxfp4Experts
from moetune.engine.gemm import resolve_gemm_path
from moetune.engine.kernels import fused_variant, load_fused
from tests.unit.engine.test_formats import _lora, _module, gaussian
from tests.unit.engine.test_fused_kernels import _check, assert_same_bits_on_two_threads, needs_kernels
from tests.unit.engine_cases import make_routing, run_module

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_kernels]


def _weights(name: str, o: int, k: int, seed: int = 0) -> ExpertFormat:
    """One expert whose gate_up is ``[o, k]`` (gate rows then up rows) in ``name``; mxfp4's scales are spread
    over 2^-20 .. 2^20 so that every block's power of two matters."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(1, o, k, generator=gen) / k**0.5
    down = torch.randn(1, k, o // 2, generator=gen) / (o // 2) ** 0.5
    if name == "fp8_block":
        return Fp8BlockExperts.from_dense(gate_up, down)
    spread = 2.0 ** torch.randint(-20, 21, (1, o, k // 32, 1), generator=gen).double()
    return Mxfp4Experts.from_dense(
        (gate_up.double().view(1, o, k // 32, 32) * spread).view(1, o, k), down.double()
    )


@pytest.mark.parametrize("name", ["fp8_block", "mxfp4"])
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 17, 64, 65, 129, 300])
def test_kernel_matches_float64(name, forward, n):
    _check(_weights(name, 512, 384), forward, n, accumulate=n % 2 == 1)


@pytest.mark.parametrize(
    "name,o,k",
    [
        (
            "fp8_block",
            400,
            200,
        ),  # I = 200: up's rows start mid-block on grid row 2; K = 200: a partial column block
        ("fp8_block", 34, 40),  # everything inside one partial block; O and K off every tile size
        ("fp8_block", 258, 75),  # K odd; I = 129: up's grid rows start one row past a block
        ("fp8_block", 64, 2048),
        ("mxfp4", 192, 160),  # I = 96 (H, I multiples of 32 only): K = 160 off the 64-column strips
        ("mxfp4", 1536, 2048),
    ],
)
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
def test_kernel_odd_shapes(name, o, k, forward):
    for n in (3, 5, 7, 40):  # 7: the backward's group-scaled form decoded between its dot products (6-8 rows)
        _check(_weights(name, o, k, seed=o + k), forward, n, accumulate=True)


@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
def test_fp8_kernel_with_any_block_scale(forward):
    """fp8_block's table decoder (``Fp8BlockRows::bf16x32``: each block's 128 magnitudes times its scale_inv,
    the code's sign flipping bit 15) with scales a checkpoint may hold but ``from_dense`` never makes: negative
    (the sign must flip, not set, bit 15), zero (both zeros), and 2^-120 / 2^100 (products at the ends of bf16's
    range, subnormal ones included). Every code appears in every block. Against float64 on ``dequantize(bf16)``
    with ``_check``'s bound (the backward with few rows on AVX512-BF16: its group-scaled form, where these scales
    reach g instead, against that form's reference); a sign set instead of flipped is off by 2|ref| where the scale
    is negative."""
    base = _weights("fp8_block", 256, 512)
    codes = (torch.arange(256)[:, None] + torch.arange(512)[None, :]) % 256  # row r: codes r, r + 1, ...
    codes[codes == 0x7F] = 0x7E  # no NaN codes (the format refuses them)
    codes[codes == 0xFF] = 0xFE
    scale = torch.tensor([[0.01, -0.02, 0.0, 2.0**-120], [-(2.0**100), 3.0e-3, -1.5, 1.0]])  # [2, 4] blocks
    fmt = Fp8BlockExperts(
        codes.to(torch.uint8).view(torch.float8_e4m3fn)[None],
        scale[None],
        base.down,
        base.down_scale_inv,
    )
    assert fmt.dequantize(torch.float32)[0][0].abs().max() > 2.0**100
    for n in (1, 8, 40):
        _check(fmt, forward, n, accumulate=False)


@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
@pytest.mark.parametrize("n", [1, 8, 32])
def test_fp8_kernel_every_code_exact(forward, n):
    """Every e4m3fn code's value, subnormal ones (exponent 0: m * 2^-9) and both zeros included, read back exactly:
    W [256, 32] whose row r holds the codes r, r + 1, ... with block scales 1, multiplied by one-hot rows (x's row
    r picks column r, g's row r picks weight row r), so each output is one weight times 1, exact in bf16 on every
    path the kernel takes (the group-scaled forms decode each code's value by integer operations, Fp8BlockRows::
    raw32, with a table for the subnormal codes). A code decoded as another, a subnormal taken for a normal
    (2^-15 (1 + m / 8) for m 2^-17) or a lost sign differs from float64's ``to(float64)`` of the code."""
    kernels = load_fused()
    codes = (torch.arange(256)[:, None] + torch.arange(32)[None, :]) % 256
    codes[codes == 0x7F] = 0x7E  # no NaN codes
    codes[codes == 0xFF] = 0xFE
    fp8 = codes.to(torch.uint8).view(torch.float8_e4m3fn)
    scale_inv = torch.ones(2, 1)  # gate's grid row, up's (seg = 128)
    values = fp8.double()
    assert (values.abs() < 2.0**-6).sum() >= 15 * 32  # every subnormal magnitude in every column
    rows = torch.arange(n)
    if forward:
        a = torch.zeros(n, 32, dtype=torch.bfloat16)
        a[rows, rows] = 1
        want = values[:, :n].t()  # out[r, o] = W[o, r]
    else:
        pick = rows * 8 % 256  # weight rows 0, 8, ... (several 16-row blocks, both segments)
        a = torch.zeros(n, 256, dtype=torch.bfloat16)
        a[rows, pick] = 1
        want = values[pick]
    out = torch.full(want.shape, float("nan"), dtype=torch.bfloat16)
    kernels.fp8_block_gemm(forward, a, out, fp8, scale_inv, 128, 1, False)
    assert torch.equal(out.double(), want), (out.double() - want).abs().max()


def test_fp8_kernel_is_the_same_on_two_threads():
    """fp8_block's products on 2 intra-op threads give the bits of 1: each thread scales x for the grid rows of
    its own output blocks (the forward's group-scaled form, up to 32 rows), and each output element is summed by
    one thread in one order (8 rows: the backward's walk decoded between its products; 40: the panel and the
    staged walk)."""
    fmt = _weights("fp8_block", 512, 384)
    for n in (8, 20, 40):
        assert_same_bits_on_two_threads(fmt, n)


def test_engine_on_the_kernels_equals_the_torch_path():
    """Both formats' LoRA engine module (T = 40, E = 4, k = 2: 20 rows per expert, all on the kernels), forward
    and every gradient, kernels on vs off: the same bf16 weights, fp32 sums, so they differ by bf16 roundings of
    intermediates only (bound 2^-6 of each quantity's max, as for int8 and int4); a kernel decoding another
    weight would be off by the quantization error or O(1)."""
    gate_up, down = gaussian()
    x, ids, w = make_routing(T=40, E=gate_up.shape[0], k=2, H=gate_up.shape[2], dtype=torch.float32)
    gy = torch.randn(40, gate_up.shape[2], generator=torch.Generator().manual_seed(5))
    for fmt in (Fp8BlockExperts.from_dense(gate_up, down), Mxfp4Experts.from_dense(gate_up, down)):
        assert fmt.FUSED_MAX_ROWS.get(fused_variant(), 0) >= 20
        on, off = (_module(fmt, _lora(), compute_dtype=torch.bfloat16) for _ in range(2))
        off.engine.gemm.path = resolve_gemm_path(fmt, torch.bfloat16, fused=False)
        assert on.engine.gemm.path.fused_rows and not off.engine.gemm.path.fused_rows
        (y_on, g_on), (y_off, g_off) = (run_module(m, x, ids, w, gy) for m in (on, off))
        for label, a, b in [("y", y_on, y_off)] + [(n, g_on[n], g_off[n]) for n in g_off]:
            err = float((a.double() - b.double()).abs().max() / b.double().abs().max())
            assert err <= 2.0**-6, (fmt.name, label, err)
