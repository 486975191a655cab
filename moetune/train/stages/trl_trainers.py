"""TRL's ``DPOTrainer`` and ``KTOTrainer`` as moetune runs them: subclasses, no TRL class patched.

Three things differ from stock TRL:

- Checkpoints are atomic (:class:`~moetune.train.checkpoints.AtomicCheckpoints`, as for sft), hold the LoRA
  experts when the model has them (:class:`~moetune.train.lora_experts_checkpoints.LoraExpertsCheckpoints`), and
  resume across FSDP2 and DDP / one process (:class:`~moetune.train.other_kind.ResumesOtherKind`).
- Datasets tokenized by moetune's data path (``moetune.train.preference``: LLaMA-Factory's row forms, moetune's
  chat rendering, truncation and checks; what ``moetune train`` passes) skip TRL's ``_prepare_dataset`` (prompt
  extraction, tokenization); kto adds its KL completions to them as TRL does. Any other dataset (TRL's own
  ``prompt`` / ``chosen`` / ``rejected`` or ``prompt`` / ``completion`` / ``label`` rows, on the library path)
  goes through TRL's preparation unchanged.

- The reference policy is the model with its adapters disabled, never a copy. Given a ``PeftModel`` and no
  ``ref_model``, TRL 1.16's ``__init__`` adds a frozen copy of the adapter named ``ref`` (dpo_trainer.py:689,
  kto_trainer.py:740) through ``PeftModel.add_adapter`` with the live (stock-form) config, which cannot reach
  moetune's routed experts (docs/architecture.md, "Expert LoRA inside PEFT"). So the trainers hand TRL's
  ``__init__`` a weightless placeholder as ``ref_model`` and set ``ref_model`` back to None once it returns;
  from then on TRL computes every reference log-probability on its own PEFT path, ``use_adapter(model, None)``
  = ``PeftModel.disable_adapter()``, which switches the routed experts' LoRA off too
  (``moetune.adapters.expert_layer``) and the LoRA experts (``moetune.adapters.lora_experts``, which follow PEFT's
  adapter switch). For a fresh adapter (B = 0) that is the same function as the copy TRL
  would have made, with no second set of LoRA weights and no second copy of anything.
"""

from __future__ import annotations

from typing import Any

import torch
from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

from moetune.train.checkpoints import AtomicCheckpoints
from moetune.train.data import PreparedData
from moetune.train.guards import GuardedSteps
from moetune.train.host_grads import AveragesHostGrads
from moetune.train.lora_experts_checkpoints import LoraExpertsCheckpoints
from moetune.train.other_kind import ResumesOtherKind
from moetune.train.sharded_lora import ShardsExpertLora

DPO_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")
KTO_COLUMNS = ("prompt_ids", "completion_ids", "label")


class _ReferencePlaceholder(torch.nn.Module):
    """Stands in for ``ref_model`` while TRL's ``__init__`` runs (it patches a fused LM head onto it and moves
    it to the device: it has no weights); never called."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config  # add_fused_lm_head reads the text config

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(
            "the reference placeholder was called; the reference is the adapter-disabled model"
        )


class AdapterDisabledReference:
    """Mixin for TRL's preference trainers: the reference policy is the trained ``PeftModel`` with its adapters
    disabled (see the module docstring for why the placeholder)."""

    ref_model: Any

    def __init__(self, *args: Any, model: Any, **kwargs: Any) -> None:
        super().__init__(*args, model=model, ref_model=_ReferencePlaceholder(model.config), **kwargs)  # type: ignore[call-arg]
        self.ref_model = None  # TRL's PEFT path from here on: use_adapter(model, None)


def _tokenized(dataset: Any, columns: tuple[str, ...]) -> bool:
    """True for a dataset of moetune's token columns (``moetune.train.preference``)."""
    return set(columns) <= set(getattr(dataset, "column_names", None) or ())


class MoetuneDPOTrainer(
    GuardedSteps,
    AveragesHostGrads,
    AtomicCheckpoints,
    ResumesOtherKind,
    LoraExpertsCheckpoints,
    AdapterDisabledReference,
    ShardsExpertLora,
    DPOTrainer,
):
    """TRL's ``DPOTrainer`` for a moetune ``PeftModel``: the reference is the model with its adapters disabled,
    checkpoints are atomic, and moetune-tokenized pairs skip TRL's tokenization."""

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        if _tokenized(dataset, DPO_COLUMNS):
            return dataset
        return super()._prepare_dataset(dataset, processing_class, args, dataset_name)


class MoetuneKTOTrainer(
    GuardedSteps,
    AveragesHostGrads,
    AtomicCheckpoints,
    ResumesOtherKind,
    LoraExpertsCheckpoints,
    AdapterDisabledReference,
    ShardsExpertLora,
    KTOTrainer,
):
    """TRL's ``KTOTrainer`` for a moetune ``PeftModel``: the reference is the model with its adapters disabled,
    checkpoints are atomic, and moetune-tokenized rows skip TRL's tokenization."""

    calculate_KL: bool  # set by KTOTrainer.__init__ before it prepares the datasets

    def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
        if not _tokenized(dataset, KTO_COLUMNS):
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)
        if not self.calculate_KL:
            return dataset
        # as TRL pairs them: within each batch of per_device_train_batch_size rows (the sampler is sequential),
        # row i's prompt with row i-1's completion estimates the KL term
        return dataset.map(
            _rotate_completions,
            batched=True,
            batch_size=args.per_device_train_batch_size,
            desc=f"KL completions for {dataset_name}",
        )


def _rotate_completions(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    completions = batch["completion_ids"]
    return {"KL_completion_ids": [completions[-1], *completions[:-1]]}


# stage -> (trainer, TRL config class)
PREFERENCE_TRAINERS: dict[str, tuple[type, type]] = {
    "dpo": (MoetuneDPOTrainer, DPOConfig),
    "kto": (MoetuneKTOTrainer, KTOConfig),
}


def build_preference_trainer(
    stage: str, args: dict[str, Any], model: Any, tokenizer: Any, data: PreparedData, callbacks: list[Any]
) -> Any:
    """The trainer of preference ``stage`` over moetune-tokenized data; ``args`` are TRL config keywords.

    The rows are truncated already (``max_length=None``: the collator cuts nothing); the router's auxiliary
    loss stays off (``router_aux_loss_coef=0``), as in sft and LLaMA-Factory's preference trainers.
    """
    trainer, config = PREFERENCE_TRAINERS[stage]
    return trainer(
        model=model,
        args=config(**args, max_length=None, router_aux_loss_coef=0.0),
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
