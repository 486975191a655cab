"""Training end to end on a tiny Qwen3-MoE: stock-PEFT adapter equivalence, exact resume, atomic checkpoints,
checkpointing reuse."""

from __future__ import annotations

import json
import os
from pathlib import Path

import peft
import pytest
import torch
import yaml
from packaging.version import Version

from moetune.config import load_config
from moetune.train.demo import make_demo_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("m") / "tiny", ROOT / "examples/data/demo_tokenizer")


def _config(tmp: Path, model: Path, **over) -> Path:
    cfg = {
        "model_name_or_path": str(model),
        "lora_rank": 4,
        "lora_alpha": 8,
        "lora_target": "all",
        "dataset": "demo_train",
        "dataset_dir": str(ROOT / "examples/data"),
        "max_samples": 64,
        "cutoff_len": 32,
        "output_dir": str(tmp / "out"),
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "max_steps": 4,
        "logging_steps": 1,
        "save_steps": 2,
        "seed": 0,
        "gradient_checkpointing": False,
        "report_to": "none",
        "moetune": {"device": "cpu", "num_threads": 1},
        **over,
    }
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(out: Path) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def test_adapter_loads_in_stock_peft_and_moetune(tmp_path, demo_model) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moetune.adapters.load import load_model
    from moetune.train.recipe import run

    result = run(load_config(_config(tmp_path, demo_model)), progress=False)
    out = tmp_path / "out"
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "trainer_state.json",
        "run_summary.json",
        "loss_curve.png",
        "checkpoint-2/adapter_model.safetensors",
        "checkpoint-2/optimizer.pt",
    ):
        assert (out / name).is_file(), name
    conf = json.loads((out / "adapter_config.json").read_text())
    # the experts by their fused parameters, last; the dense MLP of layer 1 by weight where PEFT (0.21) renames
    # gate/up/down_proj targets for qwen3_moe, else by name with its parent (PEFT 0.22 would map a bare name onto
    # the experts too)
    dense = ["down_proj", "gate_proj", "up_proj"]
    assert conf["target_parameters"][-2:] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    by_weight = conf["target_parameters"][:-2]
    by_name = [t for t in conf["target_modules"] if t.startswith("mlp.")]
    if Version(peft.__version__) < Version("0.22"):
        assert (by_weight, by_name) == ([f"{p}.weight" for p in dense], [])
    else:
        assert (by_weight, by_name) == ([], [f"mlp.{p}" for p in dense])
    ids = torch.randint(4, 17, (2, 10))
    model = result.model.eval()
    want = model(input_ids=ids).logits
    # trained expert LoRA (down_proj's B, PEFT's key for it) moved away from its init (B = 0)
    assert any(
        n.endswith("mlp.experts.lora_B.default.weight") and p.abs().max() > 0
        for n, p in model.named_parameters()
    )
    stock = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32), out
    )
    torch.testing.assert_close(stock.eval()(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    for p in dense:  # stock PEFT put the LoRA on the dense MLP
        assert "default" in stock.get_submodule(f"base_model.model.model.layers.1.mlp.{p}").lora_A
    again = load_model(demo_model, device="cpu", dtype="float32", progress=False, adapter=out)
    torch.testing.assert_close(again(input_ids=ids).logits, want, atol=1e-6, rtol=0)


def test_resume_matches_uninterrupted_run(tmp_path, demo_model) -> None:
    from moetune.train.recipe import run

    full = tmp_path / "full"
    full.mkdir()
    run(load_config(_config(full, demo_model, max_steps=6, save_steps=3)), progress=False)
    want = _losses(full / "out")
    part = tmp_path / "part"
    part.mkdir()
    cfg = _config(part, demo_model, max_steps=6, save_steps=3)
    run(load_config(cfg), progress=False)
    ckpt = part / "out" / "checkpoint-3"
    resumed = _config(
        part,
        demo_model,
        max_steps=6,
        save_steps=3,
        resume_from_checkpoint=str(ckpt),
        output_dir=str(part / "out2"),
    )
    run(load_config(resumed), progress=False)
    got = _losses(part / "out2")
    assert len(want) == 6 and len(got) == 6  # the resumed state carries the first 3 logs over
    assert got[3:] == pytest.approx(want[3:], abs=1e-6)


def test_gradient_checkpointing_runs_each_expert_forward_once(demo_model) -> None:
    from moetune.adapters.apply import attach_lora, expert_modules
    from moetune.adapters.load import load_model

    def grads(checkpointing: bool):
        model = load_model(demo_model, device="cpu", dtype="float32", progress=False)
        torch.manual_seed(0)
        peft = attach_lora(model, rank=4, alpha=8, dropout=0.1)
        if checkpointing:
            peft.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        peft.train()
        experts = list(expert_modules(peft).values())
        before = [e.experts.engine._forwards for e in experts]
        torch.manual_seed(1)
        ids = torch.randint(4, 17, (2, 12))
        peft(input_ids=ids, labels=ids).loss.backward()
        counts = [e.experts.engine._forwards - b for e, b in zip(experts, before)]
        return counts, [p.grad.clone() for n, p in peft.named_parameters() if p.requires_grad]

    counts, with_ckpt = grads(True)
    assert counts == [1] * len(counts)  # the recompute reused the first forward
    _, without = grads(False)
    for a, b in zip(with_ckpt, without):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_checkpoint_appears_only_when_complete_and_resume_skips_a_failed_one(
    tmp_path, demo_model, monkeypatch
) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    from moetune.train.recipe import run
    from moetune.train.trainer import MoetuneTrainer

    out = tmp_path / "out"
    seen: dict = {}
    save_rng_state = MoetuneTrainer._save_rng_state

    def fail_at_step_4(self, output_dir: str) -> None:  # after adapter, optimizer and scheduler are written
        if self.state.global_step == 4:
            seen["visible"] = sorted(p.name for p in out.iterdir())
            seen["staged"] = sorted(os.listdir(output_dir))
            seen["losses"] = [h["loss"] for h in self.state.log_history if "loss" in h]
            raise OSError("disk full (injected)")
        save_rng_state(self, output_dir)

    monkeypatch.setattr(MoetuneTrainer, "_save_rng_state", fail_at_step_4)
    with pytest.raises(OSError, match="injected"):
        run(load_config(_config(tmp_path, demo_model, save_total_limit=1)), progress=False)
    # mid-save, the half-written checkpoint sat in the staging folder, not under its final name
    assert "checkpoint-4" not in seen["visible"] and "tmp-checkpoint-4" in seen["visible"]
    assert {"adapter_model.safetensors", "optimizer.pt"} <= set(seen["staged"])
    # the failed save left nothing behind (besides it: trainer_log.jsonl, appended at each log)
    assert sorted(p.name for p in out.iterdir() if p.name != "trainer_log.jsonl") == ["checkpoint-2"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")

    monkeypatch.undo()
    resumed = _config(tmp_path, demo_model, save_total_limit=1, resume_from_checkpoint=True)
    run(load_config(resumed), progress=False)
    assert (out / "checkpoint-4" / "trainer_state.json").is_file()
    # checkpoint-2 rotated away (save_total_limit 1), nothing staged left
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-4"]
    assert len(seen["losses"]) == 4  # the failed run trained and logged all 4 steps before its last save
    assert _losses(out)[2:] == pytest.approx(seen["losses"][2:], abs=1e-6)


def test_plot_loss_false_writes_no_loss_curve(tmp_path, demo_model) -> None:
    from moetune.train.recipe import run

    run(
        load_config(_config(tmp_path, demo_model, max_steps=1, save_steps=10, plot_loss=False)),
        progress=False,
    )
    out = tmp_path / "out"
    assert (out / "adapter_model.safetensors").is_file() and not (out / "loss_curve.png").exists()
    assert json.loads((out / "run_summary.json").read_text())["loss_curve"] is None


def test_the_output_tokenizer_carries_the_template_trained_with(tmp_path, demo_model) -> None:
    """A run with its own template and default_system saves them in the output's tokenizer: generate and chat
    (``moetune.train.generation.render``) then prompt as training rendered; the model's tokenizer and the one
    in hand are unchanged."""
    from transformers import AutoTokenizer

    from moetune.train.generation import render
    from moetune.train.recipe import run

    template = (ROOT / "examples/data/demo_tokenizer/chat_template.jinja").read_text()
    (tmp_path / "mine.jinja").write_text("[run] " + template)
    cfg = _config(tmp_path, demo_model, max_steps=1, save_steps=10, template=str(tmp_path / "mine.jinja"))
    cfg.write_text(cfg.read_text() + "default_system: be brief\n")
    trained = run(load_config(cfg), progress=False)
    own = AutoTokenizer.from_pretrained(demo_model)
    saved = AutoTokenizer.from_pretrained(tmp_path / "out")
    user = [{"role": "user", "content": "encode a b"}]
    want = own.apply_chat_template(
        [{"role": "system", "content": "be brief"}, *user],
        chat_template="[run] " + template,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert render(saved, user) == want and want.startswith("[run] ") and "be brief" in want
    assert render(own, user) == render(trained.tokenizer, user) != want


def _a8_or_why(fmt: str) -> str:
    """Why a bf16 load of ``fmt`` experts on this CPU refuses int8_activations (the engine's own check), or ""."""
    from moetune.engine.gemm import int8_rows_problem
    from moetune.engine.plan import resolve_compute_dtype
    from moetune.sysinfo import cpu_info

    return int8_rows_problem(fmt, resolve_compute_dtype(torch.int8), tuple(cpu_info().isa))


@pytest.mark.parametrize(
    "fmt",
    [
        pytest.param(f, marks=pytest.mark.skipif(bool(_a8_or_why(f)), reason=_a8_or_why(f)))
        for f in ("int8", "int4")
    ],
)
def test_int8_activations_train_save_and_reload(tmp_path, demo_model, fmt) -> None:
    """``moetune: {expert_format: int8 (or int4), int8_activations: true}`` in bf16: the engines take the 8-bit rows
    (int4 on an AVX2-only CPU: the AVX2 variant's, in fp32), the losses stay within 5% of the same format's default
    run (int8: 16-bit rows, int4: bf16 or fp32), the adapter loads in stock PEFT, and ``load_model`` with the same
    options runs it, its logits the trained model's."""
    import math

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moetune.adapters.load import load_model
    from moetune.layer import CpuExperts
    from moetune.train.recipe import run

    if fmt == "int4":  # the demo's experts (I = 24) with I = 32: int4 groups of 32 divide H and I
        demo_model = make_demo_model(
            tmp_path / "i32", ROOT / "examples/data/demo_tokenizer", moe_intermediate_size=32
        )
    results = {}
    for a8 in (False, True):
        (tmp_path / str(a8)).mkdir()
        engine = {"device": "cpu", "num_threads": 1, "expert_format": fmt, "int8_activations": a8}
        if fmt == "int4":
            engine["int4_group_size"] = 32
        cfg = _config(tmp_path / str(a8), demo_model, save_steps=10, bf16=True, moetune=engine)
        results[a8] = run(load_config(cfg), progress=False)
    want, got = _losses(tmp_path / "False" / "out"), _losses(tmp_path / "True" / "out")
    assert len(got) == len(want) == 4 and all(math.isfinite(v) for v in got)
    assert got == pytest.approx(want, rel=0.05)
    assert got != want  # the rounding is really taken
    model = results[True].model.eval()
    paths = [m.engine.gemm.path for m in model.modules() if isinstance(m, CpuExperts)]
    assert paths and all(p.int8_rows for p in paths)
    out = tmp_path / "True" / "out"
    ids = torch.randint(4, 17, (2, 10))
    # bf16 training wraps the model's forward in accelerate's autocast (LoRA's fp32 products in bf16 there); the
    # run hands the model back without it, as the reloaded model runs: bf16 roundings of the LoRA products apart
    # can flip a token's experts (0.2 of 2.9 in one logit under PEFT 0.22's LoRA init order)
    assert "_original_forward" not in model.__dict__ and model.forward.__func__ is type(model).forward
    with torch.no_grad():
        trained = model(input_ids=ids).logits.float()
        stock = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32), out
        )
        assert stock(input_ids=ids).logits.isfinite().all()
        again = load_model(
            demo_model,
            device="cpu",
            dtype="bfloat16",
            progress=False,
            adapter=out,
            expert_format=fmt,
            int8_activations=True,
            **({"int4_group_size": 32} if fmt == "int4" else {}),
        )
        assert all(m.engine.gemm.path.int8_rows for m in again.modules() if isinstance(m, CpuExperts))
        reloaded = again(input_ids=ids).logits.float()
    torch.testing.assert_close(reloaded, trained, atol=1e-6 * float(trained.abs().max()), rtol=0)


def test_load_best_model_at_end_is_said_in_the_summary(tmp_path, demo_model) -> None:
    """``load_best_model_at_end``: the output's adapter is the best checkpoint's (experts' LoRA included), and the
    summary names that checkpoint and its metric beside the last evaluation's loss (``final_eval_loss``). The
    "best" is the highest eval loss (``greater_is_better``), so that it is an early checkpoint while training
    lowers the loss."""
    from safetensors.torch import load_file

    from moetune.train.recipe import run

    over = {
        "val_size": 8,
        "eval_strategy": "steps",
        "eval_steps": 1,
        "save_steps": 1,
        "load_best_model_at_end": True,
        "metric_for_best_model": "eval_loss",
        "greater_is_better": True,
    }
    result = run(load_config(_config(tmp_path, demo_model, **over)), progress=False)
    out = tmp_path / "out"
    evals = [(h["step"], h["eval_loss"]) for h in result.trainer.state.log_history if "eval_loss" in h]
    step, best = max(evals, key=lambda e: e[1])
    assert len(evals) == 4 and step < evals[-1][0], evals  # the output is not simply the last step's
    summary = json.loads((out / "run_summary.json").read_text())
    assert (
        summary["best_metric"] == pytest.approx(best, rel=1e-6) and summary["final_eval_loss"] == evals[-1][1]
    )
    assert Path(summary["best_model_checkpoint"]).name == f"checkpoint-{step}"
    saved, kept, last = (
        load_file(str(d / "adapter_model.safetensors"))
        for d in (out, out / f"checkpoint-{step}", out / "checkpoint-4")
    )
    assert saved.keys() == kept.keys() and any(".experts." in k for k in saved)
    assert all(torch.equal(saved[k], kept[k]) for k in saved)
    assert not all(torch.equal(saved[k], last[k]) for k in saved)


def test_do_eval_evaluates_after_training(tmp_path, demo_model) -> None:
    """``do_train: true`` with ``do_eval: true`` and ``val_size``, as LLaMA-Factory's examples write it: one
    evaluation after the last step (no evaluation during training: eval_strategy no), in eval_results.json, the log
    and the summary; its loss is the trained model's on the held-out rows."""
    from moetune.train.recipe import run

    over = {"do_train": True, "do_eval": True, "val_size": 8}
    result = run(load_config(_config(tmp_path, demo_model, **over)), progress=False)
    out = tmp_path / "out"
    evals = [h for h in result.trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 1 and evals[0]["step"] == 4
    saved = json.loads((out / "eval_results.json").read_text())
    assert saved["eval_loss"] == evals[0]["eval_loss"] == result.summary["final_eval_loss"]
    again = result.trainer.evaluate()["eval_loss"]  # the model as handed back, on the same rows
    assert again == pytest.approx(saved["eval_loss"], rel=1e-5)


def test_gpu_experts_train_like_all_cpu(tmp_path, demo_model) -> None:
    """``moetune: {gpu_experts: 2}`` (device cpu standing in): the same losses and adapter as the all-CPU run, and
    the summary's memory report counts the device copies."""
    from safetensors.torch import load_file

    from moetune.train.recipe import run

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain = run(load_config(_config(tmp_path / "a", demo_model, save_steps=10)), progress=False)
    engine = {"device": "cpu", "num_threads": 1, "gpu_experts": 2}
    hot = run(load_config(_config(tmp_path / "b", demo_model, save_steps=10, moetune=engine)), progress=False)
    want, got = _losses(tmp_path / "a" / "out"), _losses(tmp_path / "b" / "out")
    assert len(got) == len(want) == 4
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)
    a = load_file(tmp_path / "a" / "out" / "adapter_model.safetensors")
    b = load_file(tmp_path / "b" / "out" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], atol=1e-4, rtol=1e-3, msg=key)
    assert (
        hot.summary["memory"]["hot_experts_device_gb"] > 0 == plain.summary["memory"]["hot_experts_device_gb"]
    )


def test_gpu_experts_auto_places_after_warmup(tmp_path, demo_model) -> None:
    """``gpu_experts: auto``: after ``gpu_experts_warmup`` steps the most-routed experts move to the device within
    the budget; the losses stay those of the all-CPU run."""
    from moetune.layer import CpuExperts
    from moetune.train.recipe import run

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    run(load_config(_config(tmp_path / "a", demo_model, save_steps=10)), progress=False)
    engine = {"device": "cpu", "num_threads": 1, "gpu_experts": "auto", "gpu_experts_budget": "1MB"}
    engine["gpu_experts_warmup"] = 2
    hot = run(load_config(_config(tmp_path / "b", demo_model, save_steps=10, moetune=engine)), progress=False)
    assert _losses(tmp_path / "b" / "out") == pytest.approx(
        _losses(tmp_path / "a" / "out"), rel=1e-4, abs=1e-5
    )
    placed = [m for m in hot.model.modules() if isinstance(m, CpuExperts) and m.hot is not None]
    assert placed and 0 < hot.summary["memory"]["hot_experts_device_gb"] * 2**30 <= 10**6


def test_start_up_builds_the_meta_model_once(tmp_path, demo_model, monkeypatch) -> None:
    """``moetune train``'s preflight plans the load on a meta-device model and ``load_model`` fills that same model;
    ``moetune.load_model(adapter=)`` checks the adapter against the model it then loads (each built twice before).
    The resulting model trains: the plan handed over is the one used."""
    import moetune
    from moetune.adapters import save_adapter
    from moetune.loading import hf
    from moetune.train import recipe

    built = []
    empty_model = hf.empty_model
    monkeypatch.setattr(hf, "empty_model", lambda *a, **k: built.append(1) or empty_model(*a, **k))
    cfg = load_config(_config(tmp_path, demo_model, lora_target="q_proj,experts"))
    peft_model, _, _ = recipe.setup(cfg, progress=False)
    assert len(built) == 1
    save_adapter(peft_model, tmp_path / "a")
    built.clear()
    again = moetune.load_model(
        demo_model, device="cpu", dtype="float32", adapter=tmp_path / "a", progress=False
    )
    assert len(built) == 1
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(again(input_ids=ids).logits, peft_model.eval()(input_ids=ids).logits)


def test_start_up_removes_what_killed_saves_left(tmp_path, demo_model) -> None:
    """A kill during a checkpoint save, a full model save or an adapter save leaves staging folders in output_dir;
    the next ``moetune train`` removes them at start (a checkpoint moved aside is restored) and keeps the rest."""
    from moetune.train import recipe

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    leftovers = (
        "tmp-checkpoint-3/checkpoint-3",
        "tmp-checkpoint-4/replaced",
        ".model.tmp-x1",
        ".moetune-adapter.partial",
    )
    for leftover in leftovers:
        (out / leftover).mkdir(parents=True)
        (out / leftover / "adapter_model.safetensors").write_text("partial")
    recipe.setup(load_config(_config(tmp_path, demo_model)), progress=False)
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == [
        "checkpoint-4",  # moved aside by a replacement the kill interrupted: restored
        "checkpoint-4/adapter_model.safetensors",
        "notes.txt",
    ]
