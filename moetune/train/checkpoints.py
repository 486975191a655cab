"""Atomic checkpoints for every trainer moetune runs (transformers' ``Trainer`` and TRL's DPO/KTO trainers).

The trainer's own ``_save_checkpoint`` (adapter, optimizer, scheduler, RNG, trainer state, rotation) writes
``checkpoint-N`` inside a staging folder ``tmp-checkpoint-N/`` and only the complete folder is renamed into
place, so a crash mid-save leaves no ``checkpoint-N`` for ``resume_from_checkpoint`` (transformers'
``get_last_checkpoint`` matches ``checkpoint-N`` only). With several processes every rank writes its own files
(``rng_state_R.pth``) into the staging and the main process renames it once all have. transformers 5.24 has no such mechanism of its own: it
writes into ``checkpoint-N`` file by file.

:class:`AtomicCheckpoints` is a mixin placed before the trainer class in the bases
(``class T(AtomicCheckpoints, Trainer)``), so TRL's ``_save_checkpoint`` overrides (model cards) run inside
the staging as well.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from moetune.atomic import replace_folder

STAGING_PREFIX = "tmp-"  # tmp-checkpoint-N: matched neither by get_last_checkpoint nor by checkpoint rotation


class AtomicCheckpoints:
    """Mixin for a transformers ``Trainer`` subclass: checkpoints are staged, then renamed into place whole."""

    # the folder Trainer._save_checkpoint writes under while a checkpoint is staged
    _staging: str | None = None
    # provided by the Trainer this is mixed into
    args: Any
    state: Any
    accelerator: Any

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging if self._staging is not None else super()._get_output_dir(trial)  # type: ignore[misc]

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = super()._get_output_dir(trial)  # type: ignore[misc]
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final, staging = os.path.join(run_dir, name), os.path.join(run_dir, STAGING_PREFIX + name)
        staged = os.path.join(staging, name)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save of this step
        self.accelerator.wait_for_everyone()  # several processes: none writes into the staging before it is clean
        self._staging = staging
        try:
            # everything goes to `staged`; its own rotation sees that one checkpoint only
            super()._save_checkpoint(model, trial)  # type: ignore[misc]
            # every rank's files (rng_state_R.pth) are in `staged` before the main process renames it
            self.accelerator.wait_for_everyone()
            if self.args.should_save:
                if self.state.best_model_checkpoint == staged:  # the best is this one: record its final path
                    self.state.best_model_checkpoint = final
                    self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
                replace_folder(staged, final, aside=os.path.join(staging, "replaced"))
        finally:
            self._staging = None
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
        if self.args.should_save:
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,  # as Trainer._save_checkpoint rotates
            )
