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
from tests.unit.engine_cases import make_routing, rel_err, run_module
from tests.unit.test_peft_layout import ALPHA, PREFIX, E, H, K, R, make_experts, peft_model, randomize_lora

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
    names = ExpertParamNames.from_module(experts)
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
