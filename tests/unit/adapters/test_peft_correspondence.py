"""The engine's expert LoRA is stock PEFT's ``target_parameters`` LoRA on a real ``Qwen3MoeExperts``.

Same base weights, same LoRA (PEFT's tensors converted by ``moetune.adapters.peft_layout``), same routing and
upstream gradient: equal outputs and equal grads of x, of the routing weights and of every lora_A / lora_B
(the engine's grads converted to PEFT's layout). Run over transformers' eager, grouped_mm and batched_mm
experts implementations, which must therefore agree with each other too.
"""

from __future__ import annotations

import pytest
import torch
from peft import get_peft_model_state_dict

from moetune.adapters import ExpertParamNames, expert_lora_from_peft_state, expert_lora_to_peft_state
from moetune.engine import DenseExperts, ExpertEngine, ExpertLoRA, lora_scaling
from moetune.layer import CpuExperts
from tests.unit.adapters.test_peft_layout import (
    ALPHA,
    PREFIX,
    E,
    H,
    Holder,
    K,
    R,
    make_experts,
    peft_model,
    randomize_lora,
)
from tests.unit.engine_cases import make_routing, rel_err, run_module

T = 13
# max |engine - PEFT| / max |PEFT| per tensor. fp32: both sides sum the same products in different orders
# (grouped vs per-expert GEMMs, (x A^T) B^T vs x (W + s B A)^T); measured fp32 <= 6e-7, fp64 <= 2e-15.
TOL = {torch.float32: 1e-5, torch.float64: 1e-12}
# grouped_mm has no fp64 CPU kernel in torch ("Expected mat_a to be Float32, BFloat16 or Float16").
CASES = [
    ("eager", torch.float32),
    ("eager", torch.float64),
    ("grouped_mm", torch.float32),
    ("batched_mm", torch.float32),
    ("batched_mm", torch.float64),
]


