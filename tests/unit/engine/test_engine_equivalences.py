"""Two cheap, strong equivalences, each against plain float64 torch autograd (never the engine itself):

* one expert with top-1 routing and weight 1 is a dense SwiGLU MLP ``down(silu(gate x) * up x)``;
* expert LoRA with B = 0 is the base model: output, grad_x, the routing weights' grad (and the base weights'
  in full mode) equal the loop without LoRA, dropout or not; A's grad is exactly zero.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetune.engine import ActivationPolicy, DenseExperts, EngineOptions, ExpertEngine, ExpertLoRA
from moetune.layer import CpuExperts
from moetune.testing.reference import expert_loop
from tests.unit.engine_cases import make_layer, make_routing, rel_err, run_module

POLICIES = [ActivationPolicy.RETAIN, ActivationPolicy.RECOMPUTE]
T, H, I = 13, 24, 16  # H != 2I


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_one_expert_top1_is_a_dense_swiglu_mlp(policy, dtype, tol):
    gen = torch.Generator().manual_seed(3)
    w_gate, w_up = (torch.randn(I, H, generator=gen, dtype=torch.float64) / H**0.5 for _ in range(2))
    w_down = torch.randn(H, I, generator=gen, dtype=torch.float64) / I**0.5
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    gy = torch.randn(T, H, generator=gen, dtype=torch.float64)

    # the dense MLP, as nn.Linear layers compute it, in float64 autograd
    ref = {
        n: t.clone().requires_grad_(True)
        for n, t in {"x": x, "gate": w_gate, "up": w_up, "down": w_down}.items()
    }
    y_ref = F.linear(F.silu(F.linear(ref["x"], ref["gate"])) * F.linear(ref["x"], ref["up"]), ref["down"])
    (y_ref * gy).sum().backward()

    # the same weights as one routed expert: gate_up [1, 2I, H] (gate rows first), down [1, H, I]
    gate_up = torch.cat([w_gate, w_up]).unsqueeze(0).to(dtype).clone()
    down = w_down.unsqueeze(0).to(dtype).clone()
    engine = ExpertEngine(DenseExperts(gate_up, down), train_base=True, options=EngineOptions(policy=policy))
    ids = torch.zeros(T, 1, dtype=torch.long)
    w = torch.ones(T, 1, dtype=dtype)
    y, grads = run_module(CpuExperts(engine), x.to(dtype), ids, w, gy)

    assert rel_err(y, y_ref) < tol
    assert rel_err(grads["x"], ref["x"].grad) < tol
    # d y / d w[t] = <grad_y[t], MLP(x[t])> for a weight that scales the whole output
    assert rel_err(grads["w"][:, 0], (gy * y_ref.detach()).sum(1)) < tol
    grad_gate_up = torch.cat([ref["gate"].grad, ref["up"].grad])
    assert rel_err(grads["gate_up_proj"][0], grad_gate_up) < tol
    assert rel_err(grads["down_proj"][0], ref["down"].grad) < tol


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("full", [False, True], ids=["lora", "full+lora"])
@pytest.mark.parametrize("dropout", [0.0, 0.3])
def test_lora_with_zero_b_is_the_base_model(policy, full, dropout):
    layer = make_layer(lora=False)
    e, r = layer.gate_up.shape[0], 4
    x, ids, w = make_routing(T=T, E=e, k=2, H=H)
    gy = torch.randn(T, H, dtype=torch.float64)

    # A drawn as PEFT draws it, B = 0 (PEFT's init): the LoRA path is live but adds nothing
    lora = ExpertLoRA.init(e, H, I, r, alpha=8.0, dropout=dropout, dtype=torch.float64)
    assert float(lora.gate_up_A.abs().min()) > 0 and not lora.gate_up_B.any() and not lora.down_B.any()
    engine = ExpertEngine(
        DenseExperts(layer.gate_up.clone(), layer.down.clone()),
        lora=lora,
        train_base=full,
        options=EngineOptions(policy=policy),
    )
    mod = CpuExperts(engine).train()  # dropout on: masks must not leak into the base output either
    y, grads = run_module(mod, x, ids, w, gy)

    # the base model: the plain loop without LoRA, in float64 autograd
    leaves = {
        n: t.clone().requires_grad_(True)
        for n, t in {"x": x, "w": w, "gu": layer.gate_up, "dn": layer.down}.items()
    }
    y_ref = expert_loop(leaves["x"], ids, leaves["w"], leaves["gu"], leaves["dn"])
    (y_ref * gy).sum().backward()

    assert rel_err(y, y_ref) < 1e-12
    assert rel_err(grads["x"], leaves["x"].grad) < 1e-12
    assert rel_err(grads["w"], leaves["w"].grad) < 1e-12
    if full:
        assert rel_err(grads["gate_up_proj"], leaves["gu"].grad) < 1e-12
        assert rel_err(grads["down_proj"], leaves["dn"].grad) < 1e-12
    # B = 0 passes no gradient to A; B's own gradient is what makes training move away from the init
    assert not grads["lora_gate_up_A"].any() and not grads["lora_down_A"].any()
    assert grads["lora_gate_up_B"].abs().max() > 0 and grads["lora_down_B"].abs().max() > 0
