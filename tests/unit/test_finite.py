"""moetune.finite: all_finite and non_finite_mask against the element-wise check on values widened to fp64."""

from __future__ import annotations

import pytest
import torch

from moetune.finite import all_finite, non_finite_mask

FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]
REDUCED = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def _truth(t: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(t.to(torch.float64))


@pytest.mark.parametrize("dtype", FLOAT8)
def test_every_float8_code_is_judged_as_its_value(dtype):
    codes = torch.arange(256, dtype=torch.uint8).view(dtype)
    truth = _truth(codes)
    assert (
        1 <= int((~truth).sum()) <= 8
    )  # each format has some non-finite codes (e4m3fn: 2, e5m2: 8, fnuz: 1)
    assert [all_finite(codes[i : i + 1]) for i in range(256)] == truth.tolist()
    assert torch.equal(non_finite_mask(codes), ~truth)
    finite = codes[truth]
    assert all_finite(finite) and all_finite(finite.view(-1, 1).expand(-1, 3))
    # one bad code anywhere in a 3-D block of finite codes, in its layout and transposed
    block = finite[torch.randint(0, finite.numel(), (4, 6, 5), generator=torch.Generator().manual_seed(0))]
    for bad in codes[~truth]:
        for at in [(0, 0, 0), (3, 5, 4), (2, 1, 3)]:
            t = block.clone()
            t[at] = bad
            assert not all_finite(t) and not all_finite(t.transpose(0, 2))
            assert all_finite(t[:, :, [i for i in range(5) if i != at[2]]])


@pytest.mark.parametrize("dtype", REDUCED)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_value_anywhere_in_any_layout(dtype, value):
    base = torch.randn(7, 33, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert all_finite(base) and all_finite(base.t()) and all_finite(base[:, ::3])
    for at in [(0, 0), (6, 32), (3, 17)]:
        t = base.clone()
        t[at] = value
        assert not all_finite(t) and not all_finite(t.t()) and not all_finite(t[:, at[1]])
        assert all_finite(t[[i for i in range(7) if i != at[0]]])
        assert all_finite(t[:, ::2]) == (at[1] % 2 == 1)
        assert torch.equal(non_finite_mask(t), ~_truth(t))


def test_the_largest_finite_values_are_finite():
    for dtype in REDUCED + FLOAT8:
        for sign in (1, -1):  # their sum overflows: a reduction must not add them
            big = torch.full((64, 64), sign * torch.finfo(dtype).max, dtype=torch.float64).to(dtype)
            assert all_finite(big), (dtype, sign)


def test_empty_integer_and_bool_tensors_are_finite():
    assert all_finite(torch.empty(0)) and all_finite(torch.empty(0, dtype=torch.float8_e4m3fn))
    assert all_finite(torch.arange(5)) and all_finite(torch.ones(3, dtype=torch.bool))
