"""transformers ``Trainer`` integration: atomic checkpoints and a progress bar with throughput.

A checkpoint's adapter is the Trainer's own: ``PeftModel.save_pretrained`` writes it and, on
``resume_from_checkpoint``, ``PeftModel.load_adapter`` reads it back, routed-expert LoRA included (it lives in
PEFT layers, ``moetune.adapters.expert_layer``, and the live config is in stock form). Optimizer, scheduler,
RNG states and the data position are the Trainer's own checkpoint files too.

Optimizer state: torch's AdamW creates ``exp_avg`` / ``exp_avg_sq`` with ``zeros_like(param)``, so the
expert LoRA (fp32 CPU parameters) gets fp32 CPU state next to it while GPU LoRA keeps its state on the GPU;
``clip_grad_norm_`` computes one norm over both devices.

Checkpoints are written atomically (``moetune.train.checkpoints``, shared with the TRL trainers of the dpo and
kto stages). Given a guard (``moetune.train.guards.attach_guard``), every micro-batch's loss and every step's
gradient norm reach it before ``optimizer.step()``, so a diverged step is stopped or skipped before it is applied.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import Trainer, TrainerCallback

from moetune.train.checkpoints import STAGING_PREFIX, AtomicCheckpoints
from moetune.train.guards import GuardedSteps

__all__ = ["STAGING_PREFIX", "MoetuneTrainer", "ProgressBar"]


class MoetuneTrainer(GuardedSteps, AtomicCheckpoints, Trainer):
    """A ``Trainer`` (a subclass; no library class is patched) whose checkpoints are renamed into place only
    once complete (:class:`~moetune.train.checkpoints.AtomicCheckpoints`) and whose steps a numerical guard can
    stop or skip (:class:`~moetune.train.guards.GuardedSteps`)."""


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
