"""Running a benchmark script of ``bench/`` as users do, for the tests of its output."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_script(script: str, *args: str, timeout: int = 600) -> list[str]:
    """``python bench/<script> ARGS`` from the repository root: its stdout's lines, once it exited 0 and its first
    line is its header (``bench/<script> | <CPU> ...``)."""
    run = subprocess.run(
        [sys.executable, f"bench/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert lines and lines[0].startswith(f"bench/{script} | "), run.stdout[-2000:]
    return lines
