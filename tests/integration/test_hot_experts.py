"""Hot experts (``gpu_experts``): some experts computed on the model's device (``device="cpu"`` stands in here),
the rest in the engine. Logits and every gradient equal the all-CPU model's; the engine never computes a hot
expert (its copy is poisoned with NaN); the saved adapter loads in stock PEFT on the unmodified transformers
model to the same logits; bad values are refused before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetune.errors import ConfigError
from moetune.layer import CpuExperts
from moetune.testing.tiny import VOCAB, save_tiny_model

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss")
TOL = 1e-5  # float32: the hot and cold shares are summed in another order than the engine's own combine
WAIT = (
    20.0  # seconds one side of the overlap test waits for the other before it fails (a guard, not a timing)
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: save_tiny_model(f, root / f, tokenizer=False) for f in FAMILIES}


def _model(path: Path, **options):
    from moetune.adapters import attach_lora
    from moetune.loading import load_model

    model = load_model(path, device="cpu", dtype="float32", progress=False, **options)
    torch.manual_seed(3)
    peft_model = attach_lora(model, rank=4, alpha=8, targets=("o_proj", "experts"))
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # every LoRA tensor random, so no LoRA path (nor a wrong row) can hide
        for n, p in peft_model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return peft_model


def _experts(model) -> list[CpuExperts]:
    return [m for m in model.modules() if isinstance(m, CpuExperts)]


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (2, 13), generator=torch.Generator().manual_seed(seed))


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.logits.detach(), grads


@pytest.mark.parametrize("family", FAMILIES)
def test_hot_experts_match_all_cpu(checkpoints, family, one_thread) -> None:
    """Logits and every LoRA gradient (experts and attention) equal the all-CPU model's, with the engine's copy
    of the hot experts poisoned: the engine computes none of them."""
    path = checkpoints[family]
    ref = _model(path)
    layers = len(_experts(ref))
    hot_sets = [[1, 4, 6], [0, 7]][:layers] if layers > 1 else [[1, 4, 6]]
    hot = _model(path, gpu_experts=hot_sets)
    for experts, ids in zip(_experts(hot), hot_sets):
        assert experts.hot is not None and experts.hot.ids.tolist() == sorted(ids)
        with torch.no_grad():  # the engine must never read these experts again
            experts.engine.weights.gate_up[ids] = float("nan")
            experts.engine.weights.down[ids] = float("nan")
    ids = _ids()
    want_logits, want = _step(ref, ids)
    got_logits, got = _step(hot, ids)
    assert torch.isfinite(got_logits).all()
    torch.testing.assert_close(got_logits, want_logits, atol=TOL, rtol=TOL)
    assert set(got) == set(want) and any("experts" in n for n in want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=TOL, msg=name)
    # the hot experts received tokens: their LoRA A rows (PEFT's [E * r, in], expert-major) have gradients
    e = _experts(hot)[0].engine.num_experts
    for name, g in got.items():
        if "experts.lora_A" in name:
            assert g.view(e, -1)[sorted(hot_sets[0])].abs().sum() > 0, name
            break


def test_hot_int_and_eval_without_lora(checkpoints, one_thread) -> None:
    """``gpu_experts: N`` holds experts 0..N-1 of every layer; a plain forward (no LoRA, no grad) matches, and
    the memory report counts the device copies: N experts' gate_up [2I, H] and down [H, I] per layer."""
    from moetune.loading import load_model
    from moetune.train.modes import memory_report

    path = checkpoints["qwen3_moe"]
    ref = load_model(path, device="cpu", dtype="float32", progress=False).eval()
    hot = load_model(path, device="cpu", dtype="float32", progress=False, gpu_experts=3).eval()
    assert all(m.hot is not None and m.hot.ids.tolist() == [0, 1, 2] for m in _experts(hot))
    with torch.no_grad():
        torch.testing.assert_close(
            hot(input_ids=_ids(2)).logits, ref(input_ids=_ids(2)).logits, atol=TOL, rtol=TOL
        )
    e = _experts(hot)[0].engine
    want = len(_experts(hot)) * 3 * 3 * e.hidden_size * e.intermediate_size * 4  # fp32
    assert memory_report(hot)["hot_experts_device_gb"] == round(want / 2**30, 6) > 0
    assert memory_report(ref)["hot_experts_device_gb"] == 0


