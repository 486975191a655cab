"""``moetune train``: setup -> train -> save, top to bottom.

config (validated) -> tokenizer + datasets (data errors surface before the model loads)
  -> moetune.load_model (routed experts into CPU engines) -> LoRA attached (attention/dense via PEFT,
     experts in the engine) -> MoetuneTrainer (transformers Trainer) -> train (optionally resumed)
  -> output_dir: adapter (stock PEFT), tokenizer, trainer_state.json, loss_curve.png, run_summary.json
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.config import MoetuneConfig, training_arguments_kwargs

logger = logging.getLogger(__name__)


@dataclass
class TrainRun:
    """What a finished run hands back: the trained PEFT model, its tokenizer, the trainer and the summary."""

    model: Any
    tokenizer: Any
    trainer: Any
    summary: dict[str, Any]


def _device(cfg: MoetuneConfig) -> str | None:
    return None if cfg.engine.device == "auto" else cfg.engine.device


def setup(cfg: MoetuneConfig, *, progress: bool = True) -> tuple[Any, Any, Any]:
    """(peft_model, tokenizer, prepared data) for ``cfg``; the data is read and checked before the model loads."""
    import torch

    from moetune.adapters.apply import LoraSettings, attach_lora
    from moetune.loading import load_model
    from moetune.loading.hf import load_tokenizer
    from moetune.train.data import prepare_datasets

    model_path = cfg.model.model_name_or_path
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    data = prepare_datasets(cfg.data, tokenizer, seed=cfg.training.seed)
    model = load_model(
        model_path,
        device=_device(cfg),
        # bf16 training keeps bf16 weights; otherwise fp32 (exact, twice the memory)
        dtype="bfloat16" if cfg.training.bf16 else "float32",
        experts=cfg.engine.experts,
        trust_remote_code=cfg.model.trust_remote_code,
        progress=progress,
    )
    model.config.use_cache = False  # packed rows need the no-cache mask path; training never uses the cache
    torch.manual_seed(
        cfg.training.seed
    )  # expert LoRA's A is drawn from the global RNG, as PEFT draws its own
    peft_model = attach_lora(model, LoraSettings.from_config(cfg.finetune))
    return peft_model, tokenizer, data


def train(cfg: MoetuneConfig, peft_model: Any, tokenizer: Any, data: Any) -> Any:
    """Run transformers' training loop (resuming when the config says so); returns the trainer."""
    from transformers import PrinterCallback, TrainingArguments

    from moetune.train.outputs import TrainerLog
    from moetune.train.trainer import MoetuneTrainer, ProgressBar

    args = TrainingArguments(
        **training_arguments_kwargs(cfg),
        # non-reentrant: the CPU experts' forward is then reused by the recompute (moetune.layer.memo)
        activation_checkpointing_kwargs={"use_reentrant": False},
        include_num_input_tokens_seen="non_padding",
        disable_tqdm=True,  # ProgressBar replaces the Trainer's bar
    )
    trainer = MoetuneTrainer(
        model=peft_model,
        args=args,
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=data.collator,
        processing_class=tokenizer,
        callbacks=[ProgressBar(), TrainerLog()],
    )
    trainer.remove_callback(PrinterCallback)  # ProgressBar prints the logs
    resume = cfg.training.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=str(resume) if isinstance(resume, Path) else resume)
    return trainer


def save(cfg: MoetuneConfig, trainer: Any, tokenizer: Any, seconds: float) -> dict[str, Any]:
    """Write the final adapter, tokenizer, trainer state, loss curve and run summary; returns the summary."""
    from moetune.adapters.save import save_adapter
    from moetune.train.outputs import (
        LOSS_CURVE,
        SUMMARY,
        peak_ram_gb,
        peak_vram_gb,
        train_losses,
        write_loss_curve,
        write_summary,
    )

    out = Path(cfg.training.output_dir)
    save_adapter(trainer.model, out)
    tokenizer.save_pretrained(out)
    trainer.save_state()
    state = trainer.state
    curve = write_loss_curve(state.log_history, out / LOSS_CURVE) if cfg.training.plot_loss else None
    final = [h for h in state.log_history if "train_runtime" in h]
    steps_run = max(state.global_step - (final[-1].get("start_step", 0) if final else 0), 1)
    summary = {
        "steps": state.global_step,
        "wall_seconds": round(seconds, 2),
        "train_seconds": final[-1]["train_runtime"] if final else None,
        "seconds_per_step": round(final[-1]["train_runtime"] / steps_run, 4) if final else None,
        "tokens_seen": state.num_input_tokens_seen,
        "tokens_per_second": round(state.num_input_tokens_seen / final[-1]["train_runtime"], 1)
        if final and final[-1]["train_runtime"]
        else None,
        "final_train_loss": next((loss for _, loss in reversed(train_losses(state.log_history))), None),
        "final_eval_loss": next(
            (h["eval_loss"] for h in reversed(state.log_history) if "eval_loss" in h), None
        ),
        "peak_ram_gb": round(peak_ram_gb(), 3),
        "peak_vram_gb": peak_vram_gb(),
        "loss_curve": str(curve) if curve else None,
        "config": cfg.summary(),
    }
    write_summary(summary, out / SUMMARY)
    return summary


def run(cfg: MoetuneConfig, *, progress: bool = True) -> TrainRun:
    """setup -> train -> save for a validated config."""
    start = time.perf_counter()
    peft_model, tokenizer, data = setup(cfg, progress=progress)
    trainer = train(cfg, peft_model, tokenizer, data)
    summary = save(cfg, trainer, tokenizer, time.perf_counter() - start)
    return TrainRun(peft_model, tokenizer, trainer, summary)
