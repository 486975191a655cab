"""Mode resolution (moetune.train.modes) and its config keys: LLaMA-Factory's freeze rules on a model built on
the meta device, and every contradictory setting refused with the key and value before a weight is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moetune.config import FinetuningType
from moetune.config.load import parse_config
from moetune.errors import ConfigError
from moetune.train.modes import ModeSettings, check_mode, freeze_selection


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.json").write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({"a": {"file_name": "a.json"}}))
    return tmp_path


def _cfg(**keys: Any):
    return parse_config({"model_name_or_path": "model", "dataset": "a", "output_dir": "out", **keys})


def _problems(**keys: Any) -> str:
    with pytest.raises(ConfigError) as info:
        _cfg(**keys)
    return str(info.value)


def test_llamafactory_freeze_keys_parse(workdir: Path) -> None:
    cfg = _cfg(
        finetuning_type="freeze",
        freeze_trainable_layers=-2,
        freeze_trainable_modules="mlp,self_attn",
        freeze_extra_modules="embed_tokens,norm",
    )
    settings = ModeSettings.from_config(cfg.finetune, bf16=True)
    assert settings == ModeSettings(
        FinetuningType.FREEZE, -2, ("mlp", "self_attn"), ("embed_tokens", "norm"), (), upcast=True
    )
    assert _cfg(finetuning_type="full").finetune.finetuning_type is FinetuningType.FULL
    pure = _cfg(finetuning_type="full", pure_bf16=True, bf16=True).finetune
    assert ModeSettings.from_config(pure, bf16=True).upcast is False  # bf16 weights, grads and AdamW moments
    assert _cfg(additional_target="gate").finetune.additional_target == ("gate",)


@pytest.mark.parametrize(
    ("keys", "key", "message"),
    [
        ({"freeze_trainable_layers": 4}, "freeze_trainable_layers", "applies to finetuning_type: freeze"),
        ({"freeze_extra_modules": "norm"}, "freeze_extra_modules", "but finetuning_type is lora"),
        ({"finetuning_type": "full", "additional_target": "gate"}, "additional_target", "full trains every"),
        (
            {"finetuning_type": "freeze", "additional_target": "gate"},
            "additional_target",
            "freeze_extra_modules",
        ),
    ],
)
def test_contradictory_mode_keys_are_refused(workdir: Path, keys: dict, key: str, message: str) -> None:
    text = _problems(**keys)
    assert f"- {key}: " in text and message in text


@pytest.fixture(scope="module")
def meta_qwen():
    """Tiny Qwen3-MoE on the meta device: 3 decoder layers, layer 1 a dense MLP, routed experts in 0 and 2."""
    from transformers import AutoModelForCausalLM

    from moetune.testing.tiny import tiny_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"))


def _freeze(**kw: Any) -> ModeSettings:
    return ModeSettings(FinetuningType.FREEZE, **kw)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"trainable_layers": 1}, ["model.layers.2"]),  # > 0: the last N layers
        ({"trainable_layers": -2}, ["model.layers.0", "model.layers.1"]),  # < 0: the first N
        ({"trainable_layers": 3}, ["model.layers.0", "model.layers.1", "model.layers.2"]),
        (
            {"trainable_layers": 1, "trainable_modules": ("mlp.experts", "self_attn")},
            ["model.layers.2.mlp.experts", "model.layers.2.self_attn"],
        ),
        (
            {"trainable_layers": -1, "extra_modules": ("norm", "lm_head")},
            ["model.layers.0", "model.norm", "lm_head"],
        ),
    ],
)
def test_freeze_selection_follows_llamafactory(meta_qwen, kw: dict, expected: list[str]) -> None:
    assert sorted(freeze_selection(meta_qwen, _freeze(**kw))) == sorted(expected)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"trainable_layers": 4},
            "freeze_trainable_layers: 4 is out of range for this model's 3 decoder layers",
        ),
        ({"trainable_layers": -5}, "allowed: 1..3 (the last N layers) or -3..-1"),
        (
            {"trainable_layers": 0},
            "freeze_trainable_layers: 0 is out of range for this model's 3 decoder layers",
        ),
        (
            {"trainable_layers": 2, "trainable_modules": ("mlp.experts",)},
            "not a module of decoder layer(s) [1]",
        ),
        ({"trainable_modules": ("ffn",)}, "allowed: all, or a module below the layer"),
        ({"extra_modules": ("vision_tower",)}, "freeze_extra_modules: 'vision_tower' names no module"),
    ],
)
def test_bad_freeze_settings_name_key_and_value(meta_qwen, kw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        freeze_selection(meta_qwen, _freeze(**kw))
    assert message in str(info.value)


def test_full_and_freeze_refuse_quantized_experts_and_lora_refuses_experts_as_additional_target(
    meta_qwen,
) -> None:
    sites = ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]
    check_mode(meta_qwen, ModeSettings(FinetuningType.FULL), ["dense", "dense"], sites)
    for method in (FinetuningType.FULL, FinetuningType.FREEZE):
        with pytest.raises(
            ConfigError, match=r"(?s)finetuning_type: \w+ trains .*model\.layers\.2\.mlp\.experts \(int4\)"
        ):
            check_mode(
                meta_qwen,
                _freeze() if method is FinetuningType.FREEZE else ModeSettings(method),
                ["dense", "int4"],
                sites,
            )
    check_mode(meta_qwen, ModeSettings(FinetuningType.LORA, additional=("gate",)), ["int4", "int4"], sites)
    with pytest.raises(
        ConfigError, match=r"additional_target: \['router'\] matched no module of Qwen3MoeForCausalLM"
    ):
        check_mode(
            meta_qwen, ModeSettings(FinetuningType.LORA, additional=("router",)), ["dense", "dense"], sites
        )
    with pytest.raises(ConfigError, match="additional_target: .*includes routed experts"):
        check_mode(
            meta_qwen, ModeSettings(FinetuningType.LORA, additional=("mlp",)), ["dense", "dense"], sites
        )


def test_full_mode_on_int8_experts_is_refused_before_any_weight_is_read(tmp_path) -> None:
    """check_mode_before_load plans the load on the meta device (headers and config only)."""
    from moetune.config.experts import ExpertOptions
    from moetune.testing.tiny import save_tiny_model
    from moetune.train.modes import check_mode_before_load

    path = save_tiny_model("qwen3_moe", tmp_path / "m", tokenizer=False)
    with pytest.raises(ConfigError, match="expert_format: dense"):
        check_mode_before_load(
            str(path), ExpertOptions.create(expert_format="int8"), ModeSettings(FinetuningType.FULL), False
        )
    check_mode_before_load(str(path), ExpertOptions.create(), ModeSettings(FinetuningType.FULL), False)
