"""The CPU/device schedule of ``bench/pipeline.py``: interval overlap against a brute-force count, the two-queue
runner's ordering, the virtual-clock replay against hand-computed timelines, each schedule's expected overlap
against its closed form, and the pipeline benchmark end to end on a tiny shape. Nothing here asserts a speed."""

from __future__ import annotations

import random

import pytest
import torch

from moetune.bench.pipeline import (
    SCHEDULES,
    DeviceModel,
    LayerCosts,
    PipelineShape,
    halves_bit_identical,
    run_pipeline_bench,
)
from moetune.bench.schedule import Task, overlap_s, replay, run_schedule
from moetune.errors import ConfigError


def _covered(intervals, t):
    return any(s <= t < e for s, e in intervals)


def test_overlap_matches_a_brute_force_count():
    rng = random.Random(0)
    for _ in range(50):
        a, b = ([], [])
        for out in (a, b):
            edges = sorted(rng.randrange(0, 200) for _ in range(2 * rng.randrange(1, 6)))
            out += [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i] < edges[i + 1]]
            # make each list disjoint within itself, as the queues' intervals are
            out[:] = [iv for i, iv in enumerate(out) if all(iv[0] >= p[1] for p in out[:i])]
        brute = sum(1 for t in range(200) if _covered(a, t) and _covered(b, t))  # unit steps, integer edges
        assert overlap_s(a, b) == brute


def test_run_schedule_honours_dependencies_and_order():
    log = []
    cpu = [Task(f"c{i}", (lambda i=i: log.append(f"c{i}")), deps=(f"d{i}",)) for i in range(3)]
    dev = [Task("d0", seconds=0.001)]
    dev += [Task(f"d{i}", deps=(f"c{i - 1}",), seconds=0.001) for i in range(1, 3)]
    timeline = run_schedule(cpu, dev)
    assert log == ["c0", "c1", "c2"]
    for i in range(3):
        assert timeline.cpu[f"c{i}"][0] >= timeline.device[f"d{i}"][1]  # started after what it waited for
        if i:
            assert timeline.device[f"d{i}"][0] >= timeline.cpu[f"c{i - 1}"][1]
    assert timeline.hidden_fraction == 0.0  # a strict ping-pong: nothing overlaps


def test_a_failing_cpu_task_stops_the_device_queue():
    def boom():
        raise ValueError("boom")

    cpu = [Task("c0", boom)]
    dev = [Task("d0", deps=("c0",), seconds=0.001)]
    with pytest.raises(ValueError, match="boom"):
        run_schedule(cpu, dev)  # returns (the device thread gives up) instead of hanging


def test_replay_matches_a_hand_computed_timeline():
    cpu = [Task("e0", deps=("x0",)), Task("e1", deps=("x1",))]
    dev = [
        Task("x0", seconds=1.0),
        Task("s0", seconds=3.0),
        Task("x1", seconds=1.0),
        Task("y1", deps=("e1",), seconds=2.0),
    ]
    tl = replay(cpu, dev, {"e0": 5.0, "e1": 4.0})
    assert tl.device == {"x0": (0.0, 1.0), "s0": (1.0, 4.0), "x1": (4.0, 5.0), "y1": (10.0, 12.0)}
    assert tl.cpu == {"e0": (1.0, 6.0), "e1": (6.0, 10.0)}
    assert tl.wall_s == 12.0
    assert tl.hidden_fraction == pytest.approx((3.0 + 1.0) / 7.0)  # s0 and x1 ran while e0 did


def test_replay_refuses_a_deadlock():
    cpu = [Task("c", deps=("d",))]
    dev = [Task("d", deps=("c",), seconds=1.0)]
    with pytest.raises(AssertionError, match="deadlocks"):
        replay(cpu, dev, {"c": 1.0})


COSTS = LayerCosts(pre=1.0, d2h=0.5, shared=2.0, h2d=0.25)


def _timeline(name, layers, engine_s, costs=COSTS):
    parts = {"two-halves": 2}.get(name, 1)
    cpu, dev = SCHEDULES.get(name)(layers, costs.scaled(1 / parts), lambda layer, part: lambda: None, "f")
    return replay(cpu, dev, {t.name: engine_s / parts for t in cpu})


