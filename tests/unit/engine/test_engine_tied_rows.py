"""Non-gated experts ``down(relu(up x)^2)`` (NemotronH) run as gated ones on tied rows, LoRA included.

The engine holds gate_up = [up; up] with the gated ``relu`` activation (``relu(u) * u = relu(u)^2``); a call's LoRA
has up's B ``[E, I, r]`` used for both halves (``gate_up_rows`` = ``[0, I)`` twice). Against a plain float64 autograd
loop of the non-gated expert itself: output, grads of x, of the routing weights and of every LoRA tensor in the
call's own shapes (up's B grad is the sum over both uses).
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine import ActivationPolicy, DenseExperts, EngineOptions, ExpertEngine, ExpertLoRA
from moetune.errors import EngineError
from moetune.layer import CpuExperts
from tests.unit.engine_cases import make_routing, rel_err

E, H, I, R, S = 6, 20, 12, 3, 0.75  # S: LoRA scaling


def _non_gated_reference(x, ids, w, up, down, lora):
    """y[t] = sum_j w[t, j] * D_e relu(U_e x + s B1 A1 x)^2 (+ s B2 A2 h), a plain loop, float64 autograd."""
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            u = up[e] @ x[t] + S * lora["up_B"][e] @ (lora["up_A"][e] @ x[t])
            h = torch.relu(u) ** 2
            out = down[e] @ h + S * lora["down_B"][e] @ (lora["down_A"][e] @ h)
            y[t] = y[t] + w[t, j] * out
    return y


@pytest.mark.parametrize("policy", [ActivationPolicy.RETAIN, ActivationPolicy.RECOMPUTE])
def test_non_gated_experts_on_tied_rows_match_the_plain_loop(policy):
    gen = torch.Generator().manual_seed(3)
    up = torch.randn(E, I, H, generator=gen, dtype=torch.float64) / H**0.5
    down = torch.randn(E, H, I, generator=gen, dtype=torch.float64) / I**0.5
    shapes = {"up_A": (E, R, H), "up_B": (E, I, R), "down_A": (E, R, I), "down_B": (E, H, R)}
    leaves = {
        n: (torch.randn(s, generator=gen, dtype=torch.float64) * 0.3).requires_grad_(True)
        for n, s in shapes.items()
    }
    x, ids, w = make_routing(T=9, E=E, k=2, H=H)
    gy = torch.randn(x.shape, generator=gen, dtype=torch.float64)

    tied = torch.arange(I).repeat(2)  # gate rows and up rows both read up's rows
    lora = ExpertLoRA(
        leaves["up_A"], leaves["up_B"], leaves["down_A"], leaves["down_B"], scaling=S, gate_up_rows=tied
    )
    engine = ExpertEngine(
        DenseExperts(torch.cat((up, up), dim=1), down.clone()),
        activation="relu",
        options=EngineOptions(policy=policy),
    )
    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = CpuExperts(engine)(xg, ids, wg, lora=lora)
    (y * gy).sum().backward()
    got = {n: leaves[n].grad.clone() for n in leaves}

    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    for leaf in leaves.values():
        leaf.grad = None
    y_ref = _non_gated_reference(xr, ids, wr, up, down, leaves)
    (y_ref * gy).sum().backward()
    assert rel_err(y, y_ref) < 1e-12
    assert rel_err(xg.grad, xr.grad) < 1e-12 and rel_err(wg.grad, wr.grad) < 1e-12
    for name, leaf in leaves.items():
        assert got[name].shape == leaf.shape
        assert rel_err(got[name], leaf.grad) < 1e-12, name


def test_gate_up_rows_must_index_gate_up_b():
    a, b = torch.zeros(E, R, H), torch.zeros(E, I, R)
    down_a, down_b = torch.zeros(E, R, I), torch.zeros(E, H, R)
    with pytest.raises(EngineError, match="indices of gate_up_B's 12 rows"):
        ExpertLoRA(a, b, down_a, down_b, scaling=1.0, gate_up_rows=torch.arange(2 * I))
    with pytest.raises(EngineError, match=r"down_A must be \(6, 3, 6\)"):
        ExpertLoRA(a, b, down_a, down_b, scaling=1.0)  # no rows: B's 12 rows are 2I, so I = 6
