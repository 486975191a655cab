"""The compiled kernels' entry points seen by ``torch.profiler`` (``kernels/entry.h``'s ``MOETUNE_ENTRY``): an engine
step on each format with a fused kernel here records ``moetune::<kernel>`` events holding the kernels' own time, and
``bench/profile_engine.py`` books them as fused kernels, not as "gap" (time no torch op accounts for, where a
kernel's time went before). Without a kernel variant here these skip."""

from __future__ import annotations

import runpy

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from moetune.bench.weight_formats import FORMAT_BUILDS
from moetune.engine import ExpertEngine
from moetune.engine.kernels import load_fused
from tests.unit.bench.scripts import ROOT
from tests.unit.engine.test_formats import gaussian

pytestmark = pytest.mark.usefixtures("one_thread")

E, H, I, K, T = 4, 128, 64, 2, 12  # every expert gets rows (T k / E = 6 on average): the fused path's sizes

KERNELS = {  # bench/formats.py's label -> the kernel entry point its engine calls
    "bf16": "bf16_gemm",
    "int8": "int8_gemm",
    "int4-g64": "int4_gemm",
    "fp8_block": "fp8_block_gemm",
    "mxfp4": "mxfp4_gemm",
}


@pytest.mark.parametrize("label", list(KERNELS))
def test_a_step_records_its_kernel_calls(label):
    if load_fused() is None:
        pytest.skip("no kernel variant builds or runs here")
    build, dtype = FORMAT_BUILDS[label]
    gate_up, down = gaussian(E, H, I)
    engine = ExpertEngine(build(gate_up.to(dtype), down.to(dtype)))
    if not engine.gemm.path.fused_rows:
        pytest.skip(f"{label}: no fused kernel on this CPU ({engine.gemm.path.describe()})")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen).to(engine.compute_dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    w = torch.softmax(torch.randn(T, K, generator=gen), dim=1).to(engine.compute_dtype)
    gy = torch.randn(T, H, generator=gen).to(engine.compute_dtype)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, saved = engine.forward(x, ids, w)
        engine.backward(saved, gy)
    events = {ev.key: ev for ev in prof.key_averages()}
    name = f"moetune::{KERNELS[label]}"
    assert name in events, sorted(events)
    # forward and backward of both projections, once per expert with rows (gate_up's forward may be one call or two)
    assert events[name].count >= 4 * E, events[name].count
    assert events[name].self_cpu_time_total > 0
    category = runpy.run_path(str(ROOT / "bench/profile_engine.py"))["category"]
    assert {category(key, "", 8) for key in events if key.startswith("moetune::")} == {"fused kernels"}
    assert category("aten::mm", "[[12, 8], [8, 64]]", 8) == "lora gemm"  # the other categories as before
