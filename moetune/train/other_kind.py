"""Resuming a LoRA checkpoint of the other kind (written under FSDP2 by a run without it, or the reverse): a mixin
shared by ``MoetuneTrainer`` (sft, pt) and TRL's DPO/KTO trainers (``moetune.train.stages.trl_trainers``); no
library class is patched.

transformers' Trainer refuses FSDP's ``pytorch_model_fsdp.bin`` without FSDP, and accelerate reads only its own
files under it, so a run of one kind could not resume the other's checkpoint. Both kinds write the same stock
adapter file, so the weights come from it (cut to this rank's shards under FSDP2: ``fsdp.load_adapter_sharded``),
the LoRA experts from theirs, and the optimizer state is converted as it is read (``fsdp.load_optimizer_whole``:
FSDP's ``optimizer.bin`` by parameter name, DDP's or one process's ``optimizer.pt`` by position, the expert LoRA's
per-rank rows put together). Without FSDP every LoRA checkpoint, of either kind, loads through moetune's
``load_adapter_weights`` (PEFT's own ``load_adapter`` renames some families' saved keys and drops them). Full/freeze
checkpoints (written layer by layer) are ``MoetuneTrainer``'s own.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from peft import PeftModel
from transformers.trainer import SCHEDULER_NAME

from moetune.adapters.save import load_adapter_weights, restore_lora_experts
from moetune.train.fsdp import load_adapter_sharded, load_optimizer_whole, other_kind


class ResumesOtherKind:
    """Mixin placed before ``LoraExpertsCheckpoints`` and the ``Trainer`` class in the bases: a LoRA checkpoint of
    the other kind (``fsdp.other_kind``) resumes, weights and optimizer state converted (module docstring); any
    other checkpoint goes to the next class."""

    # provided by the Trainer this is mixed into
    model: Any
    optimizer: Any
    lr_scheduler: Any
    is_fsdp_enabled: bool

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        target = model if model is not None else self.model
        if isinstance(target, PeftModel) and not self.is_fsdp_enabled:
            # a checkpoint of either kind (both write the stock adapter file) by moetune's loader, the LoRA experts
            # with it; not the Trainer's PeftModel.load_adapter, through which PEFT renames some families' saved
            # keys by transformers' conversion and drops them with a warning (adapters.save.put_adapter_state)
            load_adapter_weights(target, resume_from_checkpoint)
            return
        if not (isinstance(target, PeftModel) and other_kind(resume_from_checkpoint, self.is_fsdp_enabled)):
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
            return
        # under FSDP2 a checkpoint of the other kind: its stock adapter cut to shards; the LoRA experts from their file
        load_adapter_sharded(target, resume_from_checkpoint)
        restore_lora_experts(target, resume_from_checkpoint, attach=False)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not other_kind(checkpoint, self.is_fsdp_enabled):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        assert self.optimizer is not None and self.lr_scheduler is not None
        # FSDP's optimizer.bin, or DDP's optimizer.pt
        load_optimizer_whole(self.optimizer, self.model, checkpoint)
        load_scheduler(self.lr_scheduler, checkpoint)


def load_scheduler(lr_scheduler: Any, checkpoint: str) -> None:
    """The checkpoint's learning-rate scheduler state, as the Trainer's own ``_load_optimizer_and_scheduler`` reads
    it: for the overrides that load the optimizer state themselves (here, and ``MoetuneTrainer``'s layer files)."""
    lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))
