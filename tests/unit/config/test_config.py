"""The training config: LLaMA-Factory keys parse into typed sections; every problem is reported at once."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from moetune.config import (
    ActivationPolicy,
    DataFormat,
    FinetuningType,
    IntervalStrategy,
    MoetuneConfig,
    Stage,
    load_config,
    parse_config,
    training_arguments_kwargs,
)
from moetune.config.llamafactory import REJECTED
from moetune.errors import ConfigError, MoetuneError


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a model folder and an alpaca dataset registered in data/dataset_info.json."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    data = tmp_path / "data"
    data.mkdir()
    (data / "alpaca.json").write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    (data / "dataset_info.json").write_text(json.dumps({"alpaca_demo": {"file_name": "alpaca.json"}}))
    return tmp_path


def minimal(**keys: Any) -> dict[str, Any]:
    """The smallest valid config (relative to ``workdir``), with ``keys`` added or replaced."""
    return {"model_name_or_path": "model", "dataset": "alpaca_demo", "output_dir": "out", **keys}


def problems_of(raw: Any, **kwargs: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(raw, **kwargs)
    return str(info.value)


# A LLaMA-Factory LoRA SFT YAML, as their examples write it (KTransformers keys aside).
LLAMAFACTORY_YAML = """
### model
model_name_or_path: model
trust_remote_code: true

### method
stage: sft
do_train: true
finetuning_type: lora
lora_rank: 8
lora_target: all

### dataset
dataset: alpaca_demo
cutoff_len: 2048
max_samples: 1000
overwrite_cache: true
preprocessing_num_workers: 16
dataloader_num_workers: 4

### output
output_dir: saves/qwen3/lora/sft
logging_steps: 10
save_steps: 500
overwrite_output_dir: true
save_only_model: false
report_to: none

### train
per_device_train_batch_size: 1
gradient_accumulation_steps: 8
learning_rate: 1e-4
num_train_epochs: 3.0
lr_scheduler_type: cosine
warmup_ratio: 0.1
bf16: true
ddp_timeout: 180000000
resume_from_checkpoint: null

