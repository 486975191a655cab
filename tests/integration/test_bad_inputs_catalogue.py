"""A catalogue of bad inputs to ``moetune train``, one case per input: each raises its own ``MoetuneError``
subclass with a message naming the file or field.

Preflight cases (configs, datasets, tokenizer, config.json, weights, output_dir, lora_target, resume
checkpoints) must fail before the model loads: ``moetune.loading.load_model`` and the weight readers are
replaced by functions that fail the test if called, and nothing under the test's folders (config, data,
model, output_dir) changes. Divergence cases train the tiny model and must stop before a diverged
checkpoint or adapter is written.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from moetune.cli.main import main
from moetune.config import load_config
from moetune.errors import (
    AdapterError,
    ArchError,
    CheckpointError,
    ConfigError,
    DataError,
    DivergenceError,
    LoadError,
    OutputDirError,
)
from moetune.train import recipe
from moetune.train.demo import make_demo_model

ROOT = Path(__file__).resolve().parents[2]
ROWS = [{"instruction": "encode", "input": "b c", "output": "e f"}] * 8


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("m") / "tiny", ROOT / "examples/data/demo_tokenizer")


def config(tmp: Path, model: Path, **over) -> dict:
    data = tmp / "data.json"
    if not data.exists():
        data.write_text(json.dumps(ROWS))
    cfg = {
        "model_name_or_path": str(model),
        "dataset": str(data),
        "cutoff_len": 32,
        "lora_rank": 4,
        "lora_alpha": 8,
        "output_dir": str(tmp / "out"),
        "per_device_train_batch_size": 2,
        "max_steps": 4,
        "save_steps": 2,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "gradient_checkpointing": False,
        "report_to": "none",
        "moetune": {"device": "cpu", "num_threads": 1},
    }
    cfg.update(over)
    return {k: v for k, v in cfg.items() if v is not None}


def write(tmp: Path, cfg: dict) -> Path:
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def snapshot(*roots: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns) if p.is_file() else (-1, 0)
        for root in roots
        for p in [root, *root.rglob("*")]
        if root.exists()
    }


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if the model (or any weight) starts loading."""
    from moetune.loading import load as load_module

    def forbidden(*args, **kwargs):
        raise AssertionError("the model started loading: the bad input was not caught before it")

    monkeypatch.setattr("moetune.loading.load_model", forbidden)
    monkeypatch.setattr(load_module.hf, "load_weights", forbidden)
    monkeypatch.setattr(load_module, "stream_experts", forbidden)


def expect(tmp: Path, cfg: dict | Path, error: type, match: str, *roots: Path) -> str:
    """Load and run ``cfg``; it must raise ``error`` matching ``match`` and change nothing on disk."""
    path = cfg if isinstance(cfg, Path) else write(tmp, cfg)
    before = snapshot(tmp, *roots)
    with pytest.raises(error, match=match) as err:
        recipe.run(load_config(path), progress=False)
    assert snapshot(tmp, *roots) == before, "a failed preflight changed files on disk"
    return str(err.value)


def model_copy(tmp: Path, demo_model: Path) -> Path:
    return Path(shutil.copytree(demo_model, tmp / "model"))


# --- configs -----------------------------------------------------------------------------------------------

