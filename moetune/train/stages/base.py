"""The stage registry: LLaMA-Factory's ``stage`` name -> how its rows become examples and which trainer runs.

Every stage trains the same PEFT model (attention/dense LoRA and the routed experts' LoRA in the CPU engine)
and saves the same stock-PEFT adapter; only the data codec and the trainer's loss differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from moetune.config import MoetuneConfig
from moetune.registry import Registry
from moetune.train.data import PreparedData, RowCodec

# (config, peft model, tokenizer, prepared data, TrainingArguments keyword arguments, callbacks) -> a trainer
BuildTrainer = Callable[[MoetuneConfig, Any, Any, PreparedData, dict[str, Any], list[Any]], Any]


@dataclass(frozen=True)
class TrainingStage:
    """One stage: the codec its datasets are read with and the builder of its trainer.

    ``requires`` names the packages the trainer imports beyond transformers/PEFT (checked before the model
    loads, so a missing one costs no load time).
    """

    codec: RowCodec
    build_trainer: BuildTrainer
    requires: tuple[str, ...] = ()


STAGES: Registry[TrainingStage] = Registry("training stage")


def preference_builder(stage: str, arguments: Callable[[MoetuneConfig], dict[str, Any]]) -> BuildTrainer:
    """The builder of TRL's trainer for preference ``stage`` (``trl_trainers.PREFERENCE_TRAINERS``): TRL's config
    from the run's ``TrainingArguments`` keywords plus ``arguments(cfg)`` (the stage's keys). TRL is imported
    only when the trainer is built."""

    def build(
        cfg: MoetuneConfig,
        model: Any,
        tokenizer: Any,
        data: PreparedData,
        args: dict[str, Any],
        callbacks: list[Any],
    ) -> Any:
        from moetune.train.stages.trl_trainers import build_preference_trainer

        return build_preference_trainer(stage, {**args, **arguments(cfg)}, model, tokenizer, data, callbacks)

    return build
