"""``bench/store_layout.py`` end to end on a tiny layer: every format and mode prints a step, the weights written
now start on a cache line, and the two layouts' steps give the same outputs bit for bit. Nothing here asserts a
speed."""

from __future__ import annotations

import re

from tests.unit.bench.scripts import run_script


def test_every_format_prints_its_placement_and_equal_steps(tmp_path):
    lines = run_script(
        "store_layout.py", "--experts", "4", "--tokens", "16", "--reps", "1", "--dir", str(tmp_path)
    )
    out = "\n".join(lines)
    placed = [line for line in lines if re.match(r"(bf16|int8|int4-g64|fp8_block): before ", line)]
    assert len(placed) == 4, out
    assert all(re.search(r"\| now gate_up \+0 ld \d+ down \+0 ld \d+$", line) for line in placed), out
    assert "now gate_up +0 ld 2080 down +0 ld 768" in placed[0]  # bf16: H = 2048's 4 KiB rows padded
    steps = [line for line in lines if re.match(r"\s+T\s+16 (lora|frozen)", line)]
    assert len(steps) == 4 * 2 and all(line.rstrip().endswith("=") for line in steps), out
    assert list(tmp_path.iterdir()) == []  # the stores went with the temporary folder