def test_hot_experts_with_gradient_checkpointing(checkpoints, one_thread) -> None:
    """Activation checkpointing recomputes the layer: the hot share is recomputed on the device, the engine's
    share reused (its memo); gradients equal the all-CPU model's without checkpointing."""
    path = checkpoints["qwen3_moe"]
    ref = _model(path)
    hot = _model(path, gpu_experts=[[2, 3], [5]])
    hot.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = _ids(4)
    want_logits, want = _step(ref, ids)
    got_logits, got = _step(hot, ids)
    torch.testing.assert_close(got_logits, want_logits, atol=TOL, rtol=TOL)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=TOL, msg=name)


def test_hot_experts_run_beside_the_engine_forward_and_backward(checkpoints, one_thread, monkeypatch) -> None:
    """Each side waits for the other, so the step finishes only if the two run at the same time: the hot experts'
    forward starts only once the engine's forward has started, the engine's backward only once the hot experts'
    backward has finished. (Run one after the other, the first waiter would wait for ever: here WAIT seconds, then
    it fails.) Logits and gradients still equal the all-CPU model's."""
    import threading

    path = checkpoints["qwen3_moe"]
    ref, hot = _model(path), _model(path, gpu_experts=[[1, 4, 6], [0, 7]])
    experts = _experts(hot)[0]
    assert experts.hot is not None
    engine_forward, hot_backward = threading.Event(), threading.Event()
    waited: list[str] = []

    def wait_for(event: threading.Event, what: str) -> None:
        if not event.wait(WAIT):
            waited.append(what)  # the failure is reported after the step, not raised on another thread
            raise AssertionError(f"waited {WAIT} s for {what}")

    forward, backward = experts.engine.forward, experts.engine.backward

    def engine_forward_started(*args, **kwargs):
        engine_forward.set()
        return forward(*args, **kwargs)

    def engine_backward_after_hot(*args, **kwargs):
        wait_for(hot_backward, "the hot experts' backward, before the engine's backward could go on")
        return backward(*args, **kwargs)

    monkeypatch.setattr(experts.engine, "forward", engine_forward_started)
    monkeypatch.setattr(experts.engine, "backward", engine_backward_after_hot)
    experts.hot.register_forward_pre_hook(
        lambda *_: wait_for(
            engine_forward, "the engine's forward, before the hot experts' forward could go on"
        )
    )
    experts.hot.register_full_backward_hook(lambda *_: hot_backward.set())
    ids = _ids(5)
    want_logits, want = _step(ref, ids)
    got_logits, got = _step(hot, ids)
    assert not waited and engine_forward.is_set() and hot_backward.is_set()
    torch.testing.assert_close(got_logits, want_logits, atol=TOL, rtol=TOL)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=TOL, rtol=TOL, msg=name)


