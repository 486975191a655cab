"""Shared experts queued ahead of the CPU engine: same numbers and graph, each token computed once."""

from __future__ import annotations

import torch
from torch import nn

import moetune
from moetune.layer import CpuExperts
from moetune.layer.overlap import SharedAhead
from moetune.testing.tiny import save_tiny_model


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.up = nn.Linear(6, 10, dtype=torch.float64)
        self.down = nn.Linear(10, 6, dtype=torch.float64)
        for p in self.parameters():
            p.data.normal_(generator=gen)
        self.rows = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows += x.reshape(-1, x.shape[-1]).shape[0]
        return self.down(torch.tanh(self.up(x)))


def test_launched_result_is_the_blocks_call_with_its_graph():
    mlp = Mlp()
    x = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    want = mlp(x)
    (want * want).sum().backward()
    want_grads = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad()

    ahead = SharedAhead(mlp)
    mlp.rows = 0
    ahead.launch(x.view(-1, 6))  # what CpuExperts sees: the block's [T, H] view of the same tensor
    got = mlp(x)  # the block's own call: served from the launch, the module runs on no tokens
    assert mlp.rows == 10 and got.shape == (2, 5, 6)
    assert torch.equal(got, want)
    (got * got).sum().backward()
    for g, w in zip([x.grad] + [p.grad for p in mlp.parameters()], want_grads):
        assert torch.equal(g, w)


def test_other_inputs_run_the_module_and_a_result_is_used_once():
    mlp = Mlp()
    ahead = SharedAhead(mlp)
    x, other = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    ahead.launch(x)
    assert torch.equal(mlp(other), Mlp()(other))  # another tensor: computed, the launch dropped
    mlp.rows = 0
    mlp(x)
    assert mlp.rows == 4  # nothing pending any more: computed as usual
    ahead.launch(x)
    x.add_(1.0)  # changed in place after the launch: the launched result is stale
    assert torch.equal(mlp(x), Mlp()(x))
    ahead.remove()
    mlp.rows = 0
    mlp(x)
    assert mlp.rows == 4


def test_deepseek_blocks_compute_each_token_of_the_shared_experts_once(tmp_path):
    path = save_tiny_model("deepseek_v3", tmp_path / "m", tokenizer=False)
    model = moetune.load_model(path, device="cpu", dtype="float32", progress=False)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, CpuExperts)}
    assert experts and all(m.shared_ahead is not None for m in experts.values())
    rows: dict[str, int] = {}

    def count(name):
        def hook(module, args):
            rows[name] = rows.get(name, 0) + args[0].reshape(-1, args[0].shape[-1]).shape[0]

        return hook

    for name in experts:
        shared = model.get_submodule(name.rpartition(".")[0]).shared_experts
        shared.gate_proj.register_forward_pre_hook(count(name))
    ids = torch.randint(3, 96, (2, 7), generator=torch.Generator().manual_seed(0))
    model(ids)
    assert rows == {name: 14 for name in experts}


def test_attaching_lora_keeps_the_overlap_and_the_layout(tmp_path):
    path = save_tiny_model("deepseek_v3", tmp_path / "m", tokenizer=False)
    model = moetune.load_model(path, device="cpu", dtype="float32", progress=False)
    before = {n: (m.shared_ahead, m.layout) for n, m in model.named_modules() if isinstance(m, CpuExperts)}
    peft_model = moetune.attach_lora(model, rank=4, alpha=8)
    after = {
        n.removeprefix("base_model.model."): m
        for n, m in peft_model.named_modules()
        if isinstance(m, CpuExperts)
    }
    assert after.keys() == before.keys()
    for name, module in after.items():
        assert module.engine.lora is not None  # a new module around a LoRA engine...
        assert (module.shared_ahead, module.layout) == before[name]  # ...that kept what the loader set
