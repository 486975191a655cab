"""transformers ``Trainer`` integration: atomic checkpoints and a progress bar with throughput.

A checkpoint's adapter is the Trainer's own: ``PeftModel.save_pretrained`` writes it and, on
``resume_from_checkpoint``, ``PeftModel.load_adapter`` reads it back, routed-expert LoRA included (it lives in
PEFT layers, ``moetune.adapters.expert_layer``, and the live config is in stock form). Optimizer, scheduler,
RNG states and the data position are the Trainer's own checkpoint files too.

Optimizer state: torch's AdamW creates ``exp_avg`` / ``exp_avg_sq`` with ``zeros_like(param)``, so the
expert LoRA (fp32 CPU parameters) gets fp32 CPU state next to it while GPU LoRA keeps its state on the GPU;
``clip_grad_norm_`` computes one norm over both devices.

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

from transformers import Trainer, TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from moetune.atomic import replace_folder

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
            self.bar.write(
                f"step {state.global_step}: " + ", ".join(f"{k} {_shown(v)}" for k, v in logs.items())
            )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _shown(value: Any) -> str:
    """A logged value for the log line: floats to 4 significant digits (a learning rate of 2e-05 stays
    2e-05, not 0.0), everything else as it is."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)
