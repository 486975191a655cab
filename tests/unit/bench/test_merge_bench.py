"""bench/merge.py and bench/merge_precision.py run end to end at tiny sizes and print what they promise (no speed
is asserted; the precision table's bf16 column must keep the change, requantizing FP8 must lose most of a tiny one)."""

from __future__ import annotations

from tests.unit.bench.scripts import run_script


def test_merge_bench_prints_both_forms() -> None:
    lines = run_script("merge.py", "--experts", "4", "--hidden", "256", "--inter", "128", "--threads", "1")
    forms = [line.split()[1] for line in lines if line.startswith("--quantized")]
    assert forms == ["bfloat16:", "requantize:"]
    assert all("peak RSS" in line for line in lines if line.startswith("--quantized"))


def test_merge_precision_bench_shows_what_requantizing_loses() -> None:
    lines = run_script("merge_precision.py", "--rows", "256", "--cols", "256", "--b-std", "1e-4", "1e-2")
    rows = {
        (line.split()[0], line.split()[1]): line.split()
        for line in lines
        if line.split()[:1] in (["fp8_block"], ["compressed-int4"], ["mxfp4"])
    }
    assert len(rows) == 6
    kept, bf16_kept = float(rows["fp8_block", "1e-04"][3]), float(rows["fp8_block", "1e-04"][5])
    assert kept < 0.5 < 0.9 < bf16_kept
