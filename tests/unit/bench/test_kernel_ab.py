"""``bench/kernel_ab.py``: the kernels of a git revision against the working tree's, end to end on a tiny case.
Nothing here asserts a speed."""

from __future__ import annotations

import shutil

import pytest

from moetune.sysinfo import cpu_info
from tests.unit.bench.scripts import ROOT, run_script

pytestmark = [
    pytest.mark.slow,  # two kernel builds, ~40 s each
    pytest.mark.skipif(
        shutil.which("git") is None or not (ROOT / ".git").exists() or shutil.which("g++") is None,
        reason="needs git, the repository's history and g++",
    ),
    pytest.mark.skipif("AVX512-BF16" not in cpu_info().isa, reason="the default variant needs AVX512-BF16"),
]


def test_the_same_kernels_give_equal_outputs_and_every_row():
    """HEAD's kernels against the tree's (the same sources in a clean clone): every product of every format runs
    on both and the outputs are reported equal bit for bit."""
    formats = ["bf16", "int8", "int4", "int4-asym", "fp8", "mxfp4", "int8-a8", "int4-a8"]
    args = ["--base", "HEAD", "--rows", "1", "9", "--experts", "2", "--reps", "1", "--formats", *formats]
    lines = run_script("kernel_ab.py", *args, timeout=900)
    assert "AVX512-BF16" in lines[0]
    rows = [line for line in lines if line.split()[:1] and line.split()[0] in formats]
    assert len(rows) == len(formats) * 2 * 2, lines  # formats x shapes x row counts
    for row in rows:  # "fmt shape n  base tree ratio mark  base tree ratio mark"
        fields = row.split()
        assert fields[6] == "=" and fields[10] == "=", row