CONFIG_CASES = {
    "unknown_key": ({"lora_rnak": 8}, "did you mean 'lora_rank'"),
    "wrong_type": ({"learning_rate": "fast"}, "learning_rate: got 'fast'; expected a number"),
    "rank_zero": ({"lora_rank": 0}, "lora_rank: got 0; must be > 0"),
    "bad_divergence_mode": (
        {"on_divergence": "ignore"},
        "on_divergence: got 'ignore'; expected one of: stop, skip",
    ),
    "all_with_names": ({"lora_target": "all,q_proj"}, "'all' targets every linear layer"),
    "missing_dataset": ({"dataset": "/nowhere/data.json"}, "nowhere"),
    "missing_model": (
        {"model_name_or_path": "/nowhere/model"},
        "model_name_or_path: /nowhere/model does not exist",
    ),
    "template_name": ({"template": "vicuna"}, "'vicuna' is not a LLaMA-Factory template name moetune maps"),
    "eval_without_data": ({"eval_strategy": "steps"}, "there is no evaluation data"),
    "engine_key_at_top": ({"expert_format": "int8"}, "is an engine option; put it under `moetune:`"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_value(tmp_path, demo_model, no_load, case) -> None:
    over, match = CONFIG_CASES[case]
    expect(tmp_path, config(tmp_path, demo_model, **over), ConfigError, match, demo_model)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("lora_rank: [1,\n", "is not valid YAML"),
        ("lora_rank: 4\nlora_rank: 8\n", "set twice in one mapping"),
        ("- a\n- b\n", "the top level must be a mapping"),
    ],
    ids=["syntax", "duplicate_key", "top_level_list"],
)
def test_config_file(tmp_path, no_load, text, match) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    expect(tmp_path, path, ConfigError, match)


# --- datasets ----------------------------------------------------------------------------------------------


def _dataset(tmp: Path, name: str, content: bytes) -> Path:
    path = tmp / name
    path.write_bytes(content)
    return path


DATA_CASES = {
    "empty": ("empty.json", b"[]", "has no rows"),
    "missing_field": (
        "rows.json",
        json.dumps([*ROWS, {"instruction": "x"}]).encode(),
        "row 8: field 'output'",
    ),
    "not_json": ("broken.json", b'[{"instruction": "x", ', "cannot read"),
    "latin1_jsonl": (
        "latin1.jsonl",
        b'{"instruction": "a", "input": "", "output": "b"}\n{"instruction": "caf\xe9", "input": "", "output": "b"}\n',
        r"latin1.jsonl is not UTF-8 text: line 2 .*b'\\xe9'",
    ),
    "latin1_csv": (
        "latin1.csv",
        b"instruction,input,output\na,,b\nna\xefve,,b\n",
        "latin1.csv is not UTF-8 text: line 3",
    ),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_dataset(tmp_path, demo_model, no_load, case) -> None:
    name, content, match = DATA_CASES[case]
    cfg = config(tmp_path, demo_model, dataset=str(_dataset(tmp_path, name, content)))
    expect(tmp_path, cfg, DataError, match, demo_model)


def test_cutoff_len_too_small(tmp_path, demo_model, no_load) -> None:
    expect(
        tmp_path,
        config(tmp_path, demo_model, cutoff_len=2),
        DataError,
        "cutoff_len 2 leaves no trained token",
    )


# --- the model folder: config.json, weights, tokenizer -----------------------------------------------------


def _edit_config(model: Path, edit) -> None:
    path = model / "config.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


MODEL_CASES = {
    "config_not_json": (
        lambda m: (m / "config.json").write_text('{"model_type": '),
        LoadError,
        "config.json is not valid JSON",
    ),
    "config_a_list": (
        lambda m: (m / "config.json").write_text("[1, 2]"),
        LoadError,
        "config.json holds a JSON list",
    ),
    "config_field_type": (
        lambda m: _edit_config(m, lambda c: {**c, "hidden_size": "sixty-four"}),
        LoadError,
        "config.json as a 'qwen3_moe' config: .*hidden_size",
    ),
    "config_no_model_type": (
        lambda m: _edit_config(m, lambda c: {k: v for k, v in c.items() if k != "model_type"}),
        LoadError,
        "config.json has no model_type",
    ),
    "config_unknown_model_type": (
        lambda m: _edit_config(m, lambda c: {**c, "model_type": "qwen9_moe"}),
        ArchError,
        "model_type 'qwen9_moe'",
    ),
    "config_shape_mismatch": (
        lambda m: _edit_config(m, lambda c: {**c, "hidden_size": 32}),
        LoadError,
        r"(?s)problem\(s\) with the routed-expert tensors:.*shape \(64, 24\), expected \(32, 24\)",
    ),
    "weights_truncated": (
        lambda m: (m / "model.safetensors").write_bytes((m / "model.safetensors").read_bytes()[:-1000]),
        LoadError,
        "model.safetensors is truncated",
    ),
    "weights_header_garbage": (
        lambda m: (m / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}"),
        LoadError,
        "header length .* exceeds the file",
    ),
    "int32_q_proj": (
        lambda m: _retype(m / "model.safetensors", "q_proj", torch.int32),
        LoadError,
        r"(?s)stored as integers.*q_proj.weight is stored as I32",
    ),
    "no_tokenizer_files": (
        lambda m: [(m / f).unlink() for f in ("tokenizer.json", "tokenizer_config.json")],
        LoadError,
        "has no tokenizer files",
    ),
    "tokenizer_json_damaged": (
        lambda m: (m / "tokenizer.json").write_text('{"version": '),
        LoadError,
        "cannot build the tokenizer from .*damaged",
    ),
}


def _retype(path: Path, name: str, dtype: torch.dtype) -> None:
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if name in k)
    tensors[key] = (tensors[key] * 100).to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_model_folder(tmp_path, demo_model, no_load, case) -> None:
    damage, error, match = MODEL_CASES[case]
    model = model_copy(tmp_path, demo_model)
    damage(model)
    expect(tmp_path, config(tmp_path, model), error, match)


