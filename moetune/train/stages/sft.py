"""Stage ``sft``: supervised fine-tuning, loss on the trained (assistant or completion) tokens.

Rows: ``moetune.train.data.SUPERVISED`` (conversations, prompt/completion, text). Trainer: ``MoetuneTrainer``,
transformers' ``Trainer`` with atomic checkpoints, over ``PadCollator`` batches.
"""

from __future__ import annotations

from typing import Any

from moetune.config import MoetuneConfig
from moetune.train.data import SUPERVISED, PreparedData
from moetune.train.stages.base import STAGES, TrainingStage


def build_trainer(
    cfg: MoetuneConfig,
    model: Any,
    tokenizer: Any,
    data: PreparedData,
    args: dict[str, Any],
    callbacks: list[Any],
) -> Any:
    """A ``MoetuneTrainer``: cross-entropy on the labels the data path set (-100 elsewhere)."""
    from transformers import TrainingArguments

    from moetune.train.trainer import MoetuneTrainer

    return MoetuneTrainer(
        model=model,
        args=TrainingArguments(**args),
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=data.collator,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


STAGES.register("sft")(TrainingStage(SUPERVISED, build_trainer))