def test_on_the_cpu_with_lora_dropout_the_hot_experts_run_first(checkpoints, one_thread, monkeypatch) -> None:
    """With expert LoRA dropout on the CPU stand-in both sides would draw masks from the one CPU generator at once:
    the hot experts run before the engine starts (it has not started when they begin, even given time), and two
    steps from the same seed give the same gradients."""
    import threading

    from moetune.adapters import attach_lora
    from moetune.loading import load_model

    path = checkpoints["qwen3_moe"]
    model = load_model(path, device="cpu", dtype="float32", progress=False, gpu_experts=[[1, 4, 6], [0, 7]])
    hot = attach_lora(model, rank=4, alpha=8, dropout=0.3, targets=("o_proj", "experts"))
    experts = _experts(hot)[0]
    assert experts.hot is not None
    engine_started = threading.Event()
    seen: list[bool] = []
    forward = experts.engine.forward

    def engine_forward(*args, **kwargs):
        engine_started.set()
        return forward(*args, **kwargs)

    monkeypatch.setattr(experts.engine, "forward", engine_forward)
    # beside each other, the engine would start within this wait; one after the other it never does
    experts.hot.register_forward_pre_hook(lambda *_: seen.append(engine_started.wait(2.0)))
    grads = []
    for _ in range(2):
        torch.manual_seed(11)
        hot.zero_grad()
        grads.append(_step(hot, _ids(6))[1])
        engine_started.clear()
    assert seen == [False, False]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_saved_adapter_loads_in_stock_peft(checkpoints, family, tmp_path) -> None:
    """The adapter trained with hot experts is the stock PEFT layout: loaded on the unmodified transformers
    model it gives the hot model's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path = checkpoints[family]
    hot = _model(path, gpu_experts=2).eval()
    ids = _ids(3)
    with torch.no_grad():
        want = hot(input_ids=ids).logits
    hot.save_pretrained(tmp_path / "a")
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(stock, tmp_path / "a").eval()
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=TOL, rtol=TOL)


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (9, "more than the 8 routed experts"),
        ([[0], [1], [2]], "3 per-layer lists, but the model has 2 MoE layers"),
        ([[0], [8]], "lists expert ids [8], but that layer has E = 8"),
        ([[0, 0], [1]], "lists an expert twice"),
        ("auto", "gpu_experts_budget is not set"),
        (-1, "allowed: 0 (none)"),
        ([0, 1], "allowed: 0 (none)"),
    ],
)
def test_bad_gpu_experts_refused_before_loading(checkpoints, value, needle, no_heavy_work) -> None:
    from moetune.loading import load_model

    with pytest.raises(ConfigError, match="gpu_experts") as info:
        load_model(checkpoints["qwen3_moe"], device="cpu", dtype="float32", progress=False, gpu_experts=value)
    assert needle in str(info.value)


def test_full_training_refuses_hot_experts(checkpoints) -> None:
    from moetune.loading import load_model

    model = load_model(checkpoints["qwen3_moe"], device="cpu", dtype="float32", progress=False, gpu_experts=1)
    with pytest.raises(ConfigError, match="gpu_experts"):
        _experts(model)[0].train_base()


def test_full_and_freeze_of_hot_experts_refused_before_loading(checkpoints, no_heavy_work) -> None:
    """The preflight's mode check (on the meta-device model) refuses training the base weights of experts modules
    that hold hot experts; freeze without those experts, and LoRA, are fine."""
    from moetune.config.experts import ExpertOptions
    from moetune.config.schema import FinetuningType
    from moetune.loading.load import plan_load
    from moetune.loading.options import LoadOptions
    from moetune.train.modes import ModeSettings, check_mode_planned

    experts = ExpertOptions.create(gpu_experts=[[1], []])  # layer 0 only
    planned = plan_load(checkpoints["qwen3_moe"], LoadOptions.create(experts=experts, dtype="float32"))
    full = ModeSettings(FinetuningType.FULL)
    with pytest.raises(ConfigError, match=r"gpu_experts puts experts of model\.layers\.0\.mlp\.experts"):
        check_mode_planned(planned, experts, full)
    with pytest.raises(ConfigError, match="finetuning_type: freeze"):  # the first layer's experts train
        check_mode_planned(planned, experts, ModeSettings(FinetuningType.FREEZE, trainable_layers=-1))
    check_mode_planned(planned, experts, ModeSettings(FinetuningType.FREEZE, trainable_layers=1))
    check_mode_planned(
        planned, experts, ModeSettings(FinetuningType.FREEZE, trainable_modules=("self_attn",))
    )
    check_mode_planned(planned, experts, ModeSettings(FinetuningType.LORA))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", FAMILIES)
def test_hot_experts_on_cuda_match_all_cpu(checkpoints, family) -> None:
    """On CUDA: the hot experts computed on the GPU, concurrently with the engine; logits and every gradient equal
    the all-CPU model's (fp32; CUDA's GEMMs sum in other orders, hence the looser tolerance)."""
    from moetune.adapters import attach_lora
    from moetune.loading import load_model

    path = checkpoints[family]
    ref = _model(path)
    model = load_model(path, device="cuda", dtype="float32", progress=False, gpu_experts=3)
    torch.manual_seed(3)
    hot = attach_lora(model, rank=4, alpha=8, targets=("o_proj", "experts"))
    with torch.no_grad():  # the same LoRA values as the reference, wherever each tensor lives
        params = dict(ref.named_parameters())
        for n, p in hot.named_parameters():
            if ".lora_" in n:
                p.copy_(params[n])
    assert all(m.hot is not None and m.hot.gate_up.is_cuda for m in _experts(hot))
    ids = _ids()
    want_logits, want = _step(ref, ids)
    got_logits, got = _step(hot, ids.cuda())
    torch.testing.assert_close(got_logits.cpu(), want_logits, atol=1e-4, rtol=1e-4)
    for name in want:
        torch.testing.assert_close(got[name].cpu(), want[name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_engine_computes_while_the_gpu_runs_the_hot_experts(checkpoints, monkeypatch) -> None:
    """Right after the hot experts' forward and after their backward have been queued, hooks keep the GPU busy
    (a sleep kernel of about a second, then an event); the engine's forward and backward each find that kernel
    still running when they start: the host copies they wait for were queued before the hot experts' work, and
    nothing on the host waited for the GPU to finish it."""
    import threading

    from moetune.adapters import attach_lora
    from moetune.loading import load_model

    path = checkpoints["qwen3_moe"]
    hot = attach_lora(
        load_model(path, device="cuda", dtype="float32", progress=False, gpu_experts=3),
        rank=4,
        alpha=8,
        targets=("o_proj", "experts"),
    )
    experts = _experts(hot)[0]
    assert experts.hot is not None
    queued = {"forward": threading.Event(), "backward": threading.Event()}
    busy: dict[str, torch.cuda.Event] = {}
    gpu_busy_at_start: dict[str, bool] = {}

    def keep_gpu_busy(phase: str) -> None:
        torch.cuda._sleep(2_000_000_000)  # clock cycles: about a second
        busy[phase] = torch.cuda.Event()
        busy[phase].record()
        queued[phase].set()

    def engine_pass(phase: str, run):
        def wrapped(*args, **kwargs):
            assert queued[phase].wait(WAIT), f"the hot experts' {phase} was not queued beside the engine's"
            gpu_busy_at_start[phase] = not busy[phase].query()
            return run(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(experts.engine, "forward", engine_pass("forward", experts.engine.forward))
    monkeypatch.setattr(experts.engine, "backward", engine_pass("backward", experts.engine.backward))
    experts.hot.register_forward_hook(lambda *_: keep_gpu_busy("forward"))
    experts.hot.register_full_backward_hook(lambda *_: keep_gpu_busy("backward"))
    _step(hot, _ids().cuda())
    torch.cuda.synchronize()
    assert gpu_busy_at_start == {"forward": True, "backward": True}


def test_bad_routing_is_refused_with_hot_experts(checkpoints) -> None:
    """The routing is checked whole before the split (the engine then sees one expert per row): a token listing
    an expert twice, or an id out of range, is the engine's own error."""
    from moetune.errors import EngineError
    from moetune.loading import load_model

    model = load_model(checkpoints["qwen3_moe"], device="cpu", dtype="float32", progress=False, gpu_experts=2)
    experts = _experts(model)[0]
    x, w = torch.randn(3, experts.engine.hidden_size), torch.full((3, 2), 0.5)
    for ids, needle in (
        ([[0, 0], [1, 2], [3, 4]], "lists an expert twice"),
        ([[0, 1], [-1, 2], [3, 4]], "out of range"),
    ):
        with pytest.raises(EngineError, match=needle):
            experts(x, torch.tensor(ids), w)


