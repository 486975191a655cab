"""Host <-> device transfers of the engine bridge: no copies on the CPU, pinned + non-blocking on CUDA."""

from __future__ import annotations

import pytest
import torch

from moetune.layer.transfer import to_device, to_host
from tests.unit.engine_cases import build_module, make_layer, make_routing, rel_err, run_module


def test_cpu_tensors_pass_through_uncopied():
    x, ids, w = make_routing(5, 8, 2, 24)
    out = to_host(x, ids, w)
    assert all(a is b for a, b in zip(out, (x, ids, w)))
    assert to_device(x, torch.device("cpu")) is x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_is_pinned_and_never_synchronizes_the_device(monkeypatch):
    layer = make_layer(dtype=torch.float32)
    x, ids, w = make_routing(33, 8, 2, 24, dtype=torch.float32)
    gy = torch.randn(33, 24, generator=torch.Generator().manual_seed(3))
    y_cpu, g_cpu = run_module(build_module(layer), x, ids, w, gy)

    def forbidden(*args, **kwargs):
        raise AssertionError("torch.cuda.synchronize() on the engine's hot path")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    host = to_host(x.cuda(), ids.cuda())
    assert all(t.is_pinned() and t.device.type == "cpu" for t in host)
    assert torch.equal(host[0], x) and torch.equal(host[1], ids)
    y_gpu, g_gpu = run_module(build_module(layer), x.cuda(), ids.cuda(), w.cuda(), gy.cuda())
    assert y_gpu.device.type == "cuda" and g_gpu["x"].device.type == "cuda"
    assert rel_err(y_gpu.cpu(), y_cpu) == 0.0
    for name, g in g_cpu.items():
        assert rel_err(g_gpu[name].cpu(), g) == 0.0, name
