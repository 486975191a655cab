"""Atomic checkpoints for every trainer moetune runs (transformers' ``Trainer`` and TRL's DPO/KTO trainers).

The trainer's own ``_save_checkpoint`` (adapter, optimizer, scheduler, RNG, trainer state, rotation) writes
``checkpoint-N`` inside a staging folder ``tmp-checkpoint-N/`` and only the complete folder is renamed into
place, so a crash mid-save leaves no ``checkpoint-N`` for ``resume_from_checkpoint`` (transformers'
``get_last_checkpoint`` matches ``checkpoint-N`` only). With several processes every rank writes its own files
(``rng_state_R.pth``) into the staging and the main process renames it once all have. transformers 5.24 has no such mechanism of its own: it
writes into ``checkpoint-N`` file by file. Rotation (``save_total_limit``) likewise renames each checkpoint it
drops to ``tmp-removed-checkpoint-N`` before deleting it (transformers deletes ``checkpoint-N`` in place, file by
file, so a kill there left a visible ``checkpoint-N`` without its adapter). What a kill leaves (a
``tmp-checkpoint-N``, possibly holding a previous ``checkpoint-N`` moved aside, or a ``tmp-removed-checkpoint-N``)
is undone when ``moetune train`` next starts (:func:`recover_checkpoints`).

:class:`AtomicCheckpoints` is a mixin placed before the trainer class in the bases
(``class T(AtomicCheckpoints, Trainer)``), so TRL's ``_save_checkpoint`` overrides (model cards) run inside
the staging as well.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints

from moetune.atomic import recover_folder, replace_folder

logger = logging.getLogger(__name__)

STAGING_PREFIX = "tmp-"  # tmp-checkpoint-N: matched neither by get_last_checkpoint nor by checkpoint rotation
ASIDE = "replaced"  # inside the staging: a previous checkpoint-N while the new one is renamed into place
# tmp-removed-checkpoint-N: a rotated-out checkpoint being deleted
REMOVED_PREFIX = STAGING_PREFIX + "removed-"


def recover_checkpoints(output_dir: str | os.PathLike[str]) -> list[str]:
    """Undo what a kill during a checkpoint save left in ``output_dir``; returns what was done, in words (each
    also logged by ``atomic.recover_folder``). ``moetune train`` runs it at start, before it looks for a checkpoint
    to resume from.

    Each ``tmp-checkpoint-N`` is a save that did not finish: its partial ``checkpoint-N`` inside is removed, and a
    previous ``checkpoint-N`` it had moved aside (a kill between the two renames of ``replace_folder``) is renamed
    back first, so no whole checkpoint is lost; then the staging folder itself goes (full-size leftovers would
    otherwise stay until the same step is saved again). Each ``tmp-removed-checkpoint-N`` (a rotation's delete
    that a kill cut short) is removed.
    """
    done: list[str] = []
    root = os.fspath(output_dir)
    try:
        names = sorted(os.listdir(root))
    except OSError:  # no output_dir yet (or not a readable folder: the preflight names that problem)
        return done
    staged, removing = (
        STAGING_PREFIX + PREFIX_CHECKPOINT_DIR + "-",
        REMOVED_PREFIX + PREFIX_CHECKPOINT_DIR + "-",
    )
    for name in names:
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            continue
        if name.startswith(staged):
            final = name.removeprefix(STAGING_PREFIX)
            done += recover_folder(
                os.path.join(root, final), os.path.join(path, final), os.path.join(path, ASIDE)
            )
            why = "an interrupted checkpoint save"
        elif name.startswith(removing):
            why = "a rotated-out checkpoint whose deletion was interrupted"
        else:
            continue
        shutil.rmtree(path)
        done.append(f"removed {path} ({why})")
        logger.warning("moetune: removed %s (%s)", path, why)
    return done


def rotate_checkpoints(
    run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None
) -> list[str]:
    """Keep at most ``save_total_limit`` checkpoints in ``run_dir`` (always the newest by mtime and the best), as
    transformers' ``rotate_checkpoints(..., use_mtime=True)`` chooses them, but each one dropped is first renamed
    out of sight (``tmp-removed-checkpoint-N``) and then deleted, so no half-deleted ``checkpoint-N`` is ever
    visible to ``resume_from_checkpoint``, an export or a user; returns the checkpoints dropped."""
    if save_total_limit is None or save_total_limit <= 0:
        return []
    checkpoints = sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR, use_mtime=True)
    protected = set(checkpoints[-1:])
    if best_model_checkpoint is not None:
        protected.add(str(Path(best_model_checkpoint)))
    excess = len(checkpoints) - max(save_total_limit, len(protected))
    dropped = [c for c in checkpoints if c not in protected][: max(excess, 0)]
    for checkpoint in dropped:
        removed = os.path.join(os.path.dirname(checkpoint), REMOVED_PREFIX + os.path.basename(checkpoint))
        shutil.rmtree(
            removed, ignore_errors=True
        )  # left by an earlier kill (recover_checkpoints also clears it)
        os.rename(checkpoint, removed)
        shutil.rmtree(removed, ignore_errors=True)
    return dropped


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
                replace_folder(staged, final, aside=os.path.join(staging, ASIDE))
        finally:
            self._staging = None
            if self.args.should_save:
                shutil.rmtree(staging, ignore_errors=True)
        if self.args.should_save:
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
