"""Edge cases, bad input, saved-forward bookkeeping and policies' memory (threads: test_threads.py)."""

from __future__ import annotations

import pytest
import torch

from moetune.engine import ActivationPolicy, DenseExperts, ExpertEngine, ExpertLoRA, TrainMode
from moetune.errors import EngineError, EngineStateError, NonFiniteError
from tests.unit.engine_cases import build_module, make_layer, make_routing, rel_err, run_module, run_reference


def _check_against_reference(layer, x, ids, w, **opts):
    gy = torch.randn(x.shape[0], x.shape[1], dtype=torch.float64)
    y, grads = run_module(build_module(layer, **opts), x, ids, w, gy)
    y_ref, ref = run_reference(layer, x, ids, w, gy)
    assert rel_err(y, y_ref) < 1e-12
    for name in ref:
        assert rel_err(grads[name], ref[name]) < 1e-12, name


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_top_k_from_1_to_8(k):
    layer = make_layer(E=8 if k < 8 else 12)
    _check_against_reference(layer, *make_routing(T=11, E=layer.gate_up.shape[0], k=k, H=24))


def test_single_token():
    layer = make_layer()
    _check_against_reference(layer, *make_routing(T=1, E=8, k=2, H=24))


def test_all_tokens_on_one_expert_and_idle_experts():
    layer = make_layer(E=16)
    x, _, w = make_routing(T=10, E=16, k=1, H=24)
    ids = torch.full((10, 1), 5, dtype=torch.long)
    _check_against_reference(layer, x, ids, w)
    mod = build_module(layer)
    x2 = x.clone().requires_grad_(True)
    mod(x2, ids, w).sum().backward()
    grad_a = mod.lora_gate_up_A.grad
    idle = [e for e in range(16) if e != 5]
    assert grad_a[idle].abs().max() == 0 and grad_a[5].abs().max() > 0


def test_256_experts():
    layer = make_layer(E=256, H=16, I=8, r=2)
    _check_against_reference(layer, *make_routing(T=40, E=256, k=8, H=16))


def test_no_tokens():
    mod = build_module(make_layer())
    y = mod(
        torch.zeros(0, 24, dtype=torch.float64, requires_grad=True),
        torch.zeros(0, 2, dtype=torch.long),
        torch.zeros(0, 2, dtype=torch.float64),
    )
    assert y.shape == (0, 24)


def test_duplicate_expert_in_a_token_is_an_error():
    mod = build_module(make_layer())
    x, ids, w = make_routing(T=4, E=8, k=2, H=24)
    ids[2] = torch.tensor([3, 3])
    with pytest.raises(EngineError, match=r"token 2 lists an expert twice.*\[3, 3\]"):
        mod(x, ids, w)


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda x, ids, w: (x, ids.clone().fill_(8), w), r"expert id 8 out of range.*\[0, 7\]"),
        (lambda x, ids, w: (x, ids.int(), w), "topk_ids must be int64"),
        (lambda x, ids, w: (x[:, :5], ids, w), r"x must be \[T, H\] with H = 24"),
        (lambda x, ids, w: (x, ids, w[:, :1]), "topk_weights must have the shape"),
        (lambda x, ids, w: (x, ids[:3], w[:3]), r"topk_ids must be \[T, k\] with T = 4"),
    ],
)
def test_bad_inputs_name_the_problem(mutate, match):
    engine = build_module(make_layer()).engine
    x, ids, w = make_routing(T=4, E=8, k=2, H=24)
    with pytest.raises(EngineError, match=match):
        engine.forward(*mutate(x, ids, w))


def test_weight_shape_errors():
    with pytest.raises(EngineError, match="down must be"):
        DenseExperts(torch.zeros(4, 10, 6), torch.zeros(4, 6, 4))
    with pytest.raises(EngineError, match="expert LoRA is for"):
        ExpertEngine(
            DenseExperts(torch.zeros(4, 10, 6), torch.zeros(4, 6, 5)), lora=ExpertLoRA.init(4, 6, 6, 2, 4)
        )


def test_non_finite_detected_when_checking():
    layer = make_layer()
    layer.gate_up[3, 0, 0] = float("inf")
    x, ids, w = make_routing(T=12, E=8, k=2, H=24)
    ids[:, 0] = 3  # every token visits expert 3
    ids[:, 1] = torch.where(ids[:, 1] == 3, 4, ids[:, 1])
    with pytest.raises(NonFiniteError, match="expert 3"):
        build_module(layer, check_finite=True)(x, ids, w)
    y = build_module(layer)(x, ids, w)  # off by default: no check, no cost
    assert not torch.isfinite(y).all()
    x[1, 1] = float("nan")
    with pytest.raises(NonFiniteError, match="in x"):
        build_module(make_layer(), check_finite=True)(x, ids, w)


