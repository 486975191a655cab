"""The LLaMA-Factory-form examples (examples/lf_*.yaml) train through `moetune train`, as shipped except for the
model path, output directory and sizes, on a tiny Qwen3-MoE whose tokenizer has a Qwen3-style hybrid reasoning
chat template (history turns lose their reasoning), with LLaMA-Factory's outputs (trainer_log.jsonl, the loss
curve) and without a GPU although they set `bf16: true`."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml

from moetune.cli.main import main
from moetune.train.demo import make_demo_model
from tests.unit.train.test_named_templates import HYBRID

ROOT = Path(__file__).resolve().parents[2]
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


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory) -> Path:
    """The demo's tiny Qwen3-MoE with a hybrid reasoning ChatML chat template."""
    path = make_demo_model(tmp_path_factory.mktemp("m") / "tiny", ROOT / "examples/data/demo_tokenizer")
    (path / "chat_template.jinja").write_text(HYBRID)
    return path


def run_example(name: str, model: Path, out: Path, monkeypatch: pytest.MonkeyPatch, **sizes) -> dict:
    """Run examples/NAME with the model, output_dir and ``sizes`` replaced; returns its run summary."""
    raw = yaml.safe_load((ROOT / "examples" / name).read_text())
    raw.update(model_name_or_path=str(model), output_dir=str(out), max_steps=2, **sizes)
    config = out.parent / f"{name}"
    config.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(ROOT)  # the examples' dataset_dir and deepspeed paths are relative to the repo root
    assert main(["train", str(config)]) == 0
    assert (out / "adapter_model.safetensors").is_file() and (out / "loss_curve.png").is_file()
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 2 and summary["final_train_loss"] is not None
    return summary


@pytest.mark.filterwarnings("error:You are trying to modify a model with PEFT")  # moetune does not cause it
def test_lora_sft_with_a_template_name(tmp_path, qwen3_model, monkeypatch, capsys) -> None:
    summary = run_example(
        "lf_qwen3_lora_sft.yaml",
        qwen3_model,
        tmp_path / "out",
        monkeypatch,
        logging_steps=1,
        learning_rate=2.0e-5,
    )
    assert summary["config"]["data"]["template_name"] == "qwen3_nothink"
    assert dict(summary["config"]["training"]["extra_args"]) == {"optim": "adamw_torch", "adam_beta2": 0.95}
    lines = [json.loads(line) for line in (tmp_path / "out" / "trainer_log.jsonl").read_text().splitlines()]
    assert [line["current_steps"] for line in lines if "loss" in line] == [1, 2]
    assert set(lines[0]) >= LF_LOG_FIELDS and lines[0]["total_steps"] == 2 and lines[-1]["percentage"] == 100
    assert lines[1]["lr"] == pytest.approx(2.0e-5)  # after one warmup step
    printed = capsys.readouterr().out
    assert "learning_rate 0.0," not in printed and "learning_rate 2e-05" in printed  # not rounded away


def test_ktransformers_moe_config(tmp_path, qwen3_model, monkeypatch, caplog) -> None:
    with caplog.at_level(logging.WARNING):
        summary = run_example("lf_qwen3moe_lora_sft_kt.yaml", qwen3_model, tmp_path / "out", monkeypatch)
    experts = summary["config"]["engine"]["experts"]
    assert (experts["expert_format"], experts["num_threads"], experts["activation_policy"]) == (
        "dense",
        2,
        "retain",
    )
    for key in ("use_kt", "chunk_size", "kt_tp_enabled", "kt_threadpool_count", "kt_max_cache_depth"):
        assert any(r.getMessage().startswith(f"{key}:") for r in caplog.records), key


def test_deepspeed_config_and_a_log_interval_beyond_the_run(
    tmp_path, qwen3_model, monkeypatch, caplog
) -> None:
    """logging_steps 10 > 2 steps: the summary's loss and the curve come from the run's mean loss."""
    with caplog.at_level(logging.WARNING):
        summary = run_example("lf_qwen3_lora_sft_ds3.yaml", qwen3_model, tmp_path / "out", monkeypatch)
    assert "nothing to shard" in caplog.text
    assert summary["loss_curve"] is not None
