"""Every LLaMA-Factory-form example (examples/lf_*.yaml: LoRA SFT for Qwen3 and Llama-3, the DeepSpeed variant,
the KTransformers configs for Qwen3-MoE, Qwen3.5-MoE, DeepSeek-V2 and DeepSeek-V3 bf16/int8, full SFT, DPO,
the KTransformers DeepSeek DPO, KTO and pre-training) trains through `moetune train` as shipped except for the
model path, output directory and sizes, on a tiny model of its family whose tokenizer speaks the family's chat
format (Qwen's as a Qwen3-style hybrid reasoning template that rewrites history; Llama 3's and DeepSeek's
without a chat template, so moetune's built-in format for the name renders them).

Each run is checked for what LLaMA-Factory users rely on: no GPU needed although the examples set `bf16: true`,
every TrainingArguments key of the YAML on the Trainer's own `args`, LLaMA-Factory's outputs
(trainer_log.jsonl, the loss curve) even when `logging_steps` exceeds the run, one logged line per KTransformers
or DeepSpeed key with no effect here, and no PEFT "modify a model with PEFT for a second time" warning.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from moetune.cli.main import main
from moetune.train.demo import make_demo_model
from tests.unit.train.test_named_templates import HYBRID

# moetune attaches LoRA without PEFT's get_peft_model on a model that has tuner layers: no such warning, ever
pytestmark = pytest.mark.filterwarnings("error:You are trying to modify a model with PEFT")

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = (
    ROOT / "examples/data/demo_tokenizer"
)  # ids 0-16: with the added markers they fit every tiny vocab
LF_LOG_FIELDS = {
    "current_steps",
    "total_steps",
    "loss",
    "lr",
    "epoch",
    "percentage",
    "elapsed_time",
    "remaining_time",
}
STEPS = 2


@dataclass(frozen=True)
class Tiny:
    """A tiny checkpoint: its family and its tokenizer's chat format (markers added as special tokens;
    ``chat_template`` None: the tokenizer has none, and the template name's built-in format is used)."""

    family: str
    markers: tuple[str, ...] = ()
    chat_template: str | None = None