def test_router_lora_with_dropout(tmp_path, demo_model, no_load) -> None:
    """LoRA on Qwen3-MoE's routers (transformers' TopKRouter, through PEFT's target_parameters) with dropout: PEFT
    refuses it, and so does moetune, before the load (it used to be said once the experts had loaded)."""
    cfg = config(tmp_path, demo_model, lora_target="q_proj,gate", lora_dropout=0.1)
    expect(
        tmp_path, cfg, AdapterError, r"lora_dropout: 0.1 with the routers .*set lora_dropout: 0", demo_model
    )


# --- output_dir ----------------------------------------------------------------------------------------------


def test_kernels_switch_value(tmp_path, demo_model, no_load, monkeypatch) -> None:
    """A MOETUNE_KERNELS value other than on/off/1/0 is refused before the load (engines read it mid-load)."""
    monkeypatch.setenv("MOETUNE_KERNELS", "fast")
    msg = expect(tmp_path, config(tmp_path, demo_model), ConfigError, "MOETUNE_KERNELS must be", demo_model)
    assert "'fast'" in msg


def test_output_dir_parent_is_a_file(tmp_path, demo_model, no_load) -> None:
    (tmp_path / "taken").write_text("a file")
    cfg = config(tmp_path, demo_model, output_dir=str(tmp_path / "taken" / "run"))
    expect(tmp_path, cfg, OutputDirError, "taken is a file, not a folder", demo_model)


def test_output_dir_not_writable(tmp_path, demo_model, no_load) -> None:
    """/sys refuses new files even to root (a chmod would not stop root, who runs the CI)."""
    cfg = config(tmp_path, demo_model, output_dir="/sys/moetune-run")
    expect(tmp_path, cfg, OutputDirError, r"cannot write in /sys \(Permission denied\)", demo_model)


def test_output_dir_is_a_file(tmp_path, demo_model, no_load) -> None:
    (tmp_path / "out").write_text("a file")
    expect(tmp_path, config(tmp_path, demo_model), ConfigError, "exists and is not a folder", demo_model)


# --- lora_target -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", ["q_prj", "q_proj,experst", "lm_heads"])
def test_lora_target_typo(tmp_path, demo_model, no_load, targets) -> None:
    bad = targets.split(",")[-1]
    msg = expect(tmp_path, config(tmp_path, demo_model, lora_target=targets), AdapterError, bad, demo_model)
    assert "matched no module of Qwen3MoeForCausalLM" in msg and "q_proj" in msg and "experts" in msg


