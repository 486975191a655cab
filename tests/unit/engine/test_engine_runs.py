"""Runs of experts (``Dispatch.runs``): the engine's elementwise work once per run of consecutive experts instead of
once per expert. The runs cover every active expert once, and grouping changes no bit of any result."""

from __future__ import annotations

import pytest
import torch

import moetune.engine.schedule as schedule_module
from moetune.engine import ActivationPolicy
from moetune.engine.routing import dispatch
from tests.unit.engine_cases import build_module, make_layer, make_routing, rel_err, run_module, run_reference


def _ids(counts: list[int]) -> torch.Tensor:
    """top-1 routing ``[T, 1]`` giving expert e counts[e] rows, shuffled."""
    flat = torch.cat([torch.full((c,), e, dtype=torch.int64) for e, c in enumerate(counts)])
    return flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(1))].view(-1, 1)


def test_runs_cover_the_active_experts_in_order_within_the_row_cap():
    disp = dispatch(_ids([3, 0, 9, 1, 5, 0, 30, 4, 2]), 9)
    runs = disp.runs(10)
    assert [[e for e, _, _ in r.segments] for r in runs] == [[0], [2, 3], [4], [6], [7, 8]]
    assert [s for r in runs for s in r.segments] == disp.segments()
    for r in runs:
        assert (r.start, r.end) == (r.segments[0][1], r.segments[-1][2])  # one contiguous range of rows
        assert r.end - r.start <= 10 or len(r.segments) == 1  # the 30-row expert alone
    assert [len(r.segments) for r in disp.runs(1)] == [1] * 7  # one expert per run
    assert len(disp.runs(10**6)) == 1
    assert dispatch(torch.empty(0, 1, dtype=torch.int64), 4).runs(8) == []


def _run(monkeypatch, run_rows: int, mode: str, policy, workers: int, dtype: torch.dtype):
    monkeypatch.setattr(schedule_module, "RUN_ROWS", run_rows)
    layer = make_layer(E=16, lora="lora" in mode, bias=True)
    x, ids, w = make_routing(T=40, E=16, k=3, H=24)
    gy = torch.randn(40, 24, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    full = mode.startswith("full")
    mod = build_module(layer, dtype=dtype, full=full, policy=policy, expert_workers=workers)
    return (layer, x, ids, w, gy, full), run_module(mod, x.to(dtype), ids, w.to(dtype), gy)


# 4 workers: the run cap drops to N / 16 = 7 rows, so runs of one or two experts go to the pool
@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("policy", [ActivationPolicy.RETAIN, ActivationPolicy.RECOMPUTE])
@pytest.mark.parametrize("mode", ["frozen", "lora", "full+lora"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouping_experts_into_runs_changes_no_bit(monkeypatch, mode, policy, workers, dtype, four_threads):
    (layer, x, ids, w, gy, full), (y_one, g_one) = _run(monkeypatch, 1, mode, policy, workers, dtype)
    _, (y_runs, g_runs) = _run(monkeypatch, 256, mode, policy, workers, dtype)
    assert torch.equal(y_one, y_runs)
    assert g_one.keys() == g_runs.keys()
    for name in g_one:
        assert torch.equal(g_one[name], g_runs[name]), name
    # and both right: against the float64 loop (bf16 as test_engine_reference's bound)
    y_ref, ref = run_reference(layer, x, ids, w, gy, full=full)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert rel_err(y_runs, y_ref) < tol
    for name in g_runs:
        assert rel_err(g_runs[name], ref[name]) < tol, name
