"""bench/hot_overlap.py runs end to end on a tiny layer and prints what it promises (no speed is asserted)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "hot_overlap.py"


def test_hot_overlap_bench_prints_the_hidden_share_of_both_passes(monkeypatch, capsys) -> None:
    threads = torch.get_num_threads()
    sizes = "--experts 8 --hot 2 --tokens 16 --hidden 32 --inter 16 --top-k 2 --rank 2 --reps 1 --threads 1 --device-ms 1"
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *sizes.split()])
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert (
        "logical CPUs" in out and "hot experts on cpu, simulated device time 1 ms" in out
    )  # CPU, ISA, device
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  ")}
    assert set(rows) == {"forward", "backward"}
    for row in rows.values():
        assert len(row) == 5 and row[4].endswith("%") and all(float(v) > 0 for v in row[1:4])
    with pytest.raises(SystemExit):  # --help describes the method
        monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--help"])
        runpy.run_path(str(SCRIPT), run_name="__main__")
    assert "hidden" in capsys.readouterr().out
