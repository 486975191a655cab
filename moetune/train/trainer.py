"""transformers ``Trainer`` integration: saving/resuming moetune LoRA and a progress bar with throughput.

``MoetuneTrainer`` is a ``Trainer`` subclass (no library class is patched) that writes every checkpoint's
adapter with :func:`moetune.adapters.save_adapter` (stock PEFT format, routed-expert LoRA included: PEFT's own
``save_pretrained`` would miss it, because PEFT 0.21 finds adapter tensors through its own layer classes) and
reads it back on ``resume_from_checkpoint`` with :func:`moetune.adapters.load_adapter_weights`. Optimizer,
scheduler, RNG states and the data position are the Trainer's own checkpoint files.

Optimizer state: torch's AdamW creates ``exp_avg`` / ``exp_avg_sq`` with ``zeros_like(param)``, so the
expert LoRA (fp32 CPU parameters) gets fp32 CPU state next to it while GPU LoRA keeps its state on the GPU;
``clip_grad_norm_`` computes one norm over both devices.
"""

from __future__ import annotations

import time
from typing import Any

from transformers import Trainer, TrainerCallback

from moetune.adapters.save import load_adapter_weights, save_adapter


class MoetuneTrainer(Trainer):
    """A ``Trainer`` whose checkpoints hold the complete moetune adapter (attention and expert LoRA)."""

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        assert output_dir is not None  # TrainingArguments always has one
        if not self.args.should_save:
            return
        save_adapter(self.accelerator.unwrap_model(self.model), output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        load_adapter_weights(model if model is not None else self.model, resume_from_checkpoint)


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