def test_auto_counts_the_routing_and_places_the_most_routed(checkpoints, one_thread) -> None:
    """``gpu_experts: auto``: the counts equal the routing the all-CPU model's experts modules receive (seen by
    forward pre-hooks there); ``place_auto`` with a budget of three experts places the three with the largest
    share of their layer's slots, and the logits do not change."""
    from moetune.layer.hot_auto import expert_device_bytes, place_auto
    from moetune.loading import load_model

    path = checkpoints["qwen3_moe"]
    ref = load_model(path, device="cpu", dtype="float32", progress=False).eval()
    seen: dict[int, torch.Tensor] = {}

    def count(j):
        def hook(module, args):
            seen[j] = seen.get(j, 0) + torch.bincount(
                args[1].reshape(-1), minlength=module.engine.num_experts
            )

        return hook

    for j, m in enumerate(_experts(ref)):
        m.register_forward_pre_hook(count(j))
    model = load_model(
        path, device="cpu", dtype="float32", progress=False, gpu_experts="auto", gpu_experts_budget=1
    )
    assert all(m.hot is None and m.routing_counts is not None for m in _experts(model))
    with torch.no_grad():
        for seed in (5, 6):
            torch.testing.assert_close(model(input_ids=_ids(seed)).logits, ref(input_ids=_ids(seed)).logits)
    for j, m in enumerate(_experts(model)):
        assert torch.equal(m.routing_counts, seen[j])
    share = sorted(
        (-float(seen[j][e]) / float(seen[j].sum()), j, e)
        for j in seen
        for e in range(len(seen[j]))
        if seen[j][e]
    )
    want: dict[int, list[int]] = {}
    for _, j, e in share[:3]:
        want.setdefault(j, []).append(e)
    one = expert_device_bytes(_experts(model)[0], torch.float32)
    place_auto(model, 3 * one + one - 1)
    got = {j: m.hot.ids.tolist() for j, m in enumerate(_experts(model)) if m.hot is not None}
    assert got == {j: sorted(ids) for j, ids in want.items()}
    assert all(m.routing_counts is None for m in _experts(model))
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=_ids(7)).logits, ref(input_ids=_ids(7)).logits, atol=TOL, rtol=TOL
        )
