"""Shared experts queued ahead of the CPU engine: same numbers and graph, each token computed once."""

from __future__ import annotations

import pytest
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


class Block(nn.Module):
    """DeepSeek-V3's MoE block order: the experts on ``x.view(-1, H)`` (here a stand-in that launches the
    shared experts as ``CpuExperts`` does), then ``shared_experts(x)`` on the block's own input."""

    def __init__(self) -> None:
        super().__init__()
        self.shared_experts = Mlp()
        self.ahead = SharedAhead(self.shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1, x.shape[-1])
        self.ahead.launch(flat)
        routed = torch.sin(flat).view(*x.shape)
        return routed + self.shared_experts(x)


def test_a_call_that_never_finished_cannot_hand_its_result_to_a_later_call():
    mlp = Mlp()
    ahead = SharedAhead(mlp)
    x = torch.randn(3, 6, dtype=torch.float64)
    ahead.launch(x)

    def stop(module, args):
        raise RuntimeError("stopped")  # as activation checkpointing stops a recompute between the hooks

    handle = mlp.register_forward_pre_hook(stop)
    with pytest.raises(RuntimeError, match="stopped"):
        mlp(x)
    handle.remove()
    y = torch.randn(5, 6, dtype=torch.float64)
    ahead.launch(y)  # the launch's own run must compute y, not return what was prepared for x
    assert torch.equal(mlp(y), Mlp()(y))


def test_same_address_is_not_the_same_tensor():
    mlp = Mlp()
    ahead = SharedAhead(mlp)
    x = torch.randn(4, 6, dtype=torch.float64)
    ahead.launch(x)
    alias = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage(), 0, x.shape, x.stride())  # no view of x
    assert alias.data_ptr() == x.data_ptr() and alias._base is None
    mlp.rows = 0
    mlp(alias)
    assert mlp.rows == 4  # computed, not served from the launch


@pytest.mark.parametrize("checkpointed", [False, True])
def test_blocks_of_changing_shapes_match_the_plain_module(checkpointed):
    """Several steps of different lengths, optionally under non-reentrant activation checkpointing (whose
    recompute may stop early between the hooks): outputs and every gradient equal the un-hooked block."""
    block, plain = Block(), Mlp()
    for shape in [(4, 7, 6), (4, 3, 6), (2, 9, 6), (4, 7, 6)]:
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        got = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        (got * got).sum().backward()
        got_grads = [x.grad.clone()] + [p.grad.clone() for p in block.shared_experts.parameters()]
        x.grad = None
        block.zero_grad()
        want = torch.sin(x) + plain(x)
        (want * want).sum().backward()
        want_grads = [x.grad.clone()] + [p.grad.clone() for p in plain.parameters()]
        x.grad = None
        plain.zero_grad()
        assert torch.equal(got, want)
        for g, w in zip(got_grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


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
    from moetune.adapters.apply import expert_modules

    before = {n: (m, m.shared_ahead, m.layout) for n, m in model.named_modules() if isinstance(m, CpuExperts)}
    peft_model = moetune.attach_lora(model, rank=4, alpha=8)
    lora = expert_modules(peft_model)
    assert lora.keys() == before.keys()
    for name, layer in lora.items():
        # the very module the loader made, wrapped in place by the LoRA layers, with what the loader set
        assert (layer.experts, layer.experts.shared_ahead, layer.experts.layout) == before[name]
