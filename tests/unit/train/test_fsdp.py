"""FSDP2 settings (``moetune.train.fsdp``): the forms users write are read, what moetune cannot do is refused by
name before the model loads, ``deepspeed`` ZeRO stages map to FSDP2 or DDP, and a checkpoint of the other kind
is resumed unless the expert LoRA is sharded by rows. The multi-process runs are in ``tests/slow/test_dist_fsdp.py``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from moetune.config import parse_config, training_arguments_kwargs
from moetune.errors import ConfigError
from moetune.train.fsdp import fsdp_plugin, other_kind, unsharded
from tests.unit.config.test_config import minimal, problems_of, workdir  # noqa: F401  (workdir: a fixture)


@pytest.fixture(autouse=True)
def _restore_fsdp_variable(monkeypatch) -> None:
    # TrainingArguments with fsdp writes FSDP_CPU_RAM_EFFICIENT_LOADING into os.environ: put back after each test
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")


def _plugin_error(world: int = 2, **keys) -> str:
    with pytest.raises(ConfigError) as info:
        fsdp_plugin(parse_config(minimal(**keys)), world)
    return str(info.value)


@pytest.mark.usefixtures("workdir")
@pytest.mark.parametrize(
    "keys",
    [
        {"fsdp": True},
        {"fsdp": "full_shard auto_wrap"},  # LLaMA-Factory's form
        {
            "fsdp": True,
            "fsdp_config": {"fsdp_version": 2, "fsdp_reshard_after_forward": False},
        },  # accelerate's keys
    ],
)
def test_fsdp2_in_the_forms_users_write(keys) -> None:
    plugin = fsdp_plugin(parse_config(minimal(**keys)), 2)
    assert plugin.fsdp_version == 2
    assert plugin.ignored_modules is None  # set by attach_fsdp, to the routed experts of the live model


@pytest.mark.usefixtures("workdir")
def test_no_fsdp_and_one_process(caplog) -> None:
    assert fsdp_plugin(parse_config(minimal()), 2) is None
    assert fsdp_plugin(parse_config(minimal(fsdp=False)), 2) is None
    cfg = parse_config(minimal(fsdp=True))
    with caplog.at_level(logging.WARNING):
        assert fsdp_plugin(cfg, 1) is None
    assert "one process, nothing to shard" in caplog.text
    args = training_arguments_kwargs(cfg)
    assert args["fsdp"] is True and "fsdp" not in unsharded(args, 1) and unsharded(args, 2) is args


@pytest.mark.usefixtures("workdir")
@pytest.mark.parametrize(
    ("fsdp_config", "named"),
    [
        ({"version": 1}, "fsdp_version 1"),
        ({"cpu_ram_efficient_loading": True}, "cpu_ram_efficient_loading"),
        ({"cpu_offload": True}, "offload"),
        ({"activation_checkpointing": True}, "use gradient_checkpointing"),
        ({"state_dict_type": "SHARDED_STATE_DICT"}, "state_dict_type"),
    ],
)
def test_refused_settings_are_named(fsdp_config, named) -> None:
    message = _plugin_error(fsdp=True, fsdp_config=fsdp_config)
    assert "fsdp / fsdp_config" in message and named in message


@pytest.mark.usefixtures("workdir")
@pytest.mark.parametrize(
    ("fsdp_config", "named"),
    [
        # accelerate's spelling of the offload: transformers does not read it, so the run went on without a word
        (
            {"fsdp_version": 2, "offload_params": True},
            "fsdp_config.offload_params: moetune refuses any offload",
        ),
        (
            {"fsdp_version": 2, "fsdp_offload_params": True},
            "fsdp_config.fsdp_offload_params: moetune refuses",
        ),
        ({"fsdp_version": 2, "foo_bar": 3}, "fsdp_config.foo_bar: is not a key transformers reads"),
        ({"xla": True}, "fsdp_config.xla: XLA's FSDP"),
    ],
)
def test_keys_transformers_would_not_read_are_config_errors(fsdp_config, named) -> None:
    assert named in problems_of(minimal(fsdp=True, fsdp_config=fsdp_config))


@pytest.mark.usefixtures("workdir")
def test_building_the_arguments_leaves_the_config_as_written() -> None:
    """transformers' TrainingArguments rewrites the fsdp_config mapping it is given (prefixes stripped, its own
    keys added); the config's own stays as the YAML wrote it, for every later build and reader."""
    from transformers import TrainingArguments

    written = {"fsdp_version": 2, "fsdp_reshard_after_forward": False}
    config = parse_config(minimal(fsdp=True, fsdp_config=dict(written)))
    first = training_arguments_kwargs(config)
    TrainingArguments(**first)
    assert first["fsdp_config"] != written  # transformers did rewrite what it was handed
    assert dict(config.training.extra_args)["fsdp_config"] == written
    assert training_arguments_kwargs(config)["fsdp_config"] == written


