"""bench/finite.py and bench/fp8_dequant.py run end to end at small sizes and print what they promise (no speed is
asserted; the dequantization must give torch's bits)."""

from __future__ import annotations

from tests.unit.bench.scripts import run_script


def test_finite_bench_times_every_check_per_dtype() -> None:
    lines = run_script("finite.py", "--threads", "1", "--reps", "1", "--shrink", "32")
    rows = [line for line in lines if line.startswith("1 thread(s) |")]
    assert len(rows) == 6  # two cases x bf16, fp32, float8 codes
    for row in rows:
        assert "all_finite" in row and "x over sum" in row
        assert ("isfinite" in row) == ("float8" not in row)  # torch has no isfinite for float8


def test_fp8_dequant_bench_gives_torchs_bits() -> None:
    lines = run_script("fp8_dequant.py", "--threads", "1", "--reps", "1", "--shrink", "32")
    rows = [line for line in lines if line.startswith("1 thread(s) |")]
    assert len(rows) == 3 and all(row.endswith("same bits: True") for row in rows)
