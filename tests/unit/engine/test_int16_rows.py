"""The int8 products of the variants that take the activations as 16-bit integer rows (``KernelVariant.int16_rows``:
the AVX512-BF16 variant's int16_rows.h, the AVX2 variant's avx2_int16.h): x, or g times the row scales, as 16-bit
integers per row (steps of the row's largest magnitude / qmax) against the codes, summed exactly in int32 lanes.
Each variant is built by name (``load_variant``) where this CPU runs it, so an AVX512 machine checks both.

``test_fused_kernels`` / ``test_fused_avx2`` check them against float64 with the activations quantized as the kernel
does (``int16_rows``); here against the exact product the format defines (x times codes times scales, in float64),
with the bound that form adds: half a step per activation, so ``step_r / 2 * sum_k |W[o, k]|`` on top of the
output's rounding and the fp32 sums. Also the forward's int32 lanes past K = 8192 (AVX512-BF16: qmax below 32767,
where 32767 would overflow; AVX2: 32767 at any K, its lanes converted to fp32 every 512 columns), and rows with a
nan or an infinity (their products nan, as the float product's would be, not finite numbers).
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine.kernels import VARIANTS, load_variant
from moetune.errors import EngineError
from tests.unit.engine.test_fused_kernels import HAS_COMPILER, forward_qmax, int16_rows

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler (c++/g++) on PATH"),
]

INT16_VARIANTS = [v for v in VARIANTS if "int8" in v.int16_rows]


@pytest.fixture(params=INT16_VARIANTS, ids=lambda v: v.name)
def variant(request):
    """A variant with int8 as 16-bit rows, built by name; skipped where this CPU cannot run it."""
    try:
        module = load_variant(request.param.name)
    except EngineError as err:
        pytest.skip(str(err))
    return request.param, module


def _qmax(variant, k: int, forward: bool) -> int:
    """The largest |q| of the rows: the AVX512-BF16 forward's depends on K (its lanes sum all of K), the rest 32767."""
    return forward_qmax(k) if forward and variant[0].name == "AVX512-BF16" else 32767


def _int8(o: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (o, k), generator=gen, dtype=torch.int8)
    return codes, torch.rand(o, generator=gen) * 0.01 + 0.001


def _operands(variant, a: torch.Tensor) -> torch.Tensor:
    """a in the variant's operand dtype (bf16, or fp32 for AVX2), whose values the references take."""
    return a.to(variant[0].compute)


def _run(variant, forward: bool, a: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    o, k = codes.shape
    out = torch.empty(a.shape[0], o if forward else k, dtype=variant[0].compute)
    variant[1].int8_gemm(forward, a, out, codes, scale, False)
    return out.double()


@pytest.mark.parametrize("o,k", [(1536, 2048), (64, 7168), (34, 40), (18, 75), (16, 14336)])
@pytest.mark.parametrize("n", [1, 5, 8, 9, 33])
def test_int8_products_within_half_a_step_of_the_exact_product(variant, o, k, n):
    codes, scale = _int8(o, k, seed=n)
    c, s = codes.double(), scale.double()
    w = c * s[:, None]  # W [O, K] exactly
    gen = torch.Generator().manual_seed(100 + n)
    for forward in (True, False):
        a = _operands(variant, torch.randn(n, k if forward else o, generator=gen))
        out = _run(variant, forward, a, codes, scale)
        ad = a.double()
        if forward:  # x's rows in steps of max |x_r| / qmax
            exact, mag = ad @ w.t(), ad.abs() @ w.abs().t()
            half_step = ad.abs().amax(1, keepdim=True) / _qmax(variant, k, True) / 2
            quantized = half_step * w.abs().sum(1)[None]
        else:  # (g * s)'s rows in steps of max |g_r * s| / 32767
            exact, mag = ad @ w, ad.abs() @ w.abs()
            half_step = (ad * s).abs().amax(1, keepdim=True) / 32767 / 2
            quantized = half_step * c.abs().sum(0)[None]
        width = k if forward else o
        rounding = 2.0**-8 if variant[0].compute == torch.bfloat16 else 2.0**-22  # the output's
        bound = rounding * exact.abs() + width * 2.0**-22 * mag + 1.001 * quantized
        assert float(((out - exact).abs() / bound).max()) <= 1.0, (forward, n)
        # and the quantization error is far inside the output's rounding on such data
        assert float((out - exact).abs().median()) < 2.0**-9 * float(exact.abs().median())


def test_forward_lanes_stay_exact_past_k_8192(variant):
    """K = 16384 and every product -128 * qmax. AVX512-BF16: qmax 16383, so a lane's 1024 products sum to just above
    -2^31 (with 32767 they would wrap around to a positive number), and the result is exact; AVX2: qmax 32767, its
    lanes (32 pairs each) converted to fp32 every 512 columns, so nothing wraps; the result is off only by the fp32
    step (1 / 32767)."""
    k = 16384
    assert forward_qmax(k) == 16383
    codes = torch.full((16, k), -128, dtype=torch.int8)
    scale = torch.full((16,), 2.0**-10)
    x = _operands(variant, torch.ones(8, k))
    out = _run(variant, True, x, codes, scale)
    exact = torch.full_like(out, -128.0 * k * 2.0**-10)
    if variant[0].name == "AVX512-BF16":
        assert torch.equal(out, exact)
    else:
        assert float((out / exact - 1).abs().max()) <= 2.0**-21


@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_row_with_a_nan_or_infinity_gives_nan_not_numbers(variant, forward, bad):
    o, k = 48, 96
    codes, scale = _int8(o, k, seed=3)
    gen = torch.Generator().manual_seed(4)
    a = _operands(variant, torch.randn(4, k if forward else o, generator=gen))
    a[2, 5] = bad
    out = _run(variant, forward, a, codes, scale)
    assert torch.isnan(out[2]).all()
    good = [0, 1, 3]
    q, step = int16_rows(a[good], None if forward else scale, _qmax(variant, k, forward))
    ref = step * (q @ codes.double().t()) * scale.double() if forward else step * (q @ codes.double())
    assert torch.allclose(out[good], ref, rtol=2.0**-7, atol=1e-6)


def test_the_same_bits_on_two_threads(variant):
    """The rows spread over the threads (more than 16384 values a share) and each output summed by one thread in
    one order: 1 and 2 intra-op threads give the same bits, forward and backward."""
    o, k, n = 96, 2048, 40
    codes, scale = _int8(o, k, seed=7)
    gen = torch.Generator().manual_seed(8)
    x, g = (_operands(variant, torch.randn(n, c, generator=gen)) for c in (k, o))
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        results.append((_run(variant, True, x, codes, scale), _run(variant, False, g, codes, scale)))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
