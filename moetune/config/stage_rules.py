"""What each training stage reads from its datasets, and the keys that only some stages use.

Checked with every other config problem, before anything loads: a key set for a stage that does not read it
is reported (it would do nothing), and so is a dataset whose kind does not fit the stage (LLaMA-Factory's
``ranking`` datasets are for dpo only; kto needs a ``kto_tag`` column; pt reads one text per row).
"""

from __future__ import annotations

from moetune.config.datasets import DataFormat, DatasetSpec, RowKind
from moetune.config.fields import Problems
from moetune.config.schema import DataConfig, FinetuneConfig, FinetuningType, Stage, TrainingConfig

# the rows each stage reads (moetune.train.stages registers a trainer per stage)
STAGE_ROWS: dict[Stage, RowKind] = {
    Stage.SFT: RowKind.SUPERVISED,
    Stage.PT: RowKind.TEXT,
    Stage.DPO: RowKind.PAIRED,
    Stage.KTO: RowKind.UNPAIRED,
}

# finetune keys read by some stages only -> those stages
_STAGE_KEYS: dict[str, tuple[Stage, ...]] = {
    "pref_beta": (Stage.DPO, Stage.KTO),
    "pref_ftx": (Stage.DPO,),
    "pref_loss": (Stage.DPO,),
    "kto_chosen_weight": (Stage.KTO,),
    "kto_rejected_weight": (Stage.KTO,),
}
# data keys that preference stages cannot honour: they compare whole responses, one pair or row at a time
_NOT_FOR_PREFERENCE = ("packing", "train_on_prompt", "mask_history")
# data keys of chat rendering, which plain text (pt) never goes through
_CHAT_KEYS = ("template", "default_system", "enable_thinking", "train_on_prompt", "mask_history")


def check_stage(
    finetune: FinetuneConfig, data: DataConfig, training: TrainingConfig, problems: Problems
) -> None:
    """Report keys set for another stage and datasets that do not fit ``finetune.stage``."""
    stage = finetune.stage
    defaults = FinetuneConfig()
    for key, stages in _STAGE_KEYS.items():
        if stage not in stages and getattr(finetune, key) != getattr(defaults, key) and not problems.has(key):
            problems.add(
                key,
                f"is set but stage is {stage.value!r}; it applies to stage {' / '.join(s.value for s in stages)} "
                f"only: remove it or change stage",
            )
    kind = STAGE_ROWS[stage]
    if kind in (RowKind.PAIRED, RowKind.UNPAIRED) and finetune.finetuning_type is not FinetuningType.LORA:
        problems.add(
            "finetuning_type",
            f"got {finetune.finetuning_type.value!r} with stage {stage.value!r}: the reference policy is the model "
            "with its adapter disabled, so preference stages train LoRA; full/freeze would need a second whole "
            "copy of the model as the reference. Use finetuning_type lora (LoRA experts and modules_to_save too)",
        )
    if kind in (RowKind.PAIRED, RowKind.UNPAIRED):
        for key in _NOT_FOR_PREFERENCE:
            if getattr(data, key):
                problems.add(
                    key,
                    f"is true but stage {stage.value!r} scores whole responses, one example at a time "
                    f"(no packing, no prompt or history tokens trained); remove it",
                )
    if kind is RowKind.TEXT:
        for key in _CHAT_KEYS:
            if getattr(data, key) not in (None, False):
                problems.add(
                    key,
                    "is set but stage 'pt' trains on plain text with no chat template (every token trained); "
                    "remove it",
                )
    if stage is Stage.KTO and training.per_device_train_batch_size < 2:
        problems.add(
            "per_device_train_batch_size",
            f"is {training.per_device_train_batch_size}, but stage kto estimates its KL term from the other rows "
            f"of a batch (TRL's KTOTrainer); set it to 2 or more",
        )
    for key, specs in (("dataset", data.train_sources), ("eval_dataset", data.eval_sources)):
        for spec in specs:
            message = _dataset_problem(spec, stage, kind)
            if message:
                problems.add(key, message)


def _dataset_problem(spec: DatasetSpec, stage: Stage, kind: RowKind) -> str | None:
    if kind is RowKind.PAIRED and not spec.ranking:
        return (
            f"dataset {spec.name!r} is not a preference dataset, and stage dpo trains on chosen/rejected pairs; "
            f'register it in dataset_info.json with "ranking": true and its chosen/rejected columns'
        )
    if kind is not RowKind.PAIRED and spec.ranking:
        return (
            f"dataset {spec.name!r} is a preference dataset (ranking: true), which only stage dpo reads; "
            f"set stage: dpo or choose another dataset"
        )
    if kind is not RowKind.UNPAIRED and "kto_tag" in spec.columns:
        return (
            f"dataset {spec.name!r} maps a kto_tag column, which only stage kto reads; set stage: kto or "
            f"remove the mapping"
        )
    if kind is RowKind.TEXT and spec.formatting not in (None, DataFormat.TEXT, DataFormat.ALPACA):
        assert spec.formatting is not None
        return (
            f"dataset {spec.name!r} has formatting {spec.formatting.value!r}, and stage {stage.value} reads one "
            f"plain text per row (a 'text' column, or the column mapped as 'prompt'); drop 'formatting'"
        )
    return None