@pytest.mark.parametrize("engine_s", [1.0, 5.0])
def test_serial_and_shared_ahead_match_their_closed_forms(engine_s):
    layers, c = 3, COSTS
    per_layer_device = c.pre + c.d2h + c.shared + c.h2d
    serial = _timeline("serial", layers, engine_s)
    assert serial.wall_s == pytest.approx(layers * (per_layer_device + engine_s))
    assert serial.hidden_fraction == 0.0
    ahead = _timeline("shared-ahead", layers, engine_s)
    hidden = min(c.shared, engine_s)  # the shared experts run beside the engine, the rest is in series
    assert ahead.wall_s == pytest.approx(layers * (per_layer_device + engine_s - hidden))
    assert ahead.hidden_fraction == pytest.approx(hidden / per_layer_device)


def test_two_halves_hides_all_but_the_pipeline_fill_when_the_cpu_dominates():
    layers, engine_s, c = 4, 20.0, COSTS
    tl = _timeline("two-halves", layers, engine_s)
    half = c.scaled(0.5)
    fill = half.pre + half.d2h  # before the CPU's first half can start
    drain = half.h2d  # after its last half
    assert tl.wall_s == pytest.approx(fill + layers * engine_s + drain)
    assert tl.cpu_busy_s == pytest.approx(layers * engine_s)  # the CPU never waits once started
    device = layers * (c.pre + c.d2h + c.shared + c.h2d)
    assert tl.device_busy_s == pytest.approx(device)
    assert tl.hidden_fraction == pytest.approx((device - fill - drain) / device)


def test_pipeline_bench_end_to_end_tiny():
    shape = PipelineShape(
        layers=2, tokens=8, hidden=32, heads=2, kv_heads=1, head_dim=16, experts=4, intermediate=16,
        shared_intermediate=32, top_k=2, rank=2,
    )  # fmt: skip
    before = torch.get_num_threads()
    try:
        records = run_pipeline_bench(shape, DeviceModel(), reps=1, threads=1)
    finally:
        torch.set_num_threads(before)
    assert [r["schedule"] for r in records] == SCHEDULES.names()
    by = {r["schedule"]: r for r in records}
    assert by["serial"]["replay_hidden_fraction"] == 0.0
    assert by["serial"]["vs_serial"] == 1.0
    # the replay gives serial and shared-ahead the same engine times: only the order differs, and it can only help
    # (equal up to rounding: each interval's length is taken from its own start and end, which differ by order)
    assert by["shared-ahead"]["replay_cpu_ms"] == pytest.approx(by["serial"]["replay_cpu_ms"], rel=1e-12)
    assert by["shared-ahead"]["replay_wall_ms"] <= by["serial"]["replay_wall_ms"]
    assert by["shared-ahead"]["replay_hidden_fraction"] > 0.0
    device = {r["device_busy_ms"] for r in records}  # the same modelled work in every schedule
    assert max(device) == pytest.approx(min(device))
    for r in records:
        assert 0.0 <= r["hidden_fraction"] <= 1.0 and 0.0 <= r["replay_hidden_fraction"] <= 1.0
        assert r["replay_wall_ms"] >= r["replay_cpu_ms"] - 1e-9


def test_halves_report_every_result():
    diffs = halves_bit_identical(
        PipelineShape(tokens=8, hidden=32, experts=4, intermediate=16, top_k=2, rank=2)
    )
    assert set(diffs) == {"y", "grad_x", "grad_w"} | {
        f"grad_{n}" for n in ("gate_up_A", "gate_up_B", "down_A", "down_B")
    }
    assert diffs["y"] < 1e-5 and diffs["grad_x"] < 1e-5  # the same math on fewer rows


def test_pipeline_shape_errors_are_listed():
    with pytest.raises(ConfigError) as e:
        PipelineShape(layers=0, tokens=7, top_k=64, experts=8).validate()
    for needle in ("layers=0", "top_k=64 > experts=8", "tokens=7"):
        assert needle in str(e.value)
