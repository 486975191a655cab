"""Stage ``pt``: continued pre-training on plain text, no chat template, loss on every token.

Rows: ``moetune.train.data.TEXT``: one text per row, from the ``text`` column or the column dataset_info.json
maps as ``prompt`` (LLaMA-Factory's pre-training entries), with the tokenizer's BOS/EOS added. The trainer is
sft's: the difference between the stages is only which tokens carry labels.
"""

from __future__ import annotations

from moetune.train.data import TEXT
from moetune.train.stages import sft
from moetune.train.stages.base import STAGES, TrainingStage

STAGES.register("pt")(TrainingStage(TEXT, sft.build_trainer))
