"""Per-call expert LoRA (``forward(..., lora=...)``, what moetune's PEFT layer passes), against float64 autograd.

The call's LoRA is laid out as PEFT holds it: A ``[E, r, in]`` leaves, B a strided ``[E, out, r]`` view of a
``[out, r, E]`` leaf, gate_up's B rows optionally in another order (``gate_up_rows``, as for gpt-oss's
interleaved gate/up). Whatever LoRA the engine was built with (none, another one, or full mode), output and
every gradient equal the plain float64 loop run with the call's LoRA; the LoRA grads reach the leaves in
their own layout and row order; the engine's own LoRA gets no gradient and its mode stays as built.
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine import (
    LORA_NAMES,
    ActivationPolicy,
    DenseExperts,
    EngineOptions,
    ExpertEngine,
    ExpertLoRA,
    TrainMode,
)
from moetune.layer import CpuExperts
from tests.unit.engine_cases import make_layer, make_routing, rel_err, run_reference

TOL = 1e-12  # float64 engine against the float64 loop: only summation order differs


def _call_lora(
    engine_order: dict[str, torch.Tensor], scaling: float, rows: torch.Tensor | None
) -> tuple[ExpertLoRA, dict[str, torch.Tensor]]:
    """The call's LoRA (views of leaves, as PEFT's parameters are seen) and the leaves, keyed by LORA_NAMES.

    ``engine_order`` holds B with gate rows first; with ``rows``, the leaf of gate_up_B holds its rows in the
    call's order, row ``rows[j]`` being the engine's row j."""
    leaves: dict[str, torch.Tensor] = {}
    views: dict[str, torch.Tensor] = {}
    for name in LORA_NAMES:
        t = engine_order[name].clone()
        if name == "gate_up_B" and rows is not None:
            t = torch.empty_like(t).index_copy_(1, rows, t)
        if name.endswith("_B"):  # [E, out, r] seen from a [out, r, E] leaf (PEFT's rank-major lora_B)
            leaves[name] = t.permute(1, 2, 0).contiguous().requires_grad_(True)
            views[name] = leaves[name].permute(2, 0, 1)
        else:
            leaves[name] = views[name] = t.requires_grad_(True)
    return ExpertLoRA(**views, scaling=scaling, gate_up_rows=rows), leaves


@pytest.mark.parametrize("policy", [ActivationPolicy.RETAIN, ActivationPolicy.RECOMPUTE])
@pytest.mark.parametrize("built", ["frozen", "own_lora", "full"])
@pytest.mark.parametrize("reordered", [False, True], ids=["rows_in_order", "rows_reordered"])
def test_call_lora_matches_float64_loop(policy, built, reordered):
    E, H, I = 8, 24, 16
    layer = make_layer(E, H, I, r=4)
    assert layer.lora is not None
    x, ids, w = make_routing(T=11, E=E, k=2, H=H)
    gy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    rows = torch.randperm(2 * I, generator=torch.Generator().manual_seed(9)) if reordered else None
    lora, leaves = _call_lora(layer.lora, layer.scaling, rows)
    # the engine's own LoRA, when it has one, differs from the call's: a backward using it would be wrong
    own = ExpertLoRA.init(E, H, I, 2, 4.0, dtype=torch.float64) if built == "own_lora" else None
    if own is not None:
        own.gate_up_B.normal_(generator=torch.Generator().manual_seed(3))
    engine = ExpertEngine(
        DenseExperts(layer.gate_up.clone(), layer.down.clone()),
        lora=own,
        train_base=built == "full",
        options=EngineOptions(policy=policy),
    )
    mod = CpuExperts(engine)

    xg, wg = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = mod(xg, ids, wg, lora=lora)
    (y * gy).sum().backward()
    y_ref, ref = run_reference(layer, x, ids, w, gy, full=built == "full")

    assert rel_err(y, y_ref) < TOL
    assert rel_err(xg.grad, ref["x"]) < TOL and rel_err(wg.grad, ref["w"]) < TOL
    for name in LORA_NAMES:
        want = ref[f"lora_{name}"]  # engine order, [E, out, r] for B
        if name == "gate_up_B" and rows is not None:
            want = torch.empty_like(want).index_copy_(1, rows, want)
        if name.endswith("_B"):
            want = want.permute(1, 2, 0)
        assert rel_err(leaves[name].grad, want) < TOL, name
    if built == "full":
        assert rel_err(mod.gate_up_proj.grad, ref["gate_up_proj"]) < TOL
        assert rel_err(mod.down_proj.grad, ref["down_proj"]) < TOL
    if own is not None:
        assert all(p.grad is None for p in own.tensors())
    assert (
        engine.mode is {"frozen": TrainMode.FROZEN, "own_lora": TrainMode.LORA, "full": TrainMode.FULL}[built]
    )


def test_backward_uses_the_lora_its_forward_ran_with():
    """Two saved forwards of one frozen engine, with and without a call's LoRA, differentiated in reverse
    order: each backward's grads are those of its own forward's LoRA (none for the plain one)."""
    layer = make_layer()
    assert layer.lora is not None
    x, ids, w = make_routing(T=7, E=8, k=2, H=24)
    gy = torch.ones_like(x)
    engine = ExpertEngine(
        DenseExperts(layer.gate_up, layer.down), options=EngineOptions(policy=ActivationPolicy.RECOMPUTE)
    )
    lora, _ = _call_lora(layer.lora, layer.scaling, None)
    _, with_lora = engine.forward(x, ids, w, lora=lora)
    _, plain = engine.forward(x, ids, w)
    assert with_lora is not None and plain is not None and with_lora.lora is lora and plain.lora is None
    assert engine.backward(plain, gy).lora is None
    grads = engine.backward(with_lora, gy)
    _, ref = run_reference(layer, x, ids, w, gy)
    assert grads.lora is not None
    assert rel_err(grads.lora["down_A"], ref["lora_down_A"]) < TOL
    assert rel_err(grads.x, ref["x"]) < TOL
