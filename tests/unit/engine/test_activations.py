"""The engine's gated activations against float64 autograd of their definitions, alone and inside the engine.

Each reference below is written from the model's own definition (the family's ``_apply_gate`` in transformers
5.24), independently of ``moetune.engine.activations``. The closed-form ``vjp``s must equal autograd of the
reference, including at the clamp boundaries themselves (``torch.clamp`` passes the gradient there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moetune.engine import get_activation
from tests.unit.engine_cases import build_module, make_layer, make_routing, rel_err, run_module, run_reference

LIMIT = 0.5


def _clamped_silu(g, u, limit=LIMIT):  # DeepSeek-V4, GLM-5-Next, HY-V4
    return F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)


def _gpt_oss_style(g, u, alpha=1.702, limit=LIMIT):  # gpt-oss, MiniMax-M3-VL
    g = g.clamp(max=limit)
    return (u.clamp(min=-limit, max=limit) + 1) * g * torch.sigmoid(g * alpha)


def _silu_clamped_after(g, u, limit=LIMIT):  # Step-3.7
    return F.silu(g).clamp(max=limit) * u.clamp(min=-limit, max=limit)


def _softcapped(g, u, cg=0.7, cu=0.9):  # Inkling2
    return cg * torch.tanh(g / cg) * torch.sigmoid(g) * cu * torch.tanh(u / cu)


CASES = {
    "clamped_swiglu": (dict(limit=LIMIT), _clamped_silu),
    "gpt_oss": (dict(alpha=1.702, limit=LIMIT), _gpt_oss_style),
    "clamped_swiglu_alpha": (dict(alpha=1.702, limit=LIMIT, up_offset=1.0), _gpt_oss_style),
    "swiglu_clamped_output": (dict(limit=LIMIT), _silu_clamped_after),
    "softcapped_swiglu": (dict(gate_softcap=0.7, up_softcap=0.9), _softcapped),
    "silu": ({}, lambda g, u: F.silu(g) * u),
}


def _activation(case: str):
    kwargs, ref = CASES[case]
    return get_activation(case.removesuffix("_alpha"), **kwargs), ref


def _gate_up(n=40, i=6, dtype=torch.float64):
    """Random pre-activations ``[n, 2I]`` with some entries exactly at the clamps (+-LIMIT)."""
    t = torch.randn(n, 2 * i, generator=torch.Generator().manual_seed(3), dtype=dtype) * 2
    t[0, :i], t[1, i:], t[2, i:] = LIMIT, LIMIT, -LIMIT
    return t


@pytest.mark.parametrize("case", list(CASES))
def test_forward_and_vjp_match_float64_autograd(case):
    act, ref = _activation(case)
    gate_up = _gate_up().requires_grad_(True)
    i = gate_up.shape[1] // 2
    want = ref(gate_up[:, :i], gate_up[:, i:])
    grad_h = torch.randn(want.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    (want_grad,) = torch.autograd.grad(want, gate_up, grad_h)
    got = act(gate_up.detach())
    assert rel_err(got, want) < 1e-14
    assert rel_err(act.vjp(gate_up.detach(), grad_h), want_grad) < 1e-14
    out = torch.empty_like(got)
    act(gate_up.detach(), out=out)
    assert torch.equal(out, got)
    # the engine's backward pair: h into out (memo holds what the vjp reuses, stale garbage before), then the
    # vjp into a buffer; the same numbers as the two calls above
    memo, h = torch.full_like(got, float("nan")), torch.full_like(got, float("nan"))
    assert act.forward_saving(gate_up.detach(), h, memo) is h and torch.equal(h, got)
    grad_buf = torch.full_like(gate_up, float("nan"))
    assert act.vjp_into(gate_up.detach(), grad_h, memo, grad_buf) is grad_buf
    assert rel_err(grad_buf, want_grad) < 1e-14


def test_clamps_cut_the_gradient_past_the_limit_only():
    act = get_activation("clamped_swiglu", limit=LIMIT)
    gate_up = torch.tensor([[LIMIT + 1e-3, 0.2], [LIMIT, -LIMIT - 1e-3]], dtype=torch.float64)
    grad = act.vjp(gate_up, torch.ones(2, 1, dtype=torch.float64))
    assert grad[0, 0] == 0 and grad[1, 1] == 0  # past the clamps
    assert grad[1, 0] != 0 and grad[0, 1] != 0  # at the gate's clamp, and inside


def test_softcapped_computes_in_fp32_for_bf16():
    act, ref = _activation("softcapped_swiglu")
    gate_up = _gate_up(dtype=torch.bfloat16)
    want = ref(gate_up[:, :6].float(), gate_up[:, 6:].float()).to(torch.bfloat16)  # as Inkling2 does
    assert torch.equal(act(gate_up), want)


@pytest.mark.parametrize("case", [c for c in CASES if c != "silu"])
def test_engine_with_the_activation_matches_the_float64_loop(case):
    act, ref = _activation(case)
    layer = make_layer(bias=True)
    layer.gate_up.mul_(4.0)  # pre-activations well past the clamps and softcaps
    x, ids, w = make_routing(T=17, E=8, k=2, H=24)
    gy = torch.randn(17, 24, dtype=torch.float64)
    y, grads = run_module(build_module(layer, full=True, activation=act), x, ids, w, gy)
    y_ref, want = run_reference(layer, x, ids, w, gy, act=ref, full=True)
    assert rel_err(y, y_ref) < 1e-12
    for name in want:
        assert rel_err(grads[name], want[name]) < 1e-12, name
