"""``bench/store_layout.py`` end to end on a tiny layer: every format and mode prints a step, the weights written
now start on a cache line, and the two layouts' steps give the same outputs bit for bit. Nothing here asserts a
speed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_every_format_prints_its_placement_and_equal_steps(tmp_path):
    args = ["--experts", "4", "--tokens", "16", "--reps", "1", "--dir", str(tmp_path)]
    run = subprocess.run(
        [sys.executable, "bench/store_layout.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines[0].startswith("bench/store_layout.py | ")
    placed = [line for line in lines if re.match(r"(bf16|int8|int4-g64|fp8_block): before ", line)]
    assert len(placed) == 4, run.stdout
    assert all(re.search(r"\| now gate_up \+0 ld \d+ down \+0 ld \d+$", line) for line in placed), run.stdout
    assert "now gate_up +0 ld 2080 down +0 ld 768" in placed[0]  # bf16: H = 2048's 4 KiB rows padded
    steps = [line for line in lines if re.match(r"\s+T\s+16 (lora|frozen)", line)]
    assert len(steps) == 4 * 2 and all(line.rstrip().endswith("=") for line in steps), run.stdout
    assert list(tmp_path.iterdir()) == []  # the stores went with the temporary folder