### ktransformers, switched off
use_kt: false
"""


def test_llamafactory_yaml_parses_into_typed_sections(workdir: Path) -> None:
    (workdir / "train.yaml").write_text(LLAMAFACTORY_YAML)
    cfg = load_config("train.yaml")
    assert isinstance(cfg, MoetuneConfig)
    assert cfg.model.model_name_or_path == "model" and cfg.model.trust_remote_code is True
    assert cfg.finetune.stage is Stage.SFT and cfg.finetune.finetuning_type is FinetuningType.LORA
    assert cfg.finetune.lora_alpha == 16  # unset: 2 * rank, as in LLaMA-Factory
    assert cfg.finetune.targets_all and cfg.finetune.lora_scale == 2.0
    assert cfg.training.learning_rate == 1e-4  # PyYAML reads `1e-4` as a string
    assert cfg.training.output_dir == Path("saves/qwen3/lora/sft")
    assert cfg.training.gradient_checkpointing is True  # LLaMA-Factory's default
    assert cfg.data.dataset == ("alpaca_demo",) and cfg.data.max_samples == 1000
    (source,) = cfg.data.train_sources
    assert source.path == Path("data/alpaca.json") and source.formatting is None
    assert cfg.engine.experts.activation_policy is ActivationPolicy.RETAIN and cfg.source == Path(
        "train.yaml"
    )
    json.dumps(cfg.summary())  # plain values only


def test_every_problem_is_reported_at_once(workdir: Path) -> None:
    raw = minimal(
        model_name_or_path="no/such/model/dir",
        dataset="alpaca_demo, missing_set",
        lora_rank=0,
        lora_dropout=1.0,
        cutoff_len=-5,
        learning_rate=-1e-4,
        lora_rnak=4,
        deepspeed="ds_z3.json",
        use_kt="maybe",
        bf16="sometimes",
        moetune={"num_threads": 0, "activation_policy": "keep", "turbo": True},
    )
    text = problems_of(raw)
    expected = [
        "13 problems",
        "lora_rank: got 0; must be > 0",
        "lora_dropout: got 1.0; must be in [0, 1)",
        "cutoff_len: got -5; must be > 0",
        "learning_rate: got -0.0001; must be > 0",
        "lora_rnak: is not a moetune, supported LLaMA-Factory or transformers TrainingArguments key; did you mean",
        "deepspeed: cannot read ds_z3.json",
        "use_kt: got 'maybe'; expected true or false",
        "bf16: got 'sometimes'; expected true or false",
        "moetune.num_threads: got 0; must be a positive integer",
        "moetune.activation_policy: got 'keep'; allowed: retain, recompute",
        "moetune.turbo: is not an engine option",
        "'missing_set' is neither a dataset name in data/dataset_info.json (names there: alpaca_demo)",
        "model_name_or_path: no/such/model/dir does not exist",
    ]
    for fragment in expected:
        assert fragment in text, fragment


def test_config_error_is_a_moetune_error() -> None:
    assert issubclass(ConfigError, MoetuneError)


def test_required_keys_are_listed(workdir: Path) -> None:
    text = problems_of({})
    for key in ("model_name_or_path", "dataset", "output_dir"):
        assert f"{key}: is required and missing" in text


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("lora_rank", "eight", "expected an integer"),
        ("lora_rank", 8.5, "expected an integer"),
        ("lora_rank", True, "expected an integer"),
        ("lora_target", [], "non-empty list"),
        ("lora_target", "all,q_proj", "cannot be combined"),
        ("num_train_epochs", 0, "must be > 0"),
        ("max_steps", 0, "or -1 to train for num_train_epochs"),
        ("logging_steps", 2.5, "whole number of steps"),
        ("warmup_ratio", 1.5, "must be in [0, 1)"),
        ("val_size", 2.5, "fraction"),
        ("lr_scheduler_type", "cosin", "allowed: linear, cosine"),
        ("report_to", "tensorbord", "allowed:"),
        ("save_strategy", "sometimes", "one of: no, steps, epoch"),
        (
            "stage",
            "ppo",
            "'ppo' (PPO) is not supported yet; a later moetune version adds it. Supported: sft, pt",
        ),
        (
            "pref_loss",
            "orpo",
            "'orpo' (ORPO, reference-free) is not supported yet; a later moetune version adds it. Supported: sigmoid, hinge, ipo",
        ),
        ("pref_beta", 0.2, "is set but stage is 'sft'; it applies to stage dpo / kto only"),
        ("kto_chosen_weight", 2.0, "applies to stage kto only"),
        ("dpo_label_smoothing", 0.1, "no equivalent in TRL's DPOTrainer/KTOTrainer"),
        ("pref_bco_weight", 0.5, "supported: pref_beta, pref_ftx, pref_loss (sigmoid, hinge, ipo)"),
        ("simpo_gamma", 1.0, "no equivalent"),
        ("finetuning_type", "oft", "a later moetune version adds it. Supported: lora, full, freeze"),
        ("do_train", False, "always trains"),
        (
            "template",
            "qwen3_nothnk",
            "is not a LLaMA-Factory template name moetune maps; supported names: chatml",
        ),
        ("template", "templates/chat.jinja", "does not exist"),
        ("optim", "adamw_torch_bogus", "transformers refuses the training arguments"),
        ("adam_beta2", "high", "expected a number (transformers TrainingArguments.adam_beta2)"),
        ("gradient_checkpointing_kwargs", {"use_reentrant": True}, "is set by moetune itself"),
        ("lr_scheduler_kwargs", {"min_lr_rate": 0.1}, "the 'linear' scheduler refuses it"),
        ("lr_scheduler_type", "cosine_with_min_lr", "the 'cosine_with_min_lr' scheduler refuses it"),
        ("sortish_sampler", True, "generation/inference settings do not apply"),
        ("kt_weight_path", "/kt", "moetune convert MODEL_DIR STORE_DIR --format int8"),
        ("kt_non_expert_weight_path", "/kt", "it does not read KTransformers .kt files"),
        ("kt_num_gpu_experts", -2, "allowed: a number of experts per MoE layer, 0 or more"),
        ("kt_backend", "AMXINT2", "allowed: auto, amxbf16"),
        ("quantization_bit", 4, "expert_format"),
        ("galore_rank", 16, "is not supported; moetune trains LoRA (use_rslora included), full and freeze"),
        ("use_dora", True, "LoRA variant is not supported"),
        ("data_shared_file_system", True, "each moetune process reads and tokenizes the data itself"),
        ("moetune", [1], "expected a mapping of engine options"),
        ("num_threads", 8, "is an engine option; put it under `moetune:`"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(
    workdir: Path, key: str, value: Any, message: str
) -> None:
    text = problems_of(minimal(**{key: value}))
    assert f"- {key}: " in text and message in text


def test_keys_switched_off_are_accepted(workdir: Path) -> None:
    """A rejected LLaMA-Factory key set to the value that asks for nothing requests nothing moetune lacks."""
    offs = {key: rule.off[0] if isinstance(rule.off, tuple) else rule.off for key, rule in REJECTED.items()}
    off = {key: value for key, value in offs.items() if REJECTED[key].accepts(value)}
    assert {"quantization_bit", "flash_attn", "neat_packing"} <= set(off)
    parse_config(minimal(**off))


def test_engine_options(workdir: Path) -> None:
    engine = {"activation_policy": "recompute", "num_threads": 4, "device": "cuda:1", "check_finite": True}
    cfg = parse_config(minimal(moetune={**engine, "expert_workers": 2}))
    assert cfg.engine.experts.activation_policy is ActivationPolicy.RECOMPUTE
    assert cfg.engine.experts.expert_workers == 2
    assert parse_config(minimal(moetune=engine)).engine.experts.expert_workers is None
    assert (cfg.engine.experts.num_threads, cfg.engine.device, cfg.engine.experts.check_finite) == (
        4,
        "cuda:1",
        True,
    )
    text = problems_of(minimal(moetune={"device": "gpu", "expert_format": "int3", "expert_workers": 0}))
    assert "moetune.device: got 'gpu'; must be auto, cpu, cuda or cuda:N" in text
    assert "moetune.expert_workers: got 0; must be a positive integer" in text
    assert "moetune.expert_format: got 'int3'; allowed: auto, dense" in text  # then the registered formats
    assert parse_config(minimal(moetune={"expert_format": "dense"})).engine.experts.expert_format == "dense"
    assert parse_config(minimal()).engine.bind_cpus is True
    assert parse_config(minimal(moetune={"bind_cpus": "false"})).engine.bind_cpus is False
    assert "moetune.bind_cpus: got 'sometimes'" in problems_of(minimal(moetune={"bind_cpus": "sometimes"}))


def test_cross_field_rules(workdir: Path) -> None:
    text = problems_of(
        minimal(warmup_ratio=0.1, warmup_steps=10, eval_steps=5, val_size=0.1, eval_dataset="alpaca_demo")
    )
    assert "warmup_steps: is set together with warmup_ratio" in text
    assert "val_size: is set together with eval_dataset" in text
    assert "eval_steps: is set but eval_strategy is not 'steps'" in text
    assert (
        "eval_strategy: is 'no' but eval_dataset or val_size is set" not in text
    )  # skipped: val_size is bad
    assert "eval_strategy: is 'steps' but there is no evaluation data" in problems_of(
        minimal(eval_strategy="steps")
    )
    assert "eval_strategy: is 'no' but eval_dataset" in problems_of(minimal(val_size=0.1))
    cfg = parse_config(minimal(val_size=0.1, eval_strategy="steps", eval_steps=20))
    assert cfg.training.eval_strategy is IntervalStrategy.STEPS


def test_do_eval_asks_for_evaluation_data(workdir: Path) -> None:
    """LLaMA-Factory's ``do_eval: true`` (evaluate after training): refused without evaluation data; with it,
    ``eval_strategy: no`` is no longer data never used."""
    assert "do_eval: is true but there is no evaluation data" in problems_of(minimal(do_eval=True))
    cfg = parse_config(minimal(do_eval=True, val_size=0.1))
    assert cfg.finetune.do_eval and cfg.training.eval_strategy is IntervalStrategy.NO
    assert "or do_eval: true" in problems_of(minimal(val_size=0.1))


def test_an_unquoted_no_is_the_strategy_no(workdir: Path) -> None:
    """``save_strategy: no`` unquoted, as LLaMA-Factory's docs write it: YAML 1.1 reads it as false, which was
    refused ("got False; expected one of: no, steps, epoch")."""
    import yaml

    raw = yaml.safe_load("save_strategy: no\neval_strategy: no\n")
    assert raw == {"save_strategy": False, "eval_strategy": False}
    cfg = parse_config(minimal(**raw))
    assert cfg.training.save_strategy is cfg.training.eval_strategy is IntervalStrategy.NO
    assert "save_strategy: got True; expected one of: no, steps, epoch" in problems_of(
        minimal(save_strategy=True)
    )


def test_disable_gradient_checkpointing_is_read_as_its_negation(workdir: Path) -> None:
    assert parse_config(minimal(disable_gradient_checkpointing=True)).training.gradient_checkpointing is False
    text = problems_of(minimal(disable_gradient_checkpointing=True, gradient_checkpointing=True))
    assert "disable_gradient_checkpointing: conflicts with gradient_checkpointing" in text


def test_output_dir_holding_a_run_needs_overwrite_or_resume(workdir: Path) -> None:
    (workdir / "out" / "checkpoint-100").mkdir(parents=True)
    (workdir / "out" / "checkpoint-100" / "trainer_state.json").write_text("{}")
    text = problems_of(minimal())
    assert "output_dir: out already holds a training run (checkpoint-100)" in text
    assert parse_config(minimal(overwrite_output_dir=True)).training.overwrite_output_dir
    assert parse_config(minimal(resume_from_checkpoint=True)).training.resume_from_checkpoint is True
    resumed = parse_config(minimal(resume_from_checkpoint="out/checkpoint-100"))
    assert resumed.training.resume_from_checkpoint == Path("out/checkpoint-100")
    assert "is not a checkpoint folder" in problems_of(minimal(resume_from_checkpoint="data"))
    # a run's output_dir, finished (its own trainer_state.json) or not, with checkpoints inside (its own trainer_state.json, checkpoints inside): the newest checkpoint named
    (workdir / "out" / "trainer_state.json").write_text("{}")
    for step in (20, 100):
        (workdir / "out" / f"checkpoint-{step}").mkdir(exist_ok=True)
    text = problems_of(minimal(resume_from_checkpoint="out"))
    assert (
        "resume_from_checkpoint: out is a run's output_dir (it holds checkpoint-20, checkpoint-100), not a "
        "checkpoint; give one of its checkpoint folders, e.g. out/checkpoint-100"
    ) in text


def test_output_dir_never_the_model_folder_nor_a_model_without_a_run(workdir: Path) -> None:
    """A full or freeze run saving into the model it loads wrote over the base weights (exit 0, nothing said):
    refused however the folder is spelt, overwrite_output_dir or not; so is another model's folder (its tokenizer and
    config were written over under overwrite_output_dir, which every LLaMA-Factory example sets)."""
    for spelt in ("model", "./model", str(workdir / "model"), "model/../model"):
        text = problems_of(minimal(output_dir=spelt, finetuning_type="full", overwrite_output_dir=True))
        assert "is model_name_or_path's folder: saving there writes over the base model's files" in text, (
            spelt
        )
    (workdir / "other").mkdir()
    (workdir / "other" / "config.json").write_text("{}")
    (workdir / "other" / "model.safetensors").write_bytes(b"")
    text = problems_of(minimal(output_dir="other"))
    assert "output_dir: other holds a model (model.safetensors) and no training run" in text
    assert "other holds a model" in problems_of(minimal(output_dir="other", overwrite_output_dir=True))
    # a finished full run's own output (weights and its trainer_state.json): the usual rule, not this one
    (workdir / "other" / "trainer_state.json").write_text("{}")
    assert "holds a model" not in problems_of(minimal(output_dir="other"))


def test_lora_keys_under_full_or_freeze_are_said_to_have_no_effect(
    workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """They were accepted and ignored without a word; a config switched from lora keeps them (LLaMA-Factory
    ignores them), so a logged line, not an error; the keys left at their defaults say nothing."""
    for method in ("full", "freeze"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moetune.config.load"):
            parse_config(minimal(finetuning_type=method, lora_rank=16, lora_target="q_proj", lora_alpha=8))
        assert (
            f"lora_rank, lora_alpha, lora_target apply to finetuning_type: lora only; with finetuning_type {method} "
            "no LoRA is attached and they have no effect"
        ) in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="moetune.config.load"):
            parse_config(minimal(finetuning_type=method, lora_rank=8))
        assert "finetuning_type: lora only" not in caplog.text


def test_the_optimizer_is_built_before_the_model_loads(workdir: Path) -> None:
    """What the Trainer would raise after the model loaded (minutes for a large MoE) is a config error: a bad
    beta under every mode, an optimizer whose package is missing under LoRA (full and freeze step with moetune's
    AdamW, which needs no bitsandbytes: README's optim table)."""
    for method in ("lora", "full"):
        text = problems_of(minimal(finetuning_type=method, adam_beta1=1.5))
        assert "adam_beta1, adam_beta2, adam_epsilon: the optimizer (AdamW) refuses its settings" in text, (
            method
        )
        assert "Invalid beta parameter" in text
    if importlib.util.find_spec("bitsandbytes") is None:
        text = problems_of(minimal(optim="adamw_bnb_8bit"))
        assert "optim: is 'adamw_bnb_8bit': You need to install `bitsandbytes`" in text
        assert parse_config(minimal(finetuning_type="full", optim="adamw_bnb_8bit")).finetune.finetuning_type
    assert parse_config(minimal(adam_beta1=0.8, adam_beta2=0.95)).training.extra_args


def test_transformers_checks_are_reported_with_the_others(workdir: Path) -> None:
    """Every problem at once: the optimizer's and the scheduler's (transformers' own checks) came only after the
    other problems were fixed, one run each."""
    text = problems_of(minimal(adam_beta1=1.5, max_samples=-3, lr_scheduler_kwargs={"foo": 1}))
    assert "3 problems" in text
    assert (
        "max_samples: got -3" in text and "lr_scheduler_kwargs" in text and "Invalid beta parameter" in text
    )


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_report_to_an_integration_that_is_not_installed(workdir: Path) -> None:
    text = problems_of(minimal(report_to="wandb"))
    assert "report_to: names wandb, whose package is not installed here (pip install it)" in text


def test_overwriting_a_folder_with_checkpoints_says_they_stay(
    workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (workdir / "out" / "checkpoint-4").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="moetune.config.load"):
        parse_config(minimal(overwrite_output_dir=True))
    assert (
        "holds checkpoints of an earlier run (checkpoint-4); overwrite_output_dir writes over its files but leaves them"
        in caplog.text
    )


def test_resume_needs_a_checkpoint(workdir: Path) -> None:
    text = problems_of(minimal(resume_from_checkpoint=True))
    assert "resume_from_checkpoint: is true but out holds no checkpoint-* folder" in text


def test_empty_or_unrelated_output_dir_is_fine(workdir: Path) -> None:
    (workdir / "out").mkdir()
    (workdir / "out" / "notes.txt").write_text("hi")
    parse_config(minimal())


def test_a_malformed_dataset_info_is_one_problem(workdir: Path) -> None:
    """It was reported twice, the second time as 'dataset_info.json does not exist'; a path still resolves."""
    (workdir / "data" / "dataset_info.json").write_text('{"alpaca_demo": ')
    text = problems_of(minimal())
    assert "config: 1 problem:" in text and "cannot read data/dataset_info.json" in text
    assert "does not exist" not in text
    (workdir / "rows.json").write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    assert "1 problem:" in problems_of(minimal(dataset=["alpaca_demo", "rows.json"]))


def test_dataset_paths_and_dataset_info_entries(workdir: Path) -> None:
    (workdir / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    info = {
        "alpaca_demo": {
            "file_name": "alpaca.json",
            "formatting": "alpaca",
            "columns": {"prompt": "q", "response": "a"},
        },
        "sharegpt_demo": {
            "file_name": "alpaca.json",
            "formatting": "sharegpt",
            "columns": {"messages": "dialog"},
            "tags": {"role_tag": "speaker"},
        },
        "hub_only": {"hf_hub_url": "org/data"},
        "pairs": {"file_name": "alpaca.json", "ranking": True, "columns": {"chosen": "c"}},
        "odd": {
            "file_name": "alpaca.json",
            "formatting": "alpaca",
            "columns": {"messages": "m"},
            "tags": {"x": "y"},
        },
        "gone": {"file_name": "missing.json"},
        "word": {"file_name": "alpaca.doc"},
    }
    (workdir / "data" / "dataset_info.json").write_text(json.dumps(info))
    (workdir / "data" / "alpaca.doc").write_text("")
    cfg = parse_config(minimal(dataset=["alpaca_demo", "sharegpt_demo", "chat.jsonl"]))
    alpaca, sharegpt, chat = cfg.data.train_sources
    assert alpaca.formatting is DataFormat.ALPACA and dict(alpaca.columns) == {"prompt": "q", "response": "a"}
    assert sharegpt.formatting is DataFormat.SHAREGPT and dict(sharegpt.tags) == {"role_tag": "speaker"}
    assert chat.path == Path("chat.jsonl") and chat.formatting is None
    text = problems_of(minimal(dataset="hub_only,pairs,odd,gone,word"))
    assert "'hub_only' has hf_hub_url but no file_name; moetune reads local files only" in text
    assert "dataset 'pairs' is a preference dataset (ranking: true), which only stage dpo reads" in text
    assert "maps column role 'messages', which alpaca does not have" in text
    assert "has unknown tags ['x']" in text
    assert "missing.json does not exist" in text
    assert "has suffix '.doc'" in text


def test_template_file(workdir: Path) -> None:
    (workdir / "chat.jinja").write_text("{{ messages }}")
    assert parse_config(minimal(template="chat.jinja")).data.template_file == Path("chat.jinja")


def test_hub_id_must_be_in_the_local_cache(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(workdir / "hf_cache"))
    text = problems_of(minimal(model_name_or_path="some-org/Some-MoE"))
    assert "'some-org/Some-MoE' is neither a local folder nor in the local Hugging Face cache" in text


def test_model_path_check_can_be_skipped(workdir: Path) -> None:
    cfg = parse_config(minimal(model_name_or_path="out/demo/model"), check_model_path=False)
    assert cfg.model.model_name_or_path == "out/demo/model"


def test_yaml_errors(workdir: Path) -> None:
    (workdir / "bad.yaml").write_text("model_name_or_path: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml is not valid YAML"):
        load_config("bad.yaml")
    (workdir / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config("list.yaml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config("nowhere.yaml")


def test_training_arguments_kwargs_build_real_training_arguments(workdir: Path) -> None:
    from transformers import TrainingArguments

    cfg = parse_config(
        minimal(
            learning_rate="2e-4",
            warmup_ratio=0.1,
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr": 1e-6},
            val_size=0.1,
            eval_strategy="steps",
            logging_steps=5,
            save_total_limit=2,
            gradient_checkpointing=False,
            moetune={"device": "cpu"},
        )
    )
    kwargs = training_arguments_kwargs(cfg)
    args = TrainingArguments(**kwargs)
    assert args.learning_rate == 2e-4 and args.warmup_steps == 0.1
    assert args.eval_strategy == "steps" and args.eval_steps == 5  # eval_steps defaults to logging_steps
    assert args.lr_scheduler_kwargs == {"min_lr": 1e-6} and args.save_total_limit == 2
    assert args.use_cpu and not args.activation_checkpointing and not args.remove_unused_columns
    assert "resume_from_checkpoint" not in kwargs
    steps = training_arguments_kwargs(parse_config(minimal(warmup_steps=30)))
    assert steps["warmup_steps"] == 30 and TrainingArguments(**steps).warmup_steps == 30


def test_shipped_example_configs_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every examples/*.yaml is valid. Their models are written by the demo, so the model path is not
    checked here; their datasets and templates are."""
    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)  # example paths are relative to the repository root
    configs = sorted((root / "examples").glob("*.yaml"))
    assert configs, "no example configs found"
    for path in configs:
        cfg = load_config(path.relative_to(root), check_model_path=False)
        assert cfg.data.train_sources, path


def test_a_key_set_twice_is_refused_with_both_lines(workdir: Path) -> None:
    """YAML keeps the last of two equal keys without a word; a config that sets one twice is refused."""
    path = workdir / "train.yaml"
    path.write_text(
        "model_name_or_path: model\nlearning_rate: 1.0e-4\ndataset: alpaca_demo\noutput_dir: out\n"
        "learning_rate: 2.0e-4\nmoetune:\n  device: cpu\n  device: auto\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert (
        str(path) in text
        and "'learning_rate' on lines 2 and 5" in text
        and "'device' on lines 7 and 8" in text
    )
    path.write_text("model_name_or_path: model\ndataset: alpaca_demo\noutput_dir: out\n")
    assert (
        load_config(path).training.plot_loss is True
    )  # LLaMA-Factory's plot_loss: moetune's PNG, on by default


def test_plot_loss_is_accepted(workdir: Path) -> None:
    assert parse_config(minimal(plot_loss=True)).training.plot_loss is True
    assert parse_config(minimal(plot_loss=False)).training.plot_loss is False


def test_bf16_without_a_gpu_runs_on_the_cpu(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``device: auto`` on a machine without CUDA: transformers' bf16 check needs use_cpu, or it raises after
    the model has loaded."""
    from transformers import TrainingArguments

    from moetune.config import training_args as module
    from moetune.config import training_arguments_kwargs

    monkeypatch.setattr(module, "_cuda_available", lambda: False)
    kwargs = training_arguments_kwargs(parse_config(minimal(bf16=True)))
    assert kwargs["use_cpu"] is True
    assert TrainingArguments(**kwargs).bf16  # constructs: no "bf16 needs a GPU" ValueError
    monkeypatch.setattr(module, "_cuda_available", lambda: True)
    assert training_arguments_kwargs(parse_config(minimal(bf16=True)))["use_cpu"] is False


def test_ktransformers_keys_map_to_engine_options(workdir: Path, caplog: pytest.LogCaptureFixture) -> None:
    raw = minimal(
        use_kt=True,
        cpu_infer=6,
        kt_cpu_activation="recompute",
        chunk_size=8192,
        kt_optimize_rule="rules/DeepSeek-V3-Chat-sft-amx.yaml",
        kt_config={
            "kt_backend": "AMXINT8",
            "kt_tp_enabled": True,
            "kt_threadpool_count": 2,
            "kt_num_gpu_experts": 0,
        },
    )
    with caplog.at_level("WARNING"):
        experts = parse_config(raw).engine.experts
    assert (experts.expert_format, experts.num_threads, experts.activation_policy) == (
        "int8",
        6,
        ActivationPolicy.RECOMPUTE,
    )
    for key in ("use_kt", "chunk_size", "kt_optimize_rule", "kt_tp_enabled", "kt_threadpool_count"):
        assert sum(r.getMessage().startswith(f"{key}:") for r in caplog.records) == 1, key
    text = problems_of(minimal(cpu_infer=0, kt_backend="AMXBF16", moetune={"expert_format": "int8"}))
    assert "cpu_infer (read as moetune.num_threads): got 0" in text
    assert (
        "kt_backend: is read as `moetune: {expert_format: bf16}`, but expert_format is already 'int8'" in text
    )
    fmt = parse_config(minimal(kt_config={"kt_backend": "auto", "kt_expert_weight_format": "fp8"}))
    assert fmt.engine.experts.expert_format == "fp8_block"
    # nothing in kt_config is dropped: an unknown setting, one set twice and a .kt tree are each refused
    text = problems_of(
        minimal(kt_num_threads=4, kt_config={"kt_num_threads": 4, "kt_turbo": True, "kt_weight_path": "/kt"})
    )
    assert "kt_config.kt_num_threads: is also set at the top level; set kt_num_threads once" in text
    assert "kt_config.kt_turbo: is not a KTransformers setting moetune knows" in text
    assert "kt_weight_path: got '/kt'; moetune reads routed experts from the checkpoint" in text


def test_training_arguments_pass_through_to_transformers(workdir: Path) -> None:
    from transformers import TrainingArguments

    cfg = parse_config(
        minimal(
            optim="adamw_torch",
            adam_beta2="0.95",
            max_grad_norm=0.5,
            lr_scheduler_type="cosine_with_min_lr",
            lr_scheduler_kwargs={"min_lr_rate": 0.1},
            dataloader_pin_memory=False,
        )
    )
    args = TrainingArguments(**training_arguments_kwargs(cfg))
    assert (args.optim, args.adam_beta2, args.max_grad_norm, args.dataloader_pin_memory) == (
        "adamw_torch",
        0.95,
        0.5,
        False,
    )
    assert args.lr_scheduler_kwargs == {"min_lr_rate": 0.1}


def test_deepspeed_is_accepted_unless_it_asks_for_offload(
    workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    zero3 = {"bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3}}
    (workdir / "ds_z3.json").write_text(json.dumps(zero3))
    with caplog.at_level("WARNING"):
        parse_config(minimal(deepspeed="ds_z3.json"))
    assert "ZeRO stage 3 is run as FSDP2" in caplog.text  # tests/unit/train/test_fsdp.py: each stage
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    (workdir / "ds_off.json").write_text(json.dumps(offload))
    assert (
        "zero_optimization.offload_optimizer (device 'cpu'): moetune has no DeepSpeed offload"
        in problems_of(minimal(deepspeed="ds_off.json"))
    )


def test_gpu_experts_from_yaml_and_ktransformers(workdir: Path) -> None:
    """``moetune: {gpu_experts: ...}`` takes a number or one list of ids per MoE layer; KTransformers'
    ``kt_num_gpu_experts`` is read as it; setting both differently, or a bad value, is refused naming the key."""
    assert parse_config(minimal(moetune={"gpu_experts": 3})).engine.experts.gpu_experts == 3
    lists = parse_config(minimal(moetune={"gpu_experts": [[0, 5], []]})).engine.experts.gpu_experts
    assert lists == ((0, 5), ())
    assert parse_config(minimal(kt_num_gpu_experts=4)).engine.experts.gpu_experts == 4
    assert parse_config(minimal()).engine.experts.gpu_experts is None
    both = problems_of(minimal(kt_num_gpu_experts=4, moetune={"gpu_experts": 2}))
    assert "kt_num_gpu_experts: is read as `moetune: {gpu_experts: 4}`, but gpu_experts is already 2" in both
    for value, needle in (
        ([[0, 0]], "lists an expert twice"),
        ([[0, -1]], "not expert ids"),
        (True, "allowed: 0 (none)"),
    ):
        text = problems_of(minimal(moetune={"gpu_experts": value}))
        assert f"moetune.gpu_experts: got {value!r}" in text and needle in text, text


def test_gpu_experts_auto_options(workdir: Path) -> None:
    """``auto`` needs a device budget; the auto options without ``auto`` are refused; YAML spellings coerce."""
    experts = parse_config(
        minimal(moetune={"gpu_experts": "AUTO", "gpu_experts_budget": "1MB", "gpu_experts_warmup": "3"})
    ).engine.experts
    assert (experts.gpu_experts, experts.gpu_experts_budget, experts.gpu_experts_warmup) == ("auto", 10**6, 3)
    text = problems_of(minimal(moetune={"gpu_experts": "auto"}))
    assert "moetune.gpu_experts: is 'auto' but gpu_experts_budget is not set" in text
    text = problems_of(minimal(moetune={"gpu_experts": 2, "gpu_experts_warmup": 3}))
    assert "moetune.gpu_experts_warmup: is set (3) but applies to gpu_experts: auto only" in text
    text = problems_of(minimal(moetune={"gpu_experts": "auto", "gpu_experts_budget": "lots"}))
    assert "moetune.gpu_experts_budget: got 'lots'" in text


def test_hot_sets_check_the_model() -> None:
    from moetune.config.experts import hot_sets

    assert hot_sets(None, [8, 8]) == [(), ()] == hot_sets("auto", [8, 8])
    assert hot_sets(2, [8, 4]) == [(0, 1), (0, 1)]
    assert hot_sets(((5, 1), ()), [8, 8]) == [(1, 5), ()]
    with pytest.raises(ConfigError, match=r"gpu_experts: got 5, more than the 4 routed experts"):
        hot_sets(5, [8, 4])
    with pytest.raises(ConfigError, match=r"got 1 per-layer lists, but the model has 2 MoE layers"):
        hot_sets(((1,),), [8, 8])
    with pytest.raises(ConfigError, match=r"MoE layer 1 lists expert ids \[9\], but that layer has E = 8"):
        hot_sets(((1,), (9,)), [8, 8])


def test_gpu_experts_example_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    cfg = load_config(Path("examples/demo_gpu_experts.yaml"), check_model_path=False)
    assert cfg.engine.experts.gpu_experts == 2


@pytest.mark.parametrize(("stage", "method"), [("dpo", "full"), ("kto", "freeze")])
def test_preference_stages_train_lora_only(workdir: Path, stage: str, method: str) -> None:
    # the reference policy is the model with its adapter disabled; a full model has none (it crashed in TRL)
    text = problems_of(minimal(stage=stage, finetuning_type=method))
    assert (
        f"finetuning_type: got '{method}' with stage '{stage}'" in text and "Use finetuning_type lora" in text
    )
