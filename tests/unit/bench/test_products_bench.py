"""``bench/products.py`` end to end on a tiny layer: a row per (product, rows, threads) with every format's ms and
ratio, the speed-ups per thread count, and an ``-a8`` label refused by name where no variant has 8-bit rows for it.
Nothing here asserts a speed."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from moetune.engine.kernels import load_fused, variant_named
from tests.unit.bench.scripts import ROOT, run_script

TINY = ("--experts", "3", "--hidden", "128", "--inter", "64", "--reps", "1")


def test_every_product_rows_and_thread_count_prints_each_format():
    kernels = load_fused()
    if kernels is None:
        pytest.skip("no kernel variant builds or runs here")
    formats = ["int8", "int4-g64", "fp8_block", "mxfp4"]
    lines = run_script("products.py", *TINY, "--rows", "1", "9", "--threads", "1", "2", "--formats", *formats)
    out = "\n".join(lines)
    cell = r"\s+[\d.]+ \(\s*[\d.]+x\)"
    row = (
        rf"(gate_up \[128, 128\]|down \[128, 64\]) (forward|backward)\s+(1|9)\s+(1|2)\s+[\d.]+({cell}){{4}}$"
    )
    rows = [line for line in lines if re.match(row, line)]
    assert len(rows) == 2 * 2 * 2 * 2, out  # projections x directions x rows x threads
    ups = [line for line in lines if "1 -> 2 threads:" in line]
    assert len(ups) == 2 * 2 * 2, out
    assert all(re.search(rf"{lb} [\d.]+x", up) for lb in ["bf16", *formats] for up in ups), out
    assert f"variant {kernels.variant}" in lines[0]


def test_a8_labels_run_where_the_variant_has_8_bit_rows_and_are_refused_elsewhere():
    kernels = load_fused()
    if kernels is None:
        pytest.skip("no kernel variant builds or runs here")
    variant = variant_named(kernels.variant)
    assert variant is not None
    args = [*TINY, "--rows", "4", "--formats", "int8-a8", "int4-g64-a8"]
    if "int8" in variant.int8_rows and "int4" in variant.int8_rows:
        lines = run_script("products.py", *args)
        assert sum(bool(re.match(r"(gate_up|down) \[", line)) for line in lines) == 4, "\n".join(lines)
        return
    run = subprocess.run(
        [sys.executable, "bench/products.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert run.returncode != 0
    assert "--formats int8-a8" in run.stderr and f"the {variant.name} variant has no 8-bit rows" in run.stderr