@pytest.mark.usefixtures("workdir")
def test_fsdp_config_from_a_json_file_and_without_fsdp(tmp_path) -> None:
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps({"fsdp_version": 2, "fsdp_reshard_after_forward": False}))
    bad.write_text(json.dumps({"fsdp_version": 2, "fsdp_sharding_strategy": "FULL_SHARD"}))
    assert fsdp_plugin(parse_config(minimal(fsdp=True, fsdp_config=str(good))), 2).fsdp_version == 2
    assert "fsdp_config.fsdp_sharding_strategy: is not a key" in problems_of(
        minimal(fsdp=True, fsdp_config=str(bad))
    )
    assert "fsdp_config: is set but fsdp is not" in problems_of(minimal(fsdp_config={"version": 2}))


@pytest.mark.usefixtures("workdir")
@pytest.mark.parametrize(
    "keys",
    [
        {"finetuning_type": "full"},
        {"finetuning_type": "freeze"},
        {"lora_experts": 2, "lora_expert_intermediate_size": 8},
    ],
)
def test_full_freeze_and_lora_experts_shard_the_dense_part(keys) -> None:
    # refused before: the routed experts' full-mode weights and the LoRA experts now stay out of FSDP2
    assert fsdp_plugin(parse_config(minimal(fsdp=True, **keys)), 2).fsdp_version == 2


@pytest.mark.parametrize(("stage", "reshard"), [(3, True), (2, False), (1, None), (0, None)])
@pytest.mark.usefixtures("workdir")
def test_deepspeed_zero_stage_maps_to_fsdp2_or_ddp(caplog, stage, reshard) -> None:
    Path("ds.json").write_text(json.dumps({"zero_optimization": {"stage": stage}}))
    with caplog.at_level(logging.WARNING):
        cfg = parse_config(minimal(deepspeed="ds.json"))
    args = training_arguments_kwargs(cfg)
    if reshard is None:
        assert "fsdp" not in args and "as DDP" in caplog.text
    else:
        assert args["fsdp"] is True and args["fsdp_config"]["reshard_after_forward"] is reshard
        assert fsdp_plugin(cfg, 2).reshard_after_forward is reshard
        assert "as FSDP2" in caplog.text


@pytest.mark.parametrize("finetuning_type", ["full", "freeze"])
@pytest.mark.usefixtures("workdir")
def test_deepspeed_zero3_with_full_or_freeze_runs_fsdp2(caplog, finetuning_type) -> None:
    """LLaMA-Factory's full-SFT example names ds_z3_config.json: the dense part is then fully sharded (FSDP2), as
    in a LoRA run (it took DDP before)."""
    Path("ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with caplog.at_level(logging.WARNING):
        cfg = parse_config(minimal(deepspeed="ds.json", finetuning_type=finetuning_type))
    assert training_arguments_kwargs(cfg)["fsdp"] is True
    assert fsdp_plugin(cfg, 2).reshard_after_forward is True
    assert "as FSDP2" in caplog.text


@pytest.mark.usefixtures("workdir")
def test_deepspeed_with_fsdp_refused() -> None:
    Path("ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="deepspeed: is given with fsdp"):
        parse_config(minimal(deepspeed="ds.json", fsdp=True))


def test_checkpoint_kind(tmp_path: Path) -> None:
    # a LoRA checkpoint of the other kind is converted on resume (tests/unit/train/test_fsdp_convert.py), the
    # expert LoRA's rows files included
    fsdp_ckpt, ddp_ckpt = tmp_path / "fsdp", tmp_path / "ddp"
    fsdp_ckpt.mkdir()
    ddp_ckpt.mkdir()
    (fsdp_ckpt / "pytorch_model_fsdp.bin").write_bytes(b"")
    (fsdp_ckpt / "optimizer.bin").write_bytes(b"")
    (ddp_ckpt / "optimizer.pt").write_bytes(b"")
    assert other_kind(fsdp_ckpt, fsdp=False) and other_kind(ddp_ckpt, fsdp=True)
    assert not other_kind(fsdp_ckpt, fsdp=True) and not other_kind(ddp_ckpt, fsdp=False)


@pytest.mark.usefixtures("workdir")
def test_accelerate_launch_fsdp_variables(monkeypatch) -> None:
    # what `accelerate launch --use_fsdp ...` hands its processes; accelerate's CLI defaults are refused by name
    cfg = parse_config(minimal())
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.delenv("FSDP_VERSION", raising=False)
    with pytest.raises(ConfigError, match="ACCELERATE_USE_FSDP.*fsdp_version 1"):
        fsdp_plugin(cfg, 2)
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT")
    with pytest.raises(ConfigError) as info:
        fsdp_plugin(cfg, 2)
    assert "cpu_ram_efficient_loading" in str(info.value) and "state_dict_type" in str(info.value)
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    monkeypatch.setenv("FSDP_STATE_DICT_TYPE", "FULL_STATE_DICT")
    assert fsdp_plugin(cfg, 2).fsdp_version == 2
