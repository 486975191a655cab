"""The LoRA-experts keys: moetune's own, KTransformers' and LLaMA-Factory's spellings, and the rules between them
and the rest of the config, all checked before anything loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from moetune.config import load_config, parse_config
from tests.unit.config.test_config import minimal, problems_of, workdir  # noqa: F401  (workdir: a fixture)

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.usefixtures("workdir")


def _sizes(raw: dict[str, Any]) -> tuple[Any, Any]:
    ft = parse_config(raw).finetune
    return ft.lora_experts, ft.lora_expert_intermediate_size


def test_moetune_keys_and_the_other_spellings_mean_the_same() -> None:
    assert _sizes(minimal()) == (None, None)
    assert _sizes(minimal(lora_experts=2, lora_expert_intermediate_size=16)) == (2, 16)
    kt = {"kt_use_lora_experts": True, "kt_lora_expert_num": 2, "kt_lora_expert_intermediate_size": 16}
    assert _sizes(minimal(use_kt=True, **kt)) == (2, 16)
    assert _sizes(minimal(use_kt=True, kt_config=kt)) == (2, 16)
    lf = {"use_lora_expert": True, "lora_expert_num": 2, "lora_expert_intermediate_size": 16}
    assert _sizes(minimal(**lf)) == (2, 16)
    assert _sizes(minimal(kt_use_lora_experts=False, use_lora_expert=False)) == (None, None)


@pytest.mark.parametrize("stage", ["pt", "dpo", "kto"])
def test_every_stage_takes_lora_experts(stage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """dpo and kto too (their reference pass switches the LoRA experts off with the adapter): the shipped
    example of each stage with LoRA experts added."""
    import yaml

    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    raw = yaml.safe_load((ROOT / "examples" / f"{stage}_lora.yaml").read_text())
    cfg = parse_config({**raw, "lora_experts": 2, "lora_expert_intermediate_size": 8}, check_model_path=False)
    assert (cfg.finetune.lora_experts, cfg.finetune.lora_expert_intermediate_size) == (2, 8)


@pytest.mark.parametrize(
    ("keys", "key", "message"),
    [
        ({"lora_experts": 0, "lora_expert_intermediate_size": 8}, "lora_experts", "must be > 0"),
        (
            {"lora_experts": 2, "lora_expert_intermediate_size": 0},
            "lora_expert_intermediate_size",
            "must be > 0",
        ),
        (
            {"lora_experts": 2},
            "lora_experts",
            "lora_expert_intermediate_size (each LoRA expert's width) is not set",
        ),
        ({"lora_expert_intermediate_size": 8}, "lora_expert_intermediate_size", "lora_experts is not"),
        (
            {"lora_experts": 2, "lora_expert_intermediate_size": 8, "finetuning_type": "full"},
            "lora_experts",
            "need finetuning_type: lora",
        ),
        ({"kt_lora_expert_num": 2}, "kt_lora_expert_num", "kt_use_lora_experts is not true"),
        ({"kt_use_lora_experts": True}, "kt_use_lora_experts", "kt_lora_expert_num (how many LoRA experts)"),
        ({"kt_use_lora_experts": "yes"}, "kt_use_lora_experts", "expected true or false"),
        ({"lora_expert_num": 2}, "lora_expert_num", "use_lora_expert is not true"),
        (
            {
                "lora_experts": 3,
                "use_lora_expert": True,
                "lora_expert_num": 2,
                "lora_expert_intermediate_size": 8,
            },
            "lora_expert_num",
            "lora_experts is already 3",
        ),
    ],
)
def test_inconsistent_keys_are_refused_by_name(keys: dict, key: str, message: str) -> None:
    text = problems_of(minimal(**keys))
    assert f"- {key}: " in text and message in text, text


def test_shipped_example_asks_for_lora_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # its paths are relative to the repository root
    cfg = load_config(ROOT / "examples" / "demo_lora_experts.yaml", check_model_path=False)
    assert (cfg.finetune.lora_experts, cfg.finetune.lora_expert_intermediate_size) == (2, 16)
