"""``bench/row_padding.py`` end to end on a tiny case: both parts print a row per case, the products' outputs on
padded rows equal the contiguous ones bit for bit. Nothing here asserts a speed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from moetune.engine.kernels import load_fused

ROOT = Path(__file__).resolve().parents[3]


def test_both_parts_print_every_case_and_equal_products():
    if load_fused() is None:
        pytest.skip("no kernel variant builds or runs here")
    args = ["--cols", "64", "2048", "--rows", "1", "9", "--tokens", "16", "--experts", "4", "--reps", "1"]
    run = subprocess.run(
        [sys.executable, "bench/row_padding.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("bench/row_padding.py | ")
    products = [line for line in lines if re.match(r"\s+K\s+\d+ n", line)]
    assert len(products) == 2 * 2 * 2, run.stdout  # cols x rows x directions
    assert all(line.rstrip().endswith("=") for line in products), run.stdout
    assert "padded row strides 2080 / 768" in run.stdout
    steps = [line for line in lines if re.match(r"\s+T\s+16 (lora|frozen)", line)]
    assert len(steps) == 2, run.stdout