# --- resume checkpoints ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory, demo_model) -> Path:
    """A finished 4-step run with checkpoint-2 and checkpoint-4 (the config of ``config``)."""
    tmp = tmp_path_factory.mktemp("run")
    recipe.run(load_config(write(tmp, config(tmp, demo_model))), progress=False)
    return tmp / "out"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _poison(path: Path) -> None:
    """One NaN in the first lora_A tensor (the file stays a valid safetensors file of the same size)."""
    tensors = load_file(path)
    key = next(k for k in sorted(tensors) if "lora_A" in k)
    tensors[key].view(-1)[0] = math.nan
    save_file(tensors, path, metadata={"format": "pt"})


RESUME_CASES = {
    "optimizer_truncated": (
        lambda c: _truncate(c / "optimizer.pt"),
        {},
        "optimizer.pt is damaged or truncated",
    ),
    "scheduler_truncated": (
        lambda c: _truncate(c / "scheduler.pt"),
        {},
        "scheduler.pt is damaged or truncated",
    ),
    "rng_truncated": (lambda c: _truncate(c / "rng_state.pth"), {}, "rng_state.pth is damaged or truncated"),
    "training_args_truncated": (
        lambda c: _truncate(c / "training_args.bin"),
        {},
        "training_args.bin is damaged",
    ),
    "adapter_truncated": (
        lambda c: _truncate(c / "adapter_model.safetensors"),
        {},
        "adapter_model.safetensors is damaged or truncated",
    ),
    "adapter_nan": (
        lambda c: _poison(c / "adapter_model.safetensors"),
        {},
        r"adapter_model.safetensors: tensor .*lora_A.weight holds 1 NaN",
    ),
    "adapter_missing": (
        lambda c: (c / "adapter_model.safetensors").unlink(),
        {},
        "adapter_model.safetensors is missing",
    ),
    "state_not_json": (
        lambda c: (c / "trainer_state.json").write_text("{"),
        {},
        "trainer_state.json is damaged or truncated",
    ),
    "state_without_step": (
        lambda c: (c / "trainer_state.json").write_text("{}"),
        {},
        "trainer_state.json has no global_step",
    ),
    "adapter_config_not_json": (
        lambda c: (c / "adapter_config.json").write_text("r: 4"),
        {},
        "adapter_config.json is damaged",
    ),
    "rank_changed": (
        lambda c: None,
        {"lora_rank": 8, "lora_alpha": 8},
        "trained with lora_rank 4; this config has lora_rank 8",
    ),
    "alpha_changed": (
        lambda c: None,
        {"lora_alpha": 16},
        "trained with lora_alpha 8.0; this config has lora_alpha 16",
    ),
    "rslora_changed": (lambda c: None, {"use_rslora": True}, "trained with use_rslora False"),
    "targets_changed": (
        lambda c: None,
        {"lora_target": "q_proj,v_proj,experts"},
        r"other modules than this config's lora_target .*only in the checkpoint: down_proj, gate_proj, k_proj",
    ),
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_from_damaged_checkpoint(tmp_path, demo_model, trained, no_load, case) -> None:
    damage, over, match = RESUME_CASES[case]
    out = Path(shutil.copytree(trained, tmp_path / "out"))
    damage(out / "checkpoint-4")
    cfg = config(tmp_path, demo_model, resume_from_checkpoint=str(out / "checkpoint-4"), max_steps=6, **over)
    msg = expect(tmp_path, cfg, CheckpointError, match, demo_model)
    if not over:  # a damaged file: the previous checkpoint is complete and offered
        assert f"The previous complete checkpoint is {out / 'checkpoint-2'}" in msg
    else:  # a changed setting: the other checkpoint has it too
        assert "No other checkpoint beside it passes these checks" in msg


def test_resume_true_picks_the_newest_and_offers_the_previous(tmp_path, demo_model, trained, no_load) -> None:
    out = Path(shutil.copytree(trained, tmp_path / "out"))
    _truncate(out / "checkpoint-4" / "optimizer.pt")
    cfg = config(tmp_path, demo_model, resume_from_checkpoint=True, max_steps=6)
    msg = expect(tmp_path, cfg, CheckpointError, "checkpoint-4 cannot be resumed", demo_model)
    assert f"set resume_from_checkpoint: {out / 'checkpoint-2'}" in msg


@pytest.mark.parametrize("over", [{"max_steps": 4}, {"max_steps": 3}])
def test_resume_of_a_finished_run_is_refused(tmp_path, demo_model, trained, no_load, over) -> None:
    """transformers would train one step past the end (it tests for the last step only after a step)."""
    out = Path(shutil.copytree(trained, tmp_path / "out"))
    cfg = config(tmp_path, demo_model, resume_from_checkpoint=str(out / "checkpoint-4"), **over)
    expect(
        tmp_path,
        cfg,
        CheckpointError,
        f"is at step 4, which already reaches max_steps {over['max_steps']}",
        demo_model,
    )


def test_the_guard_catches_a_model_load(tmp_path, demo_model, trained, no_load) -> None:
    """A valid config, and a resume from an intact checkpoint, do reach the load: the cases above stopped before."""
    out = Path(shutil.copytree(trained, tmp_path / "out"))
    cfg = config(tmp_path, demo_model, resume_from_checkpoint=str(out / "checkpoint-4"), max_steps=6)
    with pytest.raises(AssertionError, match="the model started loading"):
        recipe.run(load_config(write(tmp_path, cfg)), progress=False)


# --- divergence: training stops before a diverged checkpoint or adapter is written ---------------------------


def _assert_nothing_diverged_saved(out: Path, last_good: str | None) -> None:
    assert not (out / "adapter_model.safetensors").exists() and not (out / "run_summary.json").exists()
    saved = sorted(p.name for p in out.glob("checkpoint-*")) if out.exists() else []
    assert saved == ([last_good] if last_good else [])
    for ckpt in out.glob("checkpoint-*"):
        assert all(torch.isfinite(t).all() for t in load_file(ckpt / "adapter_model.safetensors").values())


def _model_with_nan(tmp_path: Path, demo_model: Path, part: str) -> tuple[Path, str]:
    """A copy of the demo model whose first tensor with ``part`` in its name holds a NaN; (folder, that key)."""
    model = model_copy(tmp_path, demo_model)
    tensors = load_file(model / "model.safetensors")
    key = next(k for k in sorted(tensors) if part in k)
    tensors[key].view(-1)[0] = math.nan
    save_file(tensors, model / "model.safetensors", metadata={"format": "pt"})
    return model, key


def test_nan_in_an_expert_weight_is_refused_at_load(tmp_path, demo_model, capsys) -> None:
    model, key = _model_with_nan(tmp_path, demo_model, ".experts.")
    assert main(["train", str(write(tmp_path, config(tmp_path, model)))]) == 2  # exit code != 0
    err = capsys.readouterr().err
    assert key in err and "NaN" in err  # the expert scan names the tensor as it streams
    _assert_nothing_diverged_saved(tmp_path / "out", None)


def test_nan_in_an_attention_weight_stops_at_step_1(tmp_path, demo_model, capsys) -> None:
    model, _ = _model_with_nan(tmp_path, demo_model, ".q_proj.")
    assert main(["train", str(write(tmp_path, config(tmp_path, model)))]) == 2  # exit code != 0
    err = capsys.readouterr().err
    # whether the NaN reaches the loss depends on the CPU's attention kernel and compute dtype (finite on AVX512-BF16
    # in bf16, NaN on an AVX2-only CPU in fp32); either way step 1 stops and names the non-finite gradients
    assert re.search(r"training diverged at step 1: the (gradient norm|loss) is not finite", err)
    assert "self_attn.q_proj.lora_A" in err and "No checkpoint from before step 1 is in" in err
    _assert_nothing_diverged_saved(tmp_path / "out", None)


def test_an_exploding_learning_rate_collapse_stops(tmp_path, demo_model) -> None:
    """lr 1e4: after two updates the model predicts a uniform distribution, loss ln(17), gradients exactly 0."""
    cfg = config(tmp_path, demo_model, learning_rate=1e4, max_steps=20, save_steps=1)
    with pytest.raises(DivergenceError, match="collapsed to a uniform guess") as err:
        recipe.run(load_config(write(tmp_path, cfg)), progress=False)
    assert f"ln(vocab_size) = {math.log(17):.4f}" in str(err.value)
    good = [line for line in str(err.value).splitlines() if "Last good checkpoint" in line]
    assert good and "checkpoint-1 " in good[0]  # the collapse began in the update of step 2
    # checkpoint-2 was written from that update before any step could see it, and is named as such; the saves
    # due while the gradient norm sat at 0.0 were held back (they had rotated the good checkpoints away)
    assert "checkpoint-2 holds weights from the diverged update: do not resume from it" in good[0]
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "out").glob("checkpoint-*"))
    assert saved == [1, 2], saved


