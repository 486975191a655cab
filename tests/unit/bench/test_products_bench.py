"""``bench/products.py`` end to end on a tiny layer: a row per (product, rows, threads) with every format's ms and
ratio, the speed-ups per thread count, and the ``-a8`` labels run on the variant the engine takes for them, or refused
with the engine's reason where it has none.
Nothing here asserts a speed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from moetune.engine.gemm import int8_rows_problem
from moetune.engine.kernels import load_fused
from moetune.sysinfo import cpu_info
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


def test_a8_labels_run_where_the_engine_has_8_bit_rows():
    if load_fused() is None:
        pytest.skip("no kernel variant builds or runs here")
    isa = tuple(cpu_info().isa)
    if int8_rows_problem("int8", torch.bfloat16, isa) or int8_rows_problem("int4", torch.bfloat16, isa):
        pytest.skip("no kernel variant with 8-bit activation rows runs here")
    lines = run_script("products.py", *TINY, "--rows", "4", "--formats", "int8-a8", "int4-g64-a8")
    assert sum(bool(re.match(r"(gate_up|down) \[", line)) for line in lines) == 4, "\n".join(lines)


def test_an_a8_label_is_refused_with_the_engines_reason():
    """With the kernels turned off (``MOETUNE_KERNELS=off``) the engine would refuse int8_activations: so does the
    benchmark, naming the label, before it times anything."""
    if load_fused() is None:
        pytest.skip("no kernel variant builds or runs here")
    run = subprocess.run(
        [sys.executable, "bench/products.py", *TINY, "--rows", "4", "--formats", "int8", "int8-a8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MOETUNE_KERNELS": "off"},
    )
    assert run.returncode != 0
    assert "--formats int8-a8: int8_activations needs the fused kernels, which are off" in run.stderr, (
        run.stderr
    )
    assert "forward" not in run.stdout
