"""Training stages, LLaMA-Factory's ``stage``: one module per stage behind one registry.

    sft  supervised fine-tuning (conversations, prompt/completion, text)       transformers Trainer
    pt   plain text, no template, loss on every token                          transformers Trainer
    dpo  chosen/rejected pairs (dataset_info.json ``ranking: true``)            TRL DPOTrainer
    kto  responses tagged desirable/undesirable (a ``kto_tag`` column)          TRL KTOTrainer

``stage_for(cfg)`` returns the :class:`TrainingStage` (data codec + trainer builder) that ``moetune train`` and
the library path use; every stage trains and saves the same stock-PEFT adapter layout.
"""

from moetune.config import MoetuneConfig
from moetune.train.stages import dpo, kto, pt, sft  # noqa: F401  (each registers its stage)
from moetune.train.stages.base import STAGES, TrainingStage


def stage_for(cfg: MoetuneConfig) -> TrainingStage:
    """The registered stage ``cfg.finetune.stage`` names."""
    return STAGES.get(cfg.finetune.stage.value)


__all__ = ["STAGES", "TrainingStage", "stage_for"]
