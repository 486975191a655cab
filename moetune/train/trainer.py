"""transformers ``Trainer`` integration: atomic checkpoints and a progress bar with throughput.

A checkpoint's adapter is the Trainer's own: ``PeftModel.save_pretrained`` writes it and, on
``resume_from_checkpoint``, ``PeftModel.load_adapter`` reads it back, routed-expert LoRA included (it lives in
PEFT layers, ``moetune.adapters.expert_layer``, and the live config is in stock form). Optimizer, scheduler,
RNG states and the data position are the Trainer's own checkpoint files too.

Optimizer state: torch's AdamW creates ``exp_avg`` / ``exp_avg_sq`` with ``zeros_like(param)``, so the
expert LoRA (fp32 CPU parameters) gets fp32 CPU state next to it while GPU LoRA keeps its state on the GPU;
``clip_grad_norm_`` computes one norm over both devices.

A full/freeze model (``moetune.train.modes``; no PEFT wrapper) checkpoints its weights and optimizer state layer by
layer as safetensors instead of ``model.safetensors`` / ``optimizer.pt`` (``moetune.train.layered``), and a resume
that would leave routed-expert weights unloaded raises ``LoadError`` (the Trainer only warns about missing keys).

Checkpoints are written atomically: the Trainer's own ``_save_checkpoint`` (adapter, optimizer, scheduler,
RNG, trainer state, rotation) writes ``checkpoint-N`` inside a staging folder ``tmp-checkpoint-N/`` and only
the complete folder is renamed into place, so a crash mid-save leaves no ``checkpoint-N`` for
``resume_from_checkpoint`` (transformers' ``get_last_checkpoint`` matches ``checkpoint-N`` only). transformers
5.24 has no such mechanism of its own: it writes into ``checkpoint-N`` file by file.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer import SCHEDULER_NAME, TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from moetune.atomic import replace_folder
from moetune.errors import LoadError
from moetune.train.layered import (
    OPTIMIZER_INDEX,
    load_optimizer_by_layer,
    save_model_by_layer,
    save_optimizer_by_layer,
)

STAGING_PREFIX = "tmp-"  # tmp-checkpoint-N: matched neither by get_last_checkpoint nor by checkpoint rotation


class MoetuneTrainer(Trainer):
    """A ``Trainer`` (a subclass; no library class is patched) whose checkpoints are renamed into place only
    once complete."""

    # the folder Trainer._save_checkpoint writes under while a checkpoint is staged
    _staging: str | None = None

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging if self._staging is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final, staging = os.path.join(run_dir, name), os.path.join(run_dir, STAGING_PREFIX + name)
        staged = os.path.join(staging, name)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save of this step
        self._staging = staging
        try:
            # everything goes to `staged`; its own rotation sees that one checkpoint only
            super()._save_checkpoint(model, trial)
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

    def _layered(self) -> bool:
        """A full/freeze model (``moetune.train.modes``): its checkpoints are written layer by layer."""
        from peft import PeftModel

        return not isinstance(self.model, PeftModel)

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self._staging is None or not self._layered():
            super()._save(output_dir, state_dict)
            return
        # a checkpoint: weights in the live modules' layout, which resume's load_sharded_checkpoint matches; the
        # final save_model writes the base checkpoint's own layout instead
        out = str(output_dir if output_dir is not None else self.args.output_dir)
        save_model_by_layer(self.model, out)  # type: ignore[arg-type]
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._layered():
            super()._save_optimizer_and_scheduler(output_dir)
            return
        assert self.optimizer is not None and self.lr_scheduler is not None
        save_optimizer_by_layer(self.optimizer, self.model, output_dir)  # type: ignore[arg-type]
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_INDEX)):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self.optimizer is not None and self.lr_scheduler is not None
        load_optimizer_by_layer(self.optimizer, self.model, checkpoint)  # type: ignore[arg-type]
        self.lr_scheduler.load_state_dict(
            torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True)
        )

    def _issue_warnings_after_load(self, load_result: Any) -> None:
        from moetune.layer import CpuExperts

        model: Any = self.model
        experts = [p for p, m in model.named_modules() if isinstance(m, CpuExperts) and m.exports]
        lost = [k for k in load_result.missing_keys if any(k.startswith(p + ".") for p in experts)]
        if lost:
            raise LoadError(
                f"resume_from_checkpoint: the checkpoint lacks the routed-expert weights {lost[:4]}...; it was not "
                "written by this moetune run's mode (full/freeze checkpoints keep the live layout). Resume from a "
                "checkpoint of the same run, or start without resume_from_checkpoint"
            )
        super()._issue_warnings_after_load(load_result)


class ProgressBar(TrainerCallback):
    """One tqdm bar over the optimizer steps, with the last logged loss, tokens/s and tqdm's own ETA.

    Tokens are the Trainer's ``num_input_tokens_seen`` (``include_num_input_tokens_seen="non_padding"``).
    """

    def __init__(self) -> None:
        self.bar: Any = None
        self.start_tokens = 0
        self.start_time = 0.0
        self.loss: float | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from tqdm.auto import tqdm

        if state.is_world_process_zero:
            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc="train", unit="step")
        self.start_tokens, self.start_time = state.num_input_tokens_seen, time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is None:
            return
        elapsed = max(time.perf_counter() - self.start_time, 1e-9)
        tok_s = (state.num_input_tokens_seen - self.start_tokens) / elapsed
        post = {"tok/s": f"{tok_s:.0f}"}
        if self.loss is not None:
            post = {"loss": f"{self.loss:.4f}", **post}
        self.bar.set_postfix(post, refresh=False)
        self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.loss = float(logs["loss"])
        if self.bar is not None and logs:
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in logs.items()}
            self.bar.write(f"step {state.global_step}: {shown}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
