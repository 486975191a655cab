"""The scaling model of ``bench/dist.py --whole-step`` (``moetune.bench.dist_step``) against the formula worked by
hand, and the step windows' summary of a profile."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from moetune.bench.dist_step import StepCosts, StepWindows, expected_step, scaling_table

COSTS = StepCosts(s_per_token=1e-3, layers=2, hidden=10, top_k=3, value_bytes=2, allreduce_bytes=1e6)


def test_expected_step_by_hand() -> None:
    assert expected_step(COSTS, 1000, 1, 1.0) == pytest.approx(1.0)  # 1000 tokens x 1 ms, no communication
    # W = 4, 1 GB/s, latency 0: compute 250 ms; exchange 2 x 4 x 3/4 x 250 tokens x 3 x 10 x 2 bytes = 90 kB;
    # all-reduce 2 x 3/4 x 1 MB = 1.5 MB
    got = expected_step(COSTS, 1000, 4, 1.0, latency_s=0.0)
    assert got == pytest.approx(0.25 + 90e3 / 1e9 + 1.5e6 / 1e9)


def test_scaling_table_rows() -> None:
    table = scaling_table(COSTS, 1000, {"slow": 0.001, "fast": 100.0}, (2, 4))
    lines = table.splitlines()
    assert lines[0] == "| link (GB/s) | 2 ranks | 4 ranks |"
    fast = lines[3].split("|")
    assert fast[1].strip() == "fast (100)" and float(fast[3].strip().rstrip("x")) == pytest.approx(
        4.0, abs=0.01
    )
    slow = float(lines[2].split("|")[3].strip().rstrip("x"))
    assert slow < 1.0  # a 1 MB/s link makes four ranks slower than one


def test_step_windows_summary() -> None:
    windows = StepWindows(warmup=1, timed=2, profiled=1)
    for step, (t, n) in {1: (10.0, 100), 3: (14.0, 300)}.items():
        windows.marks[step] = (t, n)
    events = [
        SimpleNamespace(name="gloo:all_reduce", cpu_time_total=2000.0, input_shapes=[[10, 5]]),
        SimpleNamespace(name="gloo:all_to_all", cpu_time_total=1000.0, input_shapes=[[4]]),
        SimpleNamespace(name="aten::mm", cpu_time_total=9e9, input_shapes=[[9, 9]]),
    ]
    windows.prof = SimpleNamespace(events=lambda: events)
    got = windows.result()
    assert got["step_s"] == pytest.approx(2.0) and got["tokens"] == pytest.approx(100)
    assert got["collective_s"] == pytest.approx(3e-3) and got["collective_bytes"] == (50 + 4) * 4
    assert got["collectives"] == 2