CHATML = ("<|im_start|>", "<|im_end|>", "<think>", "</think>")
MODELS = {
    "qwen3": Tiny("qwen3_moe", CHATML, HYBRID),
    "qwen3_5": Tiny("qwen3_5_moe", CHATML, HYBRID),
    "llama3": Tiny("qwen3_moe", ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
    "deepseek3": Tiny("deepseek_v3", ("<｜User｜>", "<｜Assistant｜>")),
    "deepseek": Tiny("deepseek_v2"),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Callable[[str], Path]:
    """name of MODELS -> a saved tiny checkpoint with its tokenizer (built once per module)."""
    from transformers import AutoTokenizer

    from moetune.testing.tiny import save_tiny_model

    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            spec, root = MODELS[name], tmp_path_factory.mktemp(name)
            tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
            tok.add_special_tokens({"additional_special_tokens": list(spec.markers)})
            tok.chat_template = spec.chat_template
            if spec.family == "qwen3_moe":  # the demo's own model: vocabulary sized to the tokenizer
                tok.save_pretrained(root / "tok")
                path = make_demo_model(root / "m", root / "tok")
            else:
                path = save_tiny_model(spec.family, root / "m", tokenizer=False)
                tok.save_pretrained(path)
            assert (path / "chat_template.jinja").exists() == (spec.chat_template is not None)
            built[name] = path
        return built[name]

    return get


@dataclass(frozen=True)
class Example:
    """How one example runs here: its tiny model, extra keys for the run, what else to check afterwards."""

    model: str
    over: dict[str, Any] = field(default_factory=dict)
    check: Callable[[dict, Any, Any, Path], None] | None = None  # (summary, trainer, caplog, output dir)


def _logged(caplog: Any, *keys: str) -> None:
    """One logged line for each key, starting with the key (what it maps to, or why it has no effect)."""
    for key in keys:
        assert sum(r.getMessage().startswith(f"{key}:") for r in caplog.records) == 1, key


def _experts(summary: dict, **want: Any) -> None:
    experts = summary["config"]["engine"]["experts"]
    assert {k: experts[k] for k in want} == want


def _template_name(summary: dict, trainer: Any, caplog: Any, out: Path) -> None:
    assert summary["config"]["data"]["template_name"] == "qwen3_nothink"
    lines = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [line["current_steps"] for line in lines if "loss" in line] == [1, 2]
    assert set(lines[0]) >= LF_LOG_FIELDS and lines[0]["total_steps"] == 2 and lines[-1]["percentage"] == 100
    assert lines[1]["lr"] == pytest.approx(2.0e-5)  # after one warmup step


def _kt_qwen3(summary: dict, trainer: Any, caplog: Any, out: Path) -> None:
    _experts(summary, expert_format="dense", num_threads=2, activation_policy="retain")
    _logged(caplog, "use_kt", "chunk_size", "kt_tp_enabled", "kt_threadpool_count", "kt_max_cache_depth")


def _kt_qwen3_5(summary: dict, trainer: Any, caplog: Any, out: Path) -> None:
    _experts(summary, expert_format="dense", num_threads=2, activation_policy="retain")
    _logged(caplog, "kt_model_max_length", "kt_share_backward_bb", "kt_backend", "kt_num_threads")


def _kt_deepseek3(summary: dict, trainer: Any, caplog: Any, out: Path) -> None:
    _experts(summary, expert_format="dense", num_threads=2, gpu_experts=2)
    _logged(caplog, "kt_num_gpu_experts")
    # the hot experts took their share: the engine of every MoE layer skips experts 0 and 1
    from moetune.layer.cpu_experts import CpuExperts

    layers = [m for m in trainer.model.modules() if isinstance(m, CpuExperts)]
    assert layers and all(m.hot is not None and m.hot.ids.tolist() == [0, 1] for m in layers)


def _kt_deepseek3_int8(summary: dict, trainer: Any, caplog: Any, out: Path) -> None:
    _experts(summary, expert_format="int8")
    _logged(caplog, "kt_backend", "kt_weight_lifecycle", "kt_expert_weight_format")


def _kt_old_keys(summary: dict, trainer: Any, caplog: Any, out: Path) -> None:
    _experts(summary, num_threads=2)
    _logged(caplog, "use_kt", "cpu_infer", "chunk_size", "kt_optimize_rule")


def _deepspeed(summary: dict, trainer: Any, caplog: Any, out: Path) -> None:
    """The logged line says what moetune runs in ZeRO-3's place (FSDP2 for LoRA, DDP for full/freeze)."""
    assert "deepspeed: ZeRO stage 3 is run as" in caplog.text


def _full(summary: dict, trainer: Any, caplog: Any, out: Path) -> None:
    """The output is a plain transformers checkpoint of the trained model (the experts in its own layout)."""
    from transformers import AutoModelForCausalLM

    assert summary["finetuning_type"] == "full" and not (out / "adapter_model.safetensors").exists()
    _deepspeed(summary, trainer, caplog, out)
    base = Path(summary["config"]["model"]["model_name_or_path"])
    trained, stock = (AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32) for p in (out, base))
    name = "model.layers.2.mlp.experts.down_proj"  # a routed-experts tensor the engine trained on the host
    assert (trained.state_dict()[name] - stock.state_dict()[name]).abs().max() > 0


def _round_trips(summary: dict, trainer: Any, caplog: Any, out: Path) -> None:
    """The preference stages' adapter loads in stock PEFT on the plain transformers model to moetune's logits."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moetune.adapters.load import load_model

    base = Path(summary["config"]["model"]["model_name_or_path"])
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out)
    ours = load_model(base, device="cpu", dtype="float32", progress=False, adapter=out)
    ids = torch.randint(4, 17, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            stock.eval()(input_ids=ids).logits, ours(input_ids=ids).logits, atol=1e-5, rtol=0
        )


PASSED_THROUGH = {
    "optim": "adamw_torch",
    "adam_beta2": 0.98,
    "max_grad_norm": 0.5,
    "lr_scheduler_type": "cosine_with_min_lr",
    "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
    "dataloader_pin_memory": False,
}

# every examples/lf_*.yaml: (its tiny model, keys for the run, extra checks)
EXAMPLES = {
    "lf_qwen3_lora_sft.yaml": Example("qwen3", {"logging_steps": 1, "learning_rate": 2.0e-5}, _template_name),
    "lf_llama3_lora_sft.yaml": Example("llama3"),
    "lf_qwen3_lora_sft_ds3.yaml": Example("qwen3", check=_deepspeed),
    "lf_qwen3moe_lora_sft_kt.yaml": Example("qwen3", check=_kt_qwen3),
    "lf_qwen3_5moe_lora_sft_kt.yaml": Example("qwen3_5", check=_kt_qwen3_5),
    "lf_deepseek_v3_lora_sft_kt.yaml": Example("deepseek3", check=_kt_deepseek3),
    "lf_deepseek_v3_int8_lora_sft_kt.yaml": Example("deepseek3", check=_kt_deepseek3_int8),
    "lf_deepseek_v2_lora_sft_kt.yaml": Example("deepseek", check=_kt_old_keys),
    "lf_qwen3_full_sft.yaml": Example("qwen3", check=_full),
    # TrainingArguments keys LLaMA-Factory users add reach TRL's DPOConfig too (checked on the Trainer's args)
    "lf_qwen3_lora_dpo.yaml": Example("qwen3", PASSED_THROUGH, _round_trips),
    "lf_deepseek2_lora_dpo_kt.yaml": Example("deepseek", check=_round_trips),
    "lf_qwen3_lora_kto.yaml": Example("qwen3", check=_round_trips),
    "lf_qwen3_lora_pretrain.yaml": Example("qwen3"),
}


def test_every_llamafactory_form_example_is_run_here() -> None:
    assert sorted(p.name for p in (ROOT / "examples").glob("lf_*.yaml")) == sorted(EXAMPLES)


def _reaches_the_trainer(raw: dict, args: Any) -> None:
    """Every key of the YAML that is a TrainingArguments field has its value on the Trainer's ``args``."""
    from moetune.config.hf_args import is_training_argument

    renamed = {"gradient_checkpointing": "activation_checkpointing"}
    given = {renamed.get(k, k): v for k, v in raw.items() if is_training_argument(renamed.get(k, k))}
    given.pop("output_dir")
    given.pop("deepspeed", None)  # read as FSDP2 or DDP; a logged line says which (_deepspeed)
    if given.pop("report_to", None) == "none":
        assert args.report_to in ([], ["none"])
    assert given, "no TrainingArguments key to check"
    got = {k: getattr(args, k) for k in given}
    assert got == given


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_trains_through_moetune_train(name, models, tmp_path, monkeypatch, caplog, capsys) -> None:
    from moetune.train import recipe

    example = EXAMPLES[name]
    raw = yaml.safe_load((ROOT / "examples" / name).read_text())
    out = tmp_path / "out"
    # model path, output directory and sizes; one process for the data (the CI machine is small)
    raw.update(
        model_name_or_path=str(models(example.model)),
        output_dir=str(out),
        max_steps=STEPS,
        max_samples=32,
        preprocessing_num_workers=None,
        **example.over,
    )
    if raw["stage"] in ("dpo", "kto"):
        raw["learning_rate"] = 1.0e-3  # the adapter moves in two steps, so the round trip compares something
    config = tmp_path / name
    config.write_text(yaml.safe_dump({k: v for k, v in raw.items() if v is not None}))
    runs: list[Any] = []
    run = recipe.run
    monkeypatch.setattr(recipe, "run", lambda cfg, **kw: runs.append(run(cfg, **kw)) or runs[-1])
    monkeypatch.chdir(ROOT)  # the examples' dataset_dir and deepspeed paths are relative to the repo root
    with caplog.at_level(logging.WARNING):
        assert main(["train", str(config)]) == 0
    trainer = runs[0].trainer
    assert not torch.cuda.is_available() or trainer.args.bf16  # bf16: true runs with or without a GPU
    _reaches_the_trainer(raw, trainer.args)
    assert (out / "loss_curve.png").is_file() and (out / "trainer_log.jsonl").is_file()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == STEPS and math.isfinite(summary["final_train_loss"])
    assert summary["loss_curve"] is not None
    if raw["finetuning_type"] == "lora":
        assert (out / "adapter_model.safetensors").is_file()
    printed = capsys.readouterr().out
    assert "learning_rate 0.0," not in printed  # small rates are printed, not rounded away
    if example.check is not None:
        example.check(summary, trainer, caplog, out)
    if name == "lf_qwen3_lora_sft.yaml":
        assert "learning_rate 2e-05" in printed


def test_a_template_name_of_another_family_is_refused_before_the_model_loads(
    models, tmp_path, monkeypatch, capsys
) -> None:
    """The Llama-3 example on a Qwen checkpoint: an error naming both formats, before any weight is read."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model started loading before the template was checked")

    monkeypatch.setattr("moetune.loading.load_model", forbidden)
    raw = yaml.safe_load((ROOT / "examples/lf_llama3_lora_sft.yaml").read_text())
    raw.update(model_name_or_path=str(models("qwen3")), output_dir=str(tmp_path / "out"), max_samples=8)
    config = tmp_path / "llama3_on_qwen.yaml"
    config.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(ROOT)
    assert main(["train", str(config)]) != 0
    err = capsys.readouterr().err
    assert "template 'llama3' is the Llama 3 format" in err and "names that fit it: chatml, qwen" in err
    assert not (tmp_path / "out").exists()
