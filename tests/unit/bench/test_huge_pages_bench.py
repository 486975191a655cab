"""``bench/huge_pages.py`` end to end on a tiny layer: one child per setting, each with the allocator state it was
started for (torch advising huge pages with ``THP_MEM_ALLOC_ENABLE=1`` only), and a row per (T, mode). Nothing here
asserts a speed."""

from __future__ import annotations

import re

from tests.unit.bench.scripts import run_script


def test_each_setting_runs_in_its_own_process_and_every_case_prints_a_ratio():
    lines = run_script(
        "huge_pages.py",
        *("--experts", "4", "--hidden", "64", "--inter", "32", "--top-k", "2"),
        *("--tokens", "16", "32", "--reps", "1", "--rounds", "2"),
    )
    out = "\n".join(lines)
    assert "THP_MEM_ALLOC_ENABLE=0 (off): torch advises huge pages: {False}" in out
    assert "THP_MEM_ALLOC_ENABLE=1 (on): torch advises huge pages: {True}" in out
    row = (
        r"\s+T\s+(16|32) (lora|frozen)\s+[\d.]+\s+[\d.]+\s+[\d.]+x\s+\d+ \d+ \| \d+ \d+$"  # a child per round
    )
    rows = [line for line in lines if re.match(row, line)]
    assert len(rows) == 2 * 2, out