def test_saved_forward_used_twice_or_elsewhere_is_an_error():
    layer = make_layer()
    eng_a, eng_b = build_module(layer).engine, build_module(layer).engine
    x, ids, w = make_routing(T=6, E=8, k=2, H=24)
    y, saved = eng_a.forward(x, ids, w)
    with pytest.raises(EngineStateError, match="another engine"):
        eng_b.backward(saved, torch.ones_like(y))
    eng_a.backward(saved, torch.ones_like(y))
    with pytest.raises(EngineStateError, match="already ran for forward #1"):
        eng_a.backward(saved, torch.ones_like(y))


def test_weights_changed_between_forward_and_backward_is_an_error():
    mod = build_module(make_layer())
    x, ids, w = make_routing(T=6, E=8, k=2, H=24)
    y = mod(x.requires_grad_(True), ids, w)
    with torch.no_grad():
        mod.lora_down_A.add_(1.0)  # an optimizer step before this forward's backward
    with pytest.raises(EngineStateError, match="modified in place after forward"):
        y.sum().backward()


def test_autograd_reuse_needs_retain_graph():
    mod = build_module(make_layer())
    x, ids, w = make_routing(T=6, E=8, k=2, H=24)
    y = mod(x.requires_grad_(True), ids, w)
    y.sum().backward(retain_graph=True)
    first = x.grad.clone()
    y.sum().backward()  # retained: same saved activations, same gradient again
    assert torch.allclose(x.grad, 2 * first)
    y2 = mod(x, ids, w)
    y2.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        y2.sum().backward()


@pytest.mark.parametrize("policy", [ActivationPolicy.RETAIN, ActivationPolicy.RECOMPUTE])
def test_many_forwards_then_backwards_in_any_order(policy):
    """Micro-batches / checkpointing: forwards 1..3 then backwards 2, 3, 1 — each matches its own reference."""
    layer = make_layer()
    engine = build_module(layer, policy=policy).engine
    batches = [make_routing(T=5 + i, E=8, k=2, H=24, seed=i) for i in range(3)]
    outs = [engine.forward(*b) for b in batches]
    for i in (1, 2, 0):
        x, ids, w = batches[i]
        gy = torch.randn(x.shape, dtype=torch.float64)
        grads = engine.backward(outs[i][1], gy)
        _, ref = run_reference(layer, x, ids, w, gy)
        assert rel_err(grads.x, ref["x"]) < 1e-12
        assert rel_err(grads.lora["down_B"], ref["lora_down_B"]) < 1e-12


def test_policies_memory_and_modes():
    layer = make_layer(E=8, H=24, I=16, r=4)
    x, ids, w = make_routing(T=32, E=8, k=2, H=24)
    inputs = x.nbytes + ids.nbytes + w.nbytes
    retain = build_module(layer, policy=ActivationPolicy.RETAIN).engine
    recompute = build_module(layer, policy=ActivationPolicy.RECOMPUTE).engine
    _, s_ret = retain.forward(x, ids, w)
    _, s_rec = recompute.forward(x, ids, w)
    assert s_rec.nbytes == inputs  # recompute keeps only the inputs
    n = 32 * 2
    assert (
        s_ret.nbytes >= inputs + n * 2 * 16 * 8 + 2 * n * 4 * 8
    )  # + gate_up [N, 2I] + LoRA projections [N, r]
    frozen = build_module(make_layer(lora=False)).engine
    assert frozen.mode is TrainMode.FROZEN and retain.mode is TrainMode.LORA
    y, saved = frozen.forward(x, ids, w)
    grads = frozen.backward(saved, torch.ones_like(y))
    assert grads.lora is None and grads.base is None


def test_module_stays_on_host_and_optimizer_steps():
    mod = build_module(make_layer(), dtype=torch.float32)
    model = torch.nn.ModuleDict({"attn": torch.nn.Linear(24, 24), "experts": mod})
    model.to(torch.bfloat16)
    assert model["attn"].weight.dtype == torch.bfloat16
    assert mod.lora_gate_up_A.dtype == torch.float32 and mod.lora_gate_up_A.device.type == "cpu"
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-2)
    x, ids, w = make_routing(T=8, E=8, k=2, H=24, dtype=torch.float32)
    for _ in range(2):
        loss = mod(x, ids, w).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert all(p.grad is not None for p in mod.parameters())


def test_a_forward_under_inference_mode_leaves_the_engine_usable_outside_it():
    # scratch buffers first made under torch.inference_mode were inference tensors: the next call outside it
    # (generate after an inference-mode evaluation, then training) failed writing into them
    layer = make_layer()
    x, ids, w = make_routing(T=9, E=8, k=2, H=24)
    mod = build_module(layer)
    with torch.inference_mode():
        y_inference = mod(x, ids, w)
    with torch.no_grad():
        torch.testing.assert_close(mod(x, ids, w), y_inference, rtol=0, atol=0)
    x2 = x.clone().requires_grad_(True)
    y = mod(x2, ids, w)  # and with autograd, on the same module
    y.sum().backward()
    torch.testing.assert_close(y.detach(), y_inference, rtol=0, atol=0)
    assert x2.grad is not None and torch.isfinite(x2.grad).all()