def _inject_inf_at_call(peft_model, call: int, where: str) -> None:
    """An inf in the logits of forward call ``call`` (loss inf), or in the gradient flowing into lm_head (loss
    finite, gradient norm inf)."""
    calls = []

    def inject(module, args, out):
        calls.append(1)
        if len(calls) != call:
            return None
        if where == "loss":
            return out * math.inf
        out.register_hook(lambda g: g * math.inf)
        return None

    peft_model.get_base_model().lm_head.register_forward_hook(inject)


@pytest.mark.parametrize("where", ["loss", "gradient"])
def test_an_injected_inf_stops_before_the_update(tmp_path, demo_model, where) -> None:
    cfg = load_config(write(tmp_path, config(tmp_path, demo_model)))
    peft_model, tokenizer, data = recipe.setup(cfg, progress=False)
    _inject_inf_at_call(peft_model, 3, where)
    with pytest.raises(DivergenceError, match=f"diverged at step 3: the {where}") as err:
        recipe.train(cfg, peft_model, tokenizer, data)
    assert f"Last good checkpoint: {tmp_path / 'out/checkpoint-2'}" in str(err.value)
    _assert_nothing_diverged_saved(tmp_path / "out", "checkpoint-2")


def test_skip_mode_through_the_recipe_logs_the_loss_unfiltered(tmp_path, demo_model) -> None:
    """on_divergence: skip: the run finishes, the skipped step is in run_summary.json and in the log, every
    logged loss is finite (one NaN in the Trainer's running sum would make all later ones NaN), and the adapter
    is finite."""
    cfg = load_config(write(tmp_path, config(tmp_path, demo_model, on_divergence="skip")))
    peft_model, tokenizer, data = recipe.setup(cfg, progress=False)
    _inject_inf_at_call(peft_model, 3, "loss")
    trainer = recipe.train(cfg, peft_model, tokenizer, data)
    summary = recipe.save(cfg, trainer, tokenizer, 0.0)
    assert summary["skipped_steps"] == [3] and summary["steps"] == 4
    logs = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert logs[3]["skipped_steps"] == 1 and math.isnan(logs[3]["loss"])  # no finite loss in that window
    assert all(math.isfinite(logs[s]["loss"]) and "skipped_steps" not in logs[s] for s in (1, 2, 4))
    assert summary["final_train_loss"] == logs[4]["loss"] != 0.0  # the last logged loss, never a filtered 0.0
    adapter = load_file(tmp_path / "out" / "adapter_model.safetensors")
    assert all(torch.isfinite(t).all() for t in adapter.values())
