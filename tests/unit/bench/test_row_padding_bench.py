"""``bench/row_padding.py`` end to end on a tiny case: both parts print a row per case, the products' outputs on
padded rows equal the contiguous ones bit for bit. Nothing here asserts a speed."""

from __future__ import annotations

import re

import pytest

from moetune.engine.kernels import load_fused
from tests.unit.bench.scripts import run_script


def test_both_parts_print_every_case_and_equal_products():
    if load_fused() is None:
        pytest.skip("no kernel variant builds or runs here")
    args = ["--cols", "64", "2048", "--rows", "1", "9", "--tokens", "16", "--experts", "4", "--reps", "1"]
    lines = run_script("row_padding.py", *args)
    out = "\n".join(lines)
    products = [line for line in lines if re.match(r"\s+K\s+\d+ n", line)]
    assert len(products) == 2 * 2 * 2, out  # cols x rows x directions
    assert all(line.rstrip().endswith("=") for line in products), out
    assert "padded row strides 2080 / 768" in out
    steps = [line for line in lines if re.match(r"\s+T\s+16 (lora|frozen)", line)]
    assert len(steps) == 2, out
