"""LoRA experts in a trainer's checkpoints: a mixin shared by ``MoetuneTrainer`` (sft, pt) and TRL's DPO/KTO
trainers (``moetune.train.stages.trl_trainers``); no library class is patched.

PEFT saves and loads the adapter in every checkpoint but does not know the LoRA experts
(``moetune.adapters.lora_experts``), so ``_save`` writes ``moetune_lora_experts.safetensors`` beside the adapter
(inside the staged checkpoint folder, ``moetune.train.checkpoints``, so atomic with it), and resume and
``load_best_model_at_end`` restore them after PEFT's ``load_adapter``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetune.adapters.lora_experts import FILE_NAME as LORA_EXPERTS_FILE
from moetune.adapters.lora_experts import spec_of, write_lora_experts
from moetune.adapters.save import restore_lora_experts
from moetune.atomic import write_atomically


class LoraExpertsCheckpoints:
    """Mixin placed before the ``Trainer`` class in the bases: the model's LoRA experts go into every save of the
    adapter and come back on resume (module docstring)."""

    # provided by the Trainer this is mixed into
    args: Any
    model: Any
    state: Any

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        super()._save(output_dir, state_dict)  # type: ignore[misc]
        model = self.model
        if self.args.should_save and spec_of(model) is not None:
            folder = Path(output_dir if output_dir is not None else self.args.output_dir)
            write_atomically(folder / LORA_EXPERTS_FILE, lambda path: write_lora_experts(model, path))

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
