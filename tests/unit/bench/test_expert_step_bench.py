"""bench/expert_step.py runs end to end on a tiny stack and prints every variant (no speed is asserted)."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "expert_step.py"
TINY = "--layers 2 --experts 8 --active 4 --tokens 16 --hidden 16 --inter 8 --top-k 2 --threads 1 --reps 1"


def test_expert_step_bench_prints_every_variant(monkeypatch, capsys, one_thread) -> None:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *TINY.split(), "--device-ms", "1"])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    names = [
        r[0] for r in rows if r and r[0] in ("dense+torch", "exact", "exact+overlap", "lazy", "lazy+overlap")
    ]
    assert names == ["dense+torch", "exact", "exact+overlap", "lazy", "lazy+overlap"]
    assert (
        next(r for r in rows if r and r[0] == "dense+torch")[2] == "1.00"
    )  # the baseline of the ratio column
