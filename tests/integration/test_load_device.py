"""``device="cuda"``: everything but the routed experts on the GPU, experts in the CPU engine, same numbers."""

from __future__ import annotations

import pytest
import torch

import moetune
from moetune.layer import CpuExperts
from moetune.testing.tiny import save_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_vl_moe"])
def test_cuda_matches_cpu(family, tmp_path):
    path = save_tiny_model(family, tmp_path / family, tokenizer=False)
    cpu = moetune.load_model(path, device="cpu", dtype="float32", progress=False)
    gpu = moetune.load_model(path, device="cuda:0", dtype="float32", progress=False)
    for name, t in [*gpu.named_parameters(), *gpu.named_buffers()]:
        assert t.device.type == "cuda", name
    experts = [m for m in gpu.modules() if isinstance(m, CpuExperts)]
    assert experts and all(m.engine.weights.gate_up.device.type == "cpu" for m in experts)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = cpu(ids, labels=ids)
    out = gpu(ids.cuda(), labels=ids.cuda())
    assert (out.logits.cpu() - ref.logits).abs().max().item() <= 1e-4
    ref.loss.backward()
    out.loss.backward()
    router = next(n for n, _ in gpu.named_parameters() if n.endswith(("gate.weight", "router.weight")))
    got, want = gpu.get_parameter(router).grad.cpu(), cpu.get_parameter(router).grad
    assert (got - want).abs().max().item() <= 1e-4
    kwargs = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(gpu.generate(ids[:1].cuda(), **kwargs).cpu(), cpu.generate(ids[:1], **kwargs))
