"""LoRA experts in a trainer's checkpoints: a mixin shared by ``MoetuneTrainer`` (sft, pt) and TRL's DPO/KTO
trainers (``moetune.train.stages.trl_trainers``); no library class is patched.

Saving needs nothing here: the Trainer saves the adapter with ``PeftModel.save_pretrained`` into the staged
checkpoint folder (``moetune.train.checkpoints``), and the live config of a model with LoRA experts writes
``moetune_lora_experts.safetensors`` there too (``moetune.adapters.lora_experts_config``). PEFT's ``load_adapter``
does not know them, so resume and ``load_best_model_at_end`` restore them after it.
"""

from __future__ import annotations

from typing import Any

from moetune.adapters.save import restore_lora_experts


class LoraExpertsCheckpoints:
    """Mixin placed before the ``Trainer`` class in the bases: the model's LoRA experts saved in a checkpoint come
    back on resume and with ``load_best_model_at_end`` (module docstring)."""

    # provided by the Trainer this is mixed into
    args: Any
    model: Any
    state: Any

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        _restore(model if model is not None else self.model, resume_from_checkpoint)

    def _load_best_model(self) -> None:
        super()._load_best_model()  # type: ignore[misc]
        _restore(self.model, self.state.best_model_checkpoint)


def _restore(model: Any, checkpoint: str) -> None:
    """A PEFT model's LoRA experts from the checkpoint (``AdapterError`` when the two disagree on having them)."""
    from peft import PeftModel

    if isinstance(model, PeftModel):
        restore_lora_experts(model, checkpoint, attach=False)