def run_peft(pm, x, ids, w, gy):
    """Forward + backward through the PEFT model; returns y and grads (LoRA keyed as in the saved state)."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = pm(x, ids, w)
    (y * gy).sum().backward()
    grads = {"x": x.grad, "w": w.grad}
    lora = {n.replace(".default.", "."): p.grad for n, p in pm.named_parameters() if p.requires_grad}
    return y.detach(), grads, lora


@pytest.mark.parametrize("impl,dtype", CASES)
@pytest.mark.parametrize("use_rslora", [False, True])
def test_engine_lora_equals_peft_target_parameters(impl, dtype, use_rslora):
    experts = make_experts("qwen", dtype, impl)
    names = ExpertParamNames.from_module(experts, transposed=False)
    pm = peft_model(experts, use_rslora=use_rslora)
    randomize_lora(pm)
    state = get_peft_model_state_dict(pm)
    assert all(t.dtype == dtype for t in state.values())  # PEFT keeps fp32 / fp64 adapters as the base

    scaling = lora_scaling(R, ALPHA, use_rslora)
    lora = expert_lora_from_peft_state(state, PREFIX, num_experts=E, scaling=scaling, names=names)
    base = DenseExperts(experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone())
    mod = CpuExperts(ExpertEngine(base, lora=lora))

    x, ids, w = make_routing(T, E - 1, K, H, dtype=dtype)  # distinct experts per token; expert E-1 gets none
    gy = torch.randn(T, H, dtype=dtype)
    y_peft, g_peft, lora_peft = run_peft(pm, x, ids, w, gy)
    y_eng, g_eng = run_module(mod, x, ids, w, gy)
    with pm.disable_adapter():
        assert rel_err(pm(x, ids, w), y_peft) > 1e-2  # the LoRA term is not negligible: the test can fail

    tol = TOL[dtype]
    assert y_eng.dtype == dtype
    assert rel_err(y_eng, y_peft) <= tol
    assert rel_err(g_eng["x"], g_peft["x"]) <= tol
    assert rel_err(g_eng["w"], g_peft["w"]) <= tol

    grads = {n: g_eng[f"lora_{n}"] for n in ("gate_up_A", "gate_up_B", "down_A", "down_B")}
    assert not any(g[E - 1].any() for g in grads.values())  # an expert with no tokens gets zero grads
    lora_eng = expert_lora_to_peft_state(ExpertLoRA(**grads, scaling=scaling), PREFIX, names)
    assert sorted(lora_eng) == sorted(lora_peft)
    for key, g in lora_peft.items():
        assert lora_eng[key].dtype == g.dtype, key
        assert rel_err(lora_eng[key], g) <= tol, key


def moetune_peft_model(experts: torch.nn.Module, *, dropout: float = 0.0) -> torch.nn.Module:
    """The same base weights in a ``CpuExperts``, given expert LoRA the way ``attach_lora`` gives it."""
    from peft import LoraConfig

    from moetune.adapters.apply import peft_model_with

    base = DenseExperts(experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone())
    config = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=dropout, target_modules=[])
    return peft_model_with(Holder(CpuExperts(ExpertEngine(base))), config, [], ["experts"], [])


def test_expert_layer_is_stock_param_wrapper_under_peft():
    """moetune's ``ExpertsLora`` on a ``CpuExperts`` against stock PEFT's ``ParamWrapper`` on the transformers
    module: the same state-dict keys (PEFT loads one's state into the other with nothing left over), the same
    config form, and equal outputs and grads of x, of the routing weights and of every lora_A / lora_B, named
    alike. No layout conversion on either side."""
    from peft import set_peft_model_state_dict

    experts = make_experts("qwen", torch.float32)
    pm = peft_model(experts)
    randomize_lora(pm)
    ours = moetune_peft_model(experts)
    result = set_peft_model_state_dict(ours, get_peft_model_state_dict(pm))
    assert not result.unexpected_keys and not [k for k in result.missing_keys if ".lora_" in k]
    assert sorted(get_peft_model_state_dict(ours)) == sorted(get_peft_model_state_dict(pm))
    config = ours.peft_config["default"]
    assert config.target_parameters == ["experts.gate_up_proj", "experts.down_proj"]
    assert config.target_modules is None

    x, ids, w = make_routing(T, E - 1, K, H, dtype=torch.float32)
    gy = torch.randn(T, H)
    y_peft, g_peft, lora_peft = run_peft(pm, x, ids, w, gy)
    y_ours, g_ours, lora_ours = run_peft(ours, x, ids, w, gy)
    tol = TOL[torch.float32]
    assert rel_err(y_ours, y_peft) <= tol
    assert rel_err(g_ours["x"], g_peft["x"]) <= tol and rel_err(g_ours["w"], g_peft["w"]) <= tol
    assert sorted(lora_ours) == sorted(lora_peft)
    for key, g in lora_peft.items():
        assert rel_err(lora_ours[key], g) <= tol, key
    with ours.disable_adapter():
        assert rel_err(ours(x, ids, w), y_ours) > 1e-2  # the LoRA term counts: disabling it shows


def test_backward_uses_the_lora_its_forward_ran_with():
    """A forward's backward computes with that forward's expert LoRA, whatever ran in between: here a frozen
    forward with the adapter disabled (what TRL's DPO runs for its reference logits) and a forward of another
    adapter. Gradients equal those of an uninterrupted forward + backward."""
    from peft import LoraConfig

    experts = make_experts("qwen", torch.float32)
    ours = moetune_peft_model(experts)
    ours.add_adapter("other", LoraConfig(r=2, lora_alpha=4.0, target_modules=["experts"]))
    randomize_lora(ours)
    x, ids, w = make_routing(T, E, K, H, dtype=torch.float32)
    gy = torch.randn(T, H)
    y_want, g_want, lora_want = run_peft(ours, x, ids, w, gy)
    for p in ours.parameters():
        p.grad = None

    xg = x.clone().requires_grad_(True)
    y = ours(xg, ids, w)
    with torch.no_grad(), ours.disable_adapter():
        ours(x, ids, w)
    ours.set_adapter("other")
    ours(x, ids, w).sum().backward()  # the other adapter's own forward and backward
    ours.set_adapter("default")
    (y * gy).sum().backward()
    assert torch.equal(y.detach(), y_want) and torch.equal(xg.grad, g_want["x"])
    got = {n.replace(".default.", "."): p.grad for n, p in ours.named_parameters() if ".default." in n}
    assert sorted(got) == sorted(lora_want)
    assert all(torch.equal(got[k], g) for k, g in lora_want.items())
