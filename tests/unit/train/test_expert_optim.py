"""The full-mode expert optimizer against torch's AdamW on the same tensors (moetune.train.expert_optim).

The reference is the same model trained by stock ``torch.optim.AdamW`` (single-tensor arithmetic) on the dense
``.grad`` plain autograd gives the expert weights (zeros for experts without tokens); ``ExpertAdamW`` sees only
the sparse fp32 gradients of the experts with tokens.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetune.config.schema import ExpertUpdate
from moetune.errors import ConfigError
from moetune.layer.cpu_experts import drop_base_grads
from moetune.train.expert_optim import ExpertAdamW, ExpertOptimSpec, expert_layers
from moetune.train.guards import non_finite_parameters
from moetune.train.moment_store import BLOCK, STORES
from tests.unit.engine_cases import build_module, make_layer

E, H, I = 8, 24, 16
LR, WD = 1e-2, 0.1
# experts routed at each step: 6 and 7 never, 3 only at step 0, so exact mode must still move them
ROUTED = [(0, 1, 2, 3), (0, 1, 4), (1, 2, 5), (0, 4, 5)]


def _model(layers: int = 1) -> nn.Module:
    torch.manual_seed(0)
    base = make_layer(E=E, H=H, I=I, lora=False, bias=True, dtype=torch.float32)
    mods = [nn.Linear(H, H)] + [build_module(base, full=True) for _ in range(layers)]
    return nn.ModuleList(mods)


def _batch(step: int, k: int = 2, T: int = 12):
    gen = torch.Generator().manual_seed(100 + step)
    allowed = torch.tensor(ROUTED[step % len(ROUTED)])
    ids = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[:k]] for _ in range(T)])
    return (
        torch.randn(T, H, generator=gen),
        ids,
        torch.rand(T, k, generator=gen),
        torch.randn(T, H, generator=gen),
    )


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, ids, w, gy = _batch(step)
    h = model[0](x)
    for m in model[1:]:
        h = m(h, ids, w)
    return (h * gy).sum()


def _ours(model: nn.Module, spec: ExpertOptimSpec | None = None, **kw) -> ExpertAdamW:
    return ExpertAdamW(
        [{"params": list(model.parameters())}],
        expert_layers(model),
        spec or ExpertOptimSpec(),
        lr=LR,
        weight_decay=WD,
        foreach=False,
        **kw,
    )


def _torch(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)


def _train(model, opt, steps: int = 4, clip: float | None = None, micro: int = 1, arm: bool = False):
    norms = []
    for s in range(steps):
        for j in range(micro):
            if arm and j == micro - 1:
                opt.arm()
            _loss(model, s * micro + j).backward()
        if clip is not None:
            if isinstance(opt, ExpertAdamW):
                norms.append(
                    float(opt.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip))
                )
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return norms


def test_fp32_state_is_torch_adamw_bit_for_bit_with_sparse_grads() -> None:
    ref, mine = _model(), _model()
    _train(ref, _torch(ref))
    opt = _ours(mine)
    _loss(mine, 0).backward()
    experts = mine[1]
    assert experts.gate_up_proj.grad is None  # no dense gradient ...
    assert set(experts.base_grads.grads) == set(ROUTED[0])  # ... only the experts with tokens, fp32
    opt.zero_grad()
    _train(mine, opt)
    for (name, a), b in zip(ref.named_parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b), name
    # the untouched experts moved: weight decay and momentum, as torch's AdamW with zero gradients does
    assert not torch.equal(mine[1].gate_up_proj[6], _model()[1].gate_up_proj[6])


def test_updates_the_engines_own_tensors_in_place() -> None:
    model = _model()
    experts = model[1]
    weights = experts.engine.weights
    ptr, before = weights.gate_up.data_ptr(), weights.gate_up.detach().clone()
    _train(model, _ours(model), steps=1)
    assert weights.gate_up is experts.gate_up_proj and weights.gate_up.data_ptr() == ptr
    assert not torch.equal(weights.gate_up, before)


def test_clipping_and_norm_cover_the_expert_grads() -> None:
    ref, mine = _model(), _model()
    want = _train(ref, _torch(ref), clip=0.5)
    got = _train(mine, _ours(mine), clip=0.5)
    assert want[0] > 0.5  # the clip is active
    assert got == pytest.approx(want, rel=1e-5)
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_accumulation_sums_the_micro_batches() -> None:
    ref, mine = _model(), _model()
    _train(ref, _torch(ref), steps=2, micro=2)
    _train(mine, _ours(mine), steps=2, micro=2)
    for a, b in zip(ref.parameters(), mine.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # fp32 sums in another order


def test_overlapped_update_equals_the_step_after_backward() -> None:
    plain, overlapped = _model(layers=3), _model(layers=3)
    _train(plain, _ours(plain), steps=3, micro=2)
    opt = _ours(overlapped)
    gate_up = overlapped[3].gate_up_proj
    version = gate_up._version
    opt.arm()
    _loss(overlapped, 0).backward()
    opt.wait()
    assert gate_up._version > version  # updated during backward, before step()
    opt.step()
    opt.zero_grad()
    # the first step done: train the rest the same way as the plain run did from the start
    fresh = _model(layers=3)
    opt_fresh = _ours(fresh)
    _train(fresh, opt_fresh, steps=3, micro=2, arm=True)
    for a, b in zip(plain.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_lazy_update_leaves_idle_experts_as_they_were() -> None:
    exact, lazy = _model(), _model()
    _train(exact, _ours(exact))
    opt = _ours(lazy, ExpertOptimSpec(update=ExpertUpdate.LAZY))
    _train(lazy, opt)
    untouched = _model()[1]
    for e in (6, 7):  # never routed: weights and moments as at the start
        assert torch.equal(lazy[1].gate_up_proj[e], untouched.gate_up_proj[e])
        assert not opt.state[lazy[1].gate_up_proj]["exp_avg"][e].any()
    steps = opt.state[lazy[1].gate_up_proj]["step"]
    assert steps.tolist() == [3, 3, 2, 1, 2, 2, 0, 0]  # each expert counts its own steps (ROUTED)
    # one step from the same start: lazy is exact on the experts with tokens, and leaves the others alone
    one_exact, one_lazy = _model(), _model()
    _train(one_exact, _ours(one_exact), steps=1)
    _train(one_lazy, _ours(one_lazy, ExpertOptimSpec(update=ExpertUpdate.LAZY)), steps=1)
    for e in range(E):
        same = torch.equal(one_lazy[1].gate_up_proj[e], one_exact[1].gate_up_proj[e])
        assert same == (e in ROUTED[0]), e


# the stated bounds (docs/performance.md), as fractions of lr * steps (the most AdamW can move a weight):
# (worst weight, mean over weights). Measured after 8 steps: bf16 0.0033 / 0.0004, 8-bit 0.157 / 0.0029. The 8-bit
# worst case is a weight whose gradient is ~1e-5 of its block's largest: its first moment rounds to 0 and it
# skips its update (what blockwise 8-bit Adam does; the mean shows it is rare).
@pytest.mark.parametrize(
    ("state", "worst_bound", "mean_bound"), [("bf16", 0.01, 0.002), ("8bit", 0.25, 0.01)]
)
def test_low_precision_state_stays_within_its_bound(state, worst_bound, mean_bound) -> None:
    """bf16 / 8-bit moments: the weights stay within the stated bound of torch's AdamW (fp32 state), and the
    difference is real (the state is not secretly fp32)."""
    ref, mine = _model(), _model()
    steps = 8
    _train(ref, _torch(ref), steps=steps)
    opt = _ours(mine, ExpertOptimSpec(state=state))
    _train(mine, opt, steps=steps)
    diff = torch.cat(
        [(a - b).detach().abs().flatten() for a, b in zip(ref[1].parameters(), mine[1].parameters())]
    )
    assert 0 < float(diff.max()) <= worst_bound * LR * steps
    assert float(diff.mean()) <= mean_bound * LR * steps
    held = opt.state[mine[1].gate_up_proj]
    assert {t.dtype for k, t in held.items() if k != "step" and t.is_floating_point()} <= {
        torch.bfloat16,
        torch.float32,
    }
    assert opt.host_bytes()["state"] < sum(2 * 4 * p.numel() for p in mine[1].parameters())


def test_8bit_codes_round_trip_within_a_code_step() -> None:
    """|x - dequant(quant(x))| <= absmax / 127 per block for exp_avg (square-root code scale), and values far
    below absmax / 254 (zero on a linear code) survive."""
    store = STORES.get("8bit")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2 * BLOCK + 17, generator=gen) * torch.logspace(-4, 0, 2 * BLOCK + 17)
    state = store.init("exp_avg", x.shape)
    for e in range(3):
        store.write(state, "exp_avg", slice(e, e + 1), x[e : e + 1])
        back = store.read(state, "exp_avg", slice(e, e + 1))[0]
        blocks = torch.nn.functional.pad(x[e], (0, 3 * BLOCK - x.shape[1])).view(-1, BLOCK)
        absmax = blocks.abs().amax(1).repeat_interleave(BLOCK)[: x.shape[1]]
        assert bool(((back - x[e]).abs() <= absmax / 127 + 1e-12).all())
        small = x[e].abs() < absmax / 1000
        assert bool(((back - x[e]).abs()[small] < 0.5 * x[e].abs()[small] + absmax[small] / 127**2).all())


def test_skipped_step_drops_the_expert_grads() -> None:
    model = _model()
    opt = _ours(model)
    before = [p.detach().clone() for p in model[1].parameters()]
    _loss(model, 0).backward()
    model.zero_grad(set_to_none=True)
    drop_base_grads(model)  # what the guard does in on_divergence: skip
    opt.step()
    assert model[1].base_grads.nbytes == 0
    # nothing had a gradient: only exact mode's decay of every expert (no moments yet: no update)
    for a, b in zip(before, model[1].parameters(), strict=True):
        torch.testing.assert_close(b, a * (1 - LR * WD), rtol=0, atol=1e-7)


@pytest.mark.parametrize(
    ("optim", "args", "state"),
    [
        ("adamw_torch", None, "param"),
        ("adamw_torch_fused", None, "param"),
        ("adamw_8bit", None, "8bit"),
        ("paged_adamw_8bit", None, "8bit"),
        ("adamw_torch_8bit", None, "8bit"),
        ("adamw_anyprecision", "momentum_dtype=bfloat16,variance_dtype=bfloat16", "bf16"),
        ("adamw_anyprecision", None, "fp32"),
    ],
)
def test_optim_names_pick_the_state(optim, args, state) -> None:
    assert ExpertOptimSpec.from_optim(optim, args).state == state


def test_unusable_optim_is_refused_naming_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match="optim: 'sgd'.*adamw_8bit"):
        ExpertOptimSpec.from_optim("sgd")
    with pytest.raises(ConfigError, match="optim_args"):
        ExpertOptimSpec.from_optim("adamw_anyprecision", "momentum_dtype=bfloat16")


def test_non_finite_expert_grads_are_not_applied(caplog) -> None:
    """A NaN gradient (what the guard then stops on, via the gradient norm) never reaches the expert weights."""
    model = _model()
    opt = _ours(model)
    _loss(model, 0).backward()
    model[1].base_grads.grads[0]["down"][0, 0] = float("nan")
    before = model[1].gate_up_proj.detach().clone()
    assert not torch.isfinite(opt.grad_norm([p for p in model.parameters() if p.grad is not None]))
    assert non_finite_parameters(model, grads=True) == ["1.down_proj"]  # what the guard's message names
    with caplog.at_level("WARNING"):
        opt.step()
    assert torch.equal(model[1].gate_up_proj, before) and "non-finite expert gradients" in caplog.text


def test_sparse_grads_equal_float64_autograd_and_cover_only_routed_experts() -> None:
    """The buffer's per-expert gradients (two micro-batches summed) against the float64 per-expert autograd loop;
    experts without rows have no entry at all (their reference gradient is zero)."""
    from tests.unit.engine_cases import make_routing, rel_err, run_reference

    layer = make_layer(E=E, H=H, I=I, lora=False, bias=True, dtype=torch.float64)
    module = build_module(layer, full=True)
    (lay,) = expert_layers(nn.ModuleList([module]))
    want: dict[str, torch.Tensor] = {}
    for seed in (1, 2):
        x, ids, w = make_routing(T=9, E=E, k=2, H=H, seed=seed)
        ids = ids % 5  # experts 5..7 get no rows
        ids[:, 1] = (ids[:, 0] + 1) % 5
        gy = torch.randn(9, H, dtype=torch.float64)
        (module(x, ids, w) * gy).sum().backward()
        _, ref = run_reference(layer, x, ids, w, gy, full=True)
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            want[name] = want.get(name, 0) + ref[name]
    assert module.gate_up_proj.grad is None and sorted(lay.buffer.grads) == [0, 1, 2, 3, 4]
    for base, name in (
        ("gate_up", "gate_up_proj"),
        ("down", "down_proj"),
        ("gate_up_bias", "gate_up_proj_bias"),
    ):
        got = torch.stack([lay.buffer.grads[e][base] for e in range(5)])
        assert rel_err(got, want[name][:5]) < 1e-12, name
        assert not want[name][5:].any()
