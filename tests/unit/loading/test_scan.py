"""loading.scan: the check never lets a NaN/Inf through and never refuses finite weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moetune.errors import NonFiniteWeightError
from moetune.loading.scan import check_finite_layer

E, H, I = 4, 8, 6
LAYER = SimpleNamespace(
    sources=[],
    site=SimpleNamespace(path="model.layers.3.mlp.experts", layout=SimpleNamespace(intermediate_size=I)),
)


def _tensors(dtype=torch.float32):
    return {
        "gate_up": torch.randn(E, 2 * I, H).to(dtype),
        "down": torch.randn(E, H, I).to(dtype),
        "down_bias": None,
    }


def test_finite_values_whose_sum_overflows_are_accepted():
    t = _tensors()
    t["down"][2].fill_(3e38)  # finite, but their fp32 sum is inf: the exact check must clear them
    check_finite_layer(LAYER, t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize(
    "values, counts",
    [((float("nan"),), "1 NaN and 0 Inf"), ((float("inf"), float("-inf")), "0 NaN and 2 Inf")],
)
def test_non_finite_values_are_refused_naming_layer_and_expert(dtype, values, counts):
    t = _tensors(dtype)
    for n, v in enumerate(values):
        t["gate_up"][1, I + n, 2] = v  # up rows: inf - inf cancels to NaN in the sum, still caught
    with pytest.raises(NonFiniteWeightError, match=rf"model.layers.3.mlp.experts \(expert 1\) hold {counts}"):
        check_finite_layer(LAYER, t)


def test_integer_tensors_are_left_to_their_format():
    check_finite_layer(LAYER, {"gate_up": torch.full((E, 2 * I, H), 127, dtype=torch.int8)})


def test_a_ranks_share_is_named_by_the_layers_expert_ids():
    t = _tensors()
    t["down"][1, 0, 0] = float("nan")  # index 1 of a rank holding experts 4-7 (expert_parallel: sharded)
    with pytest.raises(NonFiniteWeightError, match=r"model.layers.3.mlp.experts \(expert 5\)"):
        check_finite_layer(LAYER, t, first=4)


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_float8_codes_are_scanned_by_value(code):
    """FP8 codes (a stored layer's ``state_tensors``): finite ones pass, a NaN code is named by expert (torch has
    no isfinite for float8: this check once raised its NotImplementedError instead)."""
    t = {k: v.to(torch.float8_e4m3fn) for k, v in _tensors().items() if v is not None}
    check_finite_layer(LAYER, t)
    t["down"].view(torch.uint8)[2, 3, 1] = code
    with pytest.raises(NonFiniteWeightError, match=r"experts \(expert 2\) hold 1 NaN and 0 Inf"):
        check_finite_layer(LAYER, t)
