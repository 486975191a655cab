"""The engine benchmark: its FLOP model, its baselines' equivalence with the engine, its timing rules, and the
``moetune bench engine`` command end to end on a tiny case. Nothing here asserts a speed."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from moetune.adapters import lora_from_peft
from moetune.bench.engine import REQUIRED_KEYS, EngineBenchConfig, select_cases
from moetune.bench.flops import expert_flops, expert_weight_bytes
from moetune.bench.runners import RUNNERS, hf_experts, make_batch, make_weights
from moetune.bench.timing import CallBudget, TimingPolicy, interleaved_min_ms, measure
from moetune.cli.main import main
from moetune.engine import LORA_NAMES, ActivationPolicy, DenseExperts, EngineOptions, ExpertEngine, TrainMode
from moetune.errors import ConfigError
from moetune.testing.reference import expert_loop

RETAIN, RECOMPUTE = ActivationPolicy.RETAIN, ActivationPolicy.RECOMPUTE
FROZEN, LORA, FULL = TrainMode.FROZEN, TrainMode.LORA, TrainMode.FULL


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# ---- FLOP model
def _gemms(t, k, h, i, r, mode, policy):
    """Every GEMM the engine runs, as (m, k, n) per the code in moetune/engine/experts.py: a hand count."""
    n = t * k
    fwd = [(n, h, 2 * i), (n, i, h)]  # x W1^T, h W2^T
    bwd = [(n, h, i), (n, 2 * i, h)]  # g W2, ggu W1
    if mode is not FROZEN:
        fwd += [(n, h, r), (n, r, 2 * i), (n, i, r), (n, r, h)]  # x A1^T, (.) B1^T, h A2^T, (.) B2^T
        for d_in, d_out in ((h, 2 * i), (i, h)):
            bwd += [(n, d_out, r), (n, r, d_in), (r, n, d_in), (d_out, n, r)]  # g B, (.) A, grad A, grad B
    if mode is FULL:
        bwd += [(h, n, i), (2 * i, n, h)]  # grads of W2 and W1
    if policy is RECOMPUTE:
        bwd += [(n, h, 2 * i)]
        if mode is not FROZEN:
            bwd += [(n, h, r), (n, r, 2 * i), (n, i, r)]  # gate_up LoRA again, down's A-projection
    return sum(2 * a * b * c for a, b, c in fwd), sum(2 * a * b * c for a, b, c in bwd)


@pytest.mark.parametrize("mode", [FROZEN, LORA, FULL])
@pytest.mark.parametrize("policy", [RETAIN, RECOMPUTE])
def test_flops_match_a_hand_count(mode, policy):
    t, k, h, i, r = 3, 2, 4, 5, 2
    count = expert_flops(t, k, h, i, r, mode, policy)
    assert (count.forward, count.backward) == _gemms(t, k, h, i, r, mode, policy)


def test_flops_literal_values():
    # N = 6, H = 4, I = 5, r = 2: forward 6NHI = 720, LoRA 2Nr(2H + 3I) = 24 * 23 = 552
    frozen = expert_flops(3, 2, 4, 5, 2, FROZEN, RETAIN)
    assert (frozen.forward, frozen.backward) == (720, 720)  # the rank is ignored without LoRA
    lora = expert_flops(3, 2, 4, 5, 2, LORA, RECOMPUTE)
    assert lora.forward == 720 + 552
    assert lora.backward == 720 + 2 * 552 + 480 + 2 * 6 * 2 * (4 + 15)


@pytest.mark.parametrize("mode", [FROZEN, LORA, FULL])
def test_flops_match_torch_flop_counter_on_the_loop(mode):
    """Autograd on the plain loop keeps every activation (retain) and computes exactly the needed grads."""
    t, k, e, h, i, r = 5, 2, 4, 8, 6, 3
    weights = make_weights(e, h, i, r, 6, torch.float64, seed=0)
    batch = make_batch(t, e, k, h, torch.float64, seed=1)
    gu = weights.gate_up.clone().requires_grad_(mode is FULL)
    dn = weights.down.clone().requires_grad_(mode is FULL)
    lora = None
    if mode is not FROZEN:
        lora = {n: p.clone().requires_grad_(True) for n, p in zip(LORA_NAMES, weights.lora.tensors())}
    x = batch.x.clone().requires_grad_(True)
    counter = FlopCounterMode(display=False)
    with counter:
        y = expert_loop(x, batch.topk_ids, batch.topk_weights, gu, dn, lora=lora, scaling=2.0)
    forward = counter.get_total_flops()
    with counter:
        y = expert_loop(x, batch.topk_ids, batch.topk_weights, gu, dn, lora=lora, scaling=2.0)
        y.backward(batch.grad_y)
    expected = expert_flops(t, k, h, i, r, mode, RETAIN)
    assert (forward, counter.get_total_flops() - forward) == (expected.forward, expected.backward)


def test_weight_bytes_count_active_experts_in_both_passes():
    assert expert_weight_bytes(3, 4, 5, 2) == 2 * 3 * (2 * 5 * 4 + 4 * 5) * 2


# ---- baselines compute what the engine computes
@pytest.mark.parametrize("mode", [FROZEN, LORA])
def test_hf_baseline_equals_engine(mode):
    e, h, i, r, t, k = 8, 24, 16, 4, 12, 3  # H != 2I, so a swapped in/out would show
    weights = make_weights(e, h, i, r, 8, torch.float32, seed=0)
    batch = make_batch(t, e, k, h, torch.float32, seed=1)
    engine = ExpertEngine(
        DenseExperts(weights.gate_up, weights.down), lora=weights.lora if mode is LORA else None
    )
    y_eng, saved = engine.forward(batch.x, batch.topk_ids, batch.topk_weights)
    grads = engine.backward(saved, batch.grad_y)

    module = hf_experts(weights, mode, k)
    experts = next(m for m in module.modules() if type(m).__name__ == "Qwen3MoeExperts")
    assert experts.config._experts_implementation == "grouped_mm"
    x = batch.x.clone().requires_grad_(True)
    w = batch.topk_weights.clone().requires_grad_(True)
    y_hf = module(x, batch.topk_ids, w)
    y_hf.backward(batch.grad_y)
    tol = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(y_hf, y_eng, **tol)
    torch.testing.assert_close(x.grad, grads.x, **tol)
    torch.testing.assert_close(w.grad, grads.topk_weights, **tol)
    if mode is LORA:
        assert grads.lora is not None
        assert float(weights.lora.gate_up_B.abs().max()) > 0  # B != 0: the LoRA path is really exercised
        from peft.tuners.lora.layer import ParamWrapper

        wrappers = {m.parameter_name: m for m in module.modules() if isinstance(m, ParamWrapper)}
        for proj, param in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            pw = wrappers[param]
            ga, gb = lora_from_peft(pw.lora_A["default"].weight.grad, pw.lora_B["default"].weight.grad, e)
            torch.testing.assert_close(ga, grads.lora[f"{proj}_A"], **tol)
            torch.testing.assert_close(gb, grads.lora[f"{proj}_B"], **tol)


@pytest.mark.parametrize("mode", [FROZEN, LORA])
def test_every_runner_runs_a_step(mode, one_thread):
    weights = make_weights(4, 16, 8, 2, 4, torch.bfloat16, seed=0)
    batch = make_batch(6, 4, 2, 16, torch.bfloat16, seed=1)
    for name in RUNNERS:
        step = RUNNERS.get(name)(weights, batch, mode, EngineOptions())
        step.backward(step.forward())
        if name == "engine":
            assert step.held_bytes is not None and step.held_bytes > 0


# ---- timing rules
def test_long_warmup_is_the_only_sample():
    calls = []
    timing = measure(
        lambda: (calls.append(1), time.sleep(0.01)), None, TimingPolicy(warmup=1, reps=5, budget_s=0.005)
    )
    assert len(calls) == 1 and timing.samples == 1 and timing.fwd_ms >= 10


def test_repetitions_stop_at_the_budget():
    timing = measure(lambda: time.sleep(0.01), None, TimingPolicy(warmup=0, reps=50, budget_s=0.025))
    assert 1 <= timing.samples <= 3


def test_call_budget_predicts_linearly():
    budget = CallBudget(max_call_s=10.0)
    assert budget.skip_reason("k", 100) is None  # nothing measured yet: run it
    budget.record("k", 100, 3.0)
    assert budget.predicted_s("k", 300) == pytest.approx(9.0)
    assert budget.skip_reason("k", 300) is None
    assert "predicted 12 s" in budget.skip_reason("k", 400)
    assert budget.skip_reason("other", 400) is None


# ---- configuration and the command
def test_cases_filter_and_errors():
    config = EngineBenchConfig(experts=(64,), tokens=(512, 128), cases=("E64-T128-*",))
    names = [c.name for c in select_cases(config)]
    assert names == [
        "E64-T128-lora-retain",
        "E64-T128-lora-recompute",
        "E64-T128-frozen-retain",
        "E64-T128-frozen-recompute",
    ]
    with pytest.raises(ConfigError, match="matched no case"):
        select_cases(EngineBenchConfig(cases=("nothing",)))
    with pytest.raises(ConfigError) as err:
        EngineBenchConfig(experts=(4,), top_k=8, rank=0).validate()
    assert "top_k" in str(err.value) and "rank" in str(err.value)


def test_bench_engine_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "engine.json"
    tiny = "--experts 4 --tokens 8 --hidden 32 --intermediate 16 --top-k 2 --rank 2 --gemm-rows 8 --bandwidth-mib 8"
    argv = [
        "bench",
        "engine",
        *tiny.split(),
        "--reps",
        "1",
        "--warmup",
        "0",
        "--threads",
        "1",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    records = json.loads(out.read_text())
    assert [r["case"] for r in records] == [
        "E4-T8-lora-retain",
        "E4-T8-lora-recompute",
        "E4-T8-frozen-retain",
        "E4-T8-frozen-recompute",
    ]
    measured = ("fwd_ms", "bwd_ms", "tflops", "roofline_ms", "roofline_fraction", "vs_loop", "vs_hf")
    for rec in records:
        assert set(REQUIRED_KEYS) <= rec.keys()
        for key in measured:
            assert isinstance(rec[key], float) and math.isfinite(rec[key]) and rec[key] > 0, (key, rec[key])
        assert rec["rank"] == (2 if rec["mode"] == "lora" else 0)
    printed = capsys.readouterr().out
    assert printed.startswith("moetune bench engine |") and "E4-T8-frozen-recompute" in printed
    assert "GB/s" in printed.splitlines()[0] and "TFLOP/s" in printed.splitlines()[0]


def test_bench_engine_thread_scaling(tmp_path, capsys):
    """Two or more --threads counts: every case on every count, the expert pool and one expert at a time."""
    out = tmp_path / "scaling.json"
    tiny = "--experts 4 --tokens 8 --hidden 32 --intermediate 16 --top-k 2 --rank 2 --policies retain"
    argv = ["bench", "engine", *tiny.split(), "--reps", "2", "--warmup", "0", "--threads", "2", "1"]
    assert main([*argv, "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    keys = [(r["case"], r["variant"], r["threads"]) for r in records]
    assert sorted(keys) == sorted(
        (c, v, n)
        for c in ("E4-T8-lora-retain", "E4-T8-frozen-retain")
        for v in ("experts", "intra")
        for n in (1, 2)
    )
    for rec in records:
        assert rec["samples"] == 2 and 0 < rec["min_ms"] <= rec["step_ms"] <= rec["max_ms"]
        assert rec["efficiency"] == pytest.approx(rec["speedup"] / rec["threads"], rel=1e-3)
        if rec["threads"] == 1:
            assert rec["speedup"] == 1.0
        if rec["variant"] == "intra":
            assert rec["vs_intra"] == 1.0
    printed = capsys.readouterr().out
    first = printed.splitlines()[0]
    assert first.startswith("moetune bench engine, thread scaling |") and "threads [1, 2]" in first
    assert "AVX" in first or "no SIMD flags found" in first  # the ISA it ran on


def test_bench_engine_thread_scaling_python_ops_variant(tmp_path, monkeypatch):
    """--python-ops adds experts-py, the default pool with each expert's op sequences in Python (the A/B of the
    compiled sequences); its engines are built with native_ops=False, the others with the default."""
    from moetune.bench import scaling

    built: list[bool | None] = []
    real = scaling.RUNNERS.get("engine")

    def spy(weights, batch, mode, options):
        built.append(options.native_ops)
        return real(weights, batch, mode, options)

    monkeypatch.setattr(scaling.RUNNERS, "get", lambda name: spy)
    out = tmp_path / "scaling.json"
    tiny = "--experts 4 --tokens 8 --hidden 32 --intermediate 16 --top-k 2 --rank 2 --policies retain --modes lora"
    argv = ["bench", "engine", *f"{tiny} --reps 1 --warmup 0 --threads 2 1 --python-ops".split()]
    assert main([*argv, "--json", str(out)]) == 0
    variants = {(r["variant"], r["threads"]) for r in json.loads(out.read_text())}
    assert variants == {(v, n) for v in ("experts", "intra", "experts-py") for n in (1, 2)}
    assert sorted(built, key=str) == [False, False] + [None] * 4


def test_interleaved_min_ms_runs_every_call_in_turn():
    """Each rep runs every labelled call over all items before the next rep; the result is per label, per item."""
    order: list[tuple[str, int]] = []

    def slow(i: int) -> None:
        order.append(("slow", i))
        time.sleep(0.002)

    best = interleaved_min_ms({"fast": lambda i: order.append(("fast", i)), "slow": slow}, items=3, reps=2)
    assert order == [(label, i) for _ in range(2) for label in ("fast", "slow") for i in range(3)]
    assert set(best) == {"fast", "slow"} and 0 <= best["fast"] < best["slow"] and best["slow"] >= 2.0
