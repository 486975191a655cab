"""The AVX512-BF16 variant's int8 products (int16_rows.h): x, or g times the row scales, as 16-bit integers per row
(steps of the row's largest magnitude / qmax) against the codes, summed exactly in int32 lanes.

``test_fused_kernels`` checks them against float64 with the activations quantized as the kernel does
(``int16_rows``); here against the exact product the format defines (bf16 x times codes times scales, in float64),
with the bound that form adds: half a step per activation, so ``step_r / 2 * sum_k |W[o, k]|`` on top of the
output's rounding and the fp32 sums. Also the forward's int32 lanes past K = 8192 (qmax below 32767, where 32767
would overflow), and rows with a nan or an infinity (their products nan, as the float product's would be, not
finite numbers).
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine.kernels import fused_variant, load_fused
from tests.unit.engine.test_fused_kernels import forward_qmax, int16_rows, needs_kernels

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    needs_kernels,
    pytest.mark.skipif(
        fused_variant() != "AVX512-BF16",
        reason="the int16 form is the AVX512-BF16 variant's (another one loads here)",
    ),
]


def _int8(o: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (o, k), generator=gen, dtype=torch.int8)
    return codes, torch.rand(o, generator=gen) * 0.01 + 0.001


def _run(forward: bool, a: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    o, k = codes.shape
    out = torch.empty(a.shape[0], o if forward else k, dtype=torch.bfloat16)
    load_fused().int8_gemm(forward, a, out, codes, scale, False)
    return out.double()


@pytest.mark.parametrize("o,k", [(1536, 2048), (64, 7168), (34, 40), (18, 75), (16, 14336)])
@pytest.mark.parametrize("n", [1, 5, 8, 9, 33])
def test_int8_products_within_half_a_step_of_the_exact_product(o, k, n):
    codes, scale = _int8(o, k, seed=n)
    c, s = codes.double(), scale.double()
    w = c * s[:, None]  # W [O, K] exactly
    gen = torch.Generator().manual_seed(100 + n)
    for forward in (True, False):
        a = torch.randn(n, k if forward else o, generator=gen).bfloat16()
        out = _run(forward, a, codes, scale)
        ad = a.double()
        if forward:  # x's rows in steps of max |x_r| / qmax
            exact, mag = ad @ w.t(), ad.abs() @ w.abs().t()
            half_step = ad.abs().amax(1, keepdim=True) / forward_qmax(k) / 2
            quantized = half_step * w.abs().sum(1)[None]
        else:  # (g * s)'s rows in steps of max |g_r * s| / 32767
            exact, mag = ad @ w, ad.abs() @ w.abs()
            half_step = (ad * s).abs().amax(1, keepdim=True) / 32767 / 2
            quantized = half_step * c.abs().sum(0)[None]
        width = k if forward else o
        bound = 2.0**-8 * exact.abs() + width * 2.0**-22 * mag + 1.001 * quantized
        assert float(((out - exact).abs() / bound).max()) <= 1.0, (forward, n)
        # and the quantization error is far inside the output's rounding on such data
        assert float((out - exact).abs().median()) < 2.0**-9 * float(exact.abs().median())


def test_forward_lanes_stay_exact_past_k_8192():
    """K = 16384: qmax 16383, so a lane's 1024 products of -128 * qmax sum to just above -2^31 (with 32767 they
    would wrap around to a positive number)."""
    k = 16384
    assert forward_qmax(k) == 16383
    codes = torch.full((16, k), -128, dtype=torch.int8)
    scale = torch.full((16,), 2.0**-10)
    x = torch.ones(8, k, dtype=torch.bfloat16)
    out = _run(True, x, codes, scale)
    assert torch.equal(out, torch.full_like(out, -128.0 * k * 2.0**-10))


@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_row_with_a_nan_or_infinity_gives_nan_not_numbers(forward, bad):
    o, k = 48, 96
    codes, scale = _int8(o, k, seed=3)
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(4, k if forward else o, generator=gen).bfloat16()
    a[2, 5] = bad
    out = _run(forward, a, codes, scale)
    assert torch.isnan(out[2]).all()
    good = [0, 1, 3]
    q, step = int16_rows(a[good], None if forward else scale, forward_qmax(k) if forward else 32767)
    ref = step * (q @ codes.double().t()) * scale.double() if forward else step * (q @ codes.double())
    assert torch.allclose(out[good], ref, rtol=2.0**-7, atol=1e-6)
