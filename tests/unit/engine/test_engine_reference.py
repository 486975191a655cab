"""The engine against the float64 per-expert autograd loop: output and every gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetune.engine import ActivationPolicy
from moetune.engine.lora import dropout_mask
from moetune.layer import routed_experts
from tests.unit.engine_cases import build_module, make_layer, make_routing, rel_err, run_module, run_reference

POLICIES = [ActivationPolicy.RETAIN, ActivationPolicy.RECOMPUTE]
MODES = ["frozen", "lora", "full", "full+lora"]


def _case(mode: str, bias: bool = False):
    layer = make_layer(lora="lora" in mode, bias=bias)
    return layer, mode.startswith("full")


# 1: one expert at a time (the sequential path); 4: four experts at once on the expert pool
@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_matches_float64_loop(policy, mode, dtype, tol, workers, four_threads):
    layer, full = _case(mode)
    x, ids, w = make_routing(T=29, E=8, k=3, H=24)
    gy = torch.randn(29, 24, dtype=torch.float64)
    mod = build_module(layer, dtype=dtype, full=full, policy=policy, expert_workers=workers)
    y, grads = run_module(mod, x.to(dtype), ids, w.to(dtype), gy)
    y_ref, ref = run_reference(layer, x, ids, w, gy, full=full)
    assert rel_err(y, y_ref) < tol
    expected = {"x", "w"} | ({f"lora_{n}" for n in layer.lora} if layer.lora else set())
    expected |= {"gate_up_proj", "down_proj"} if full else set()
    assert set(grads) == expected
    for name in expected:
        assert grads[name] is not None, name
        assert rel_err(grads[name], ref[name]) < tol, (name, rel_err(grads[name], ref[name]))
    for name, g in grads.items():
        if name.startswith("lora_"):
            assert g.dtype == torch.promote_types(dtype, torch.float32)  # fp32 accumulation at least


def _gpt_oss_ref(gate, up, alpha=1.702, limit=7.0):
    # written from gpt-oss's definition, independently of moetune.engine.activations
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


@pytest.mark.parametrize(
    "activation,ref_act",
    [
        ("gpt_oss", _gpt_oss_ref),
        ("gelu", lambda g, u: F.gelu(g) * u),
        ("gelu_pytorch_tanh", lambda g, u: F.gelu(g, approximate="tanh") * u),
    ],
)
@pytest.mark.parametrize("policy", POLICIES)
def test_activations_and_biases(activation, ref_act, policy):
    layer = make_layer(bias=True)
    layer.gate_up.mul_(8.0)  # push pre-activations past the gpt-oss clamp limit so the clamp is exercised
    x, ids, w = make_routing(T=17, E=8, k=2, H=24)
    gy = torch.randn(17, 24, dtype=torch.float64)
    mod = build_module(layer, full=True, activation=activation, policy=policy)
    y, grads = run_module(mod, x, ids, w, gy)
    y_ref, ref = run_reference(layer, x, ids, w, gy, act=ref_act, full=True)
    assert rel_err(y, y_ref) < 1e-12
    for name in ref:
        assert rel_err(grads[name], ref[name]) < 1e-12, name


@pytest.mark.parametrize("policy", POLICIES)
def test_lora_dropout_matches_reference_with_the_same_masks(policy):
    layer = make_layer()
    x, ids, w = make_routing(T=21, E=8, k=2, H=24)
    gy = torch.randn(21, 24, dtype=torch.float64)
    mod = build_module(layer, dropout=0.3, policy=policy)
    mod.train()
    torch.manual_seed(5)
    y, grads = run_module(mod, x, ids, w, gy)
    torch.manual_seed(5)  # the engine draws its mask seed from the global RNG: draw the same one
    seed = int(torch.randint(0, 2**62, (1,)).item())
    y_ref, ref = run_reference(
        layer,
        x,
        ids,
        w,
        gy,
        masks=lambda e, proj, shape: dropout_mask(seed, e, proj, shape, 0.3, torch.float64),
    )
    assert rel_err(y, y_ref) < 1e-12
    for name in ref:
        assert rel_err(grads[name], ref[name]) < 1e-12, name
    # and dropout really changed the result versus no dropout
    y_plain, _ = run_reference(layer, x, ids, w, gy)
    assert rel_err(y, y_plain) > 1e-4


def test_dropout_off_in_eval_mode():
    layer = make_layer()
    x, ids, w = make_routing(T=9, E=8, k=2, H=24)
    mod = build_module(layer, dropout=0.5).eval()
    y_ref, _ = run_reference(layer, x, ids, w, torch.zeros(9, 24, dtype=torch.float64))
    with torch.no_grad():
        assert rel_err(mod(x, ids, w), y_ref) < 1e-12


def test_dropout_mask_statistics():
    mask = dropout_mask(3, 1, 0, (400, 500), 0.25, torch.float64)
    kept = (mask > 0).double().mean().item()
    assert abs(kept - 0.75) < 0.01
    assert torch.allclose(mask[mask > 0], torch.full_like(mask[mask > 0], 1 / 0.75))
    assert torch.equal(mask, dropout_mask(3, 1, 0, (400, 500), 0.25, torch.float64))  # reproducible
    assert not torch.equal(mask, dropout_mask(3, 2, 0, (400, 500), 0.25, torch.float64))  # per expert


@pytest.mark.parametrize("policy", POLICIES)
def test_gradcheck(policy):
    layer = make_layer(E=5, H=6, I=4, r=2, bias=True)
    mod = build_module(layer, full=True, policy=policy)
    x, ids, w = make_routing(T=5, E=5, k=2, H=6)
    x.requires_grad_(True)
    w.requires_grad_(True)
    engine = mod.engine

    def fn(x, w, *trained):
        return routed_experts(engine, x, ids, w)

    assert torch.autograd.gradcheck(fn, (x, w, *engine.trained_tensors()), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mode", ["frozen", "lora"])
def test_bf16_engine_within_bound(compute, mode):
    """bf16 weights and activations: the reference runs in float64 on the same bf16-rounded weights.

    Bound: relative error (max-abs normalised) <= 3e-2 for bf16 compute: bf16 keeps 8 significant bits
    (unit roundoff 2^-8 = 3.9e-3) and each output passes through ~4 rounded GEMM/activation stages; fp32
    compute on bf16 inputs keeps only the input rounding of x (<= 1e-2 after propagation).
    """
    layer = make_layer(E=8, H=64, I=32, lora=mode == "lora")
    layer.gate_up, layer.down = layer.gate_up.bfloat16().double(), layer.down.bfloat16().double()
    x, ids, w = make_routing(T=33, E=8, k=4, H=64)
    x = x.bfloat16()
    gy = torch.randn(33, 64, dtype=torch.float64)
    mod = build_module(layer, dtype=torch.bfloat16, compute_dtype=compute)
    y, grads = run_module(mod, x, ids, w.bfloat16(), gy)
    y_ref, ref = run_reference(layer, x.double(), ids, w.bfloat16().double(), gy)
    bound = 3e-2 if compute == torch.bfloat16 else 1e-2
    assert y.dtype == torch.bfloat16 and grads["x"].dtype == torch.bfloat16
    assert rel_err(y, y_ref) < bound
    for name in ref:
        assert rel_err(grads[name], ref[name]) < bound, (name, rel_err(grads[name], ref[name]))
        if name.startswith("lora_"):
            assert grads[name].dtype == torch.float32
