"""``moetune train``: setup -> train -> save, top to bottom.

config (validated) -> preflight (output_dir writable, model headers and lora_target on a meta-device model,
  resume checkpoint complete) -> tokenizer + datasets (data errors surface before the model loads)
  -> moetune.load_model (routed experts into CPU engines) -> LoRA attached (attention/dense via PEFT,
     experts in the engine) -> the stage's trainer (moetune.train.stages: sft/pt a transformers Trainer,
     dpo/kto TRL's; NumericalGuard stops or skips a diverged step) -> train (optionally resumed)
  -> output_dir: adapter (stock PEFT), tokenizer, trainer_state.json, loss_curve.png, run_summary.json

Launched as several processes (torchrun / accelerate launch: moetune.dist), every rank runs this same recipe
on its share of each global batch under the Trainer's DDP; the main process alone writes files.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.config import MoetuneConfig, training_arguments_kwargs
from moetune.config.schema import FinetuningType

logger = logging.getLogger(__name__)


@dataclass
class TrainRun:
    """What a finished run hands back: the trained PEFT model, its tokenizer, the trainer and the summary."""

    model: Any
    tokenizer: Any
    trainer: Any
    summary: dict[str, Any]


def _device(cfg: MoetuneConfig, ranks: Any) -> str | None:
    """The device of the dense part: a GPU process of several takes its local rank's GPU (moetune.dist.start
    made it the current one), whatever ``cuda`` / ``auto`` the config says."""
    if ranks.distributed and not training_arguments_kwargs(cfg)["use_cpu"]:
        return f"cuda:{ranks.local_rank}"
    return None if cfg.engine.device == "auto" else cfg.engine.device


def _start_ranks(cfg: MoetuneConfig) -> Any:
    """This process's ``moetune.dist.Ranks``; a multi-process launch gets its process group here."""
    from moetune.dist import start

    kwargs = training_arguments_kwargs(cfg)
    return start(
        cpu=kwargs["use_cpu"],
        timeout_s=kwargs["ddp_timeout"],
        backend=kwargs.get("ddp_backend"),
        bind_cpus=cfg.engine.bind_cpus,
    )


def setup(cfg: MoetuneConfig, *, progress: bool = True) -> tuple[Any, Any, Any]:
    """(peft_model, tokenizer, prepared data) for ``cfg``; the data is read and checked before the model loads."""
    import torch

    from moetune.adapters.apply import LoraSettings
    from moetune.adapters.swap import recover_adapter
    from moetune.dist import main_writes
    from moetune.dist.group import check_shared_folder
    from moetune.loading import load_model
    from moetune.train.checkpoints import recover_checkpoints
    from moetune.train.data import prepare_datasets
    from moetune.train.fsdp import check_fsdp
    from moetune.train.model_save import recover_model_save
    from moetune.train.modes import ModeSettings, apply_mode
    from moetune.train.preflight import check_before_load, check_token_ids, load_tokenizer
    from moetune.train.stages import stage_for

    stage = stage_for(cfg)
    _check_requires(cfg, stage.requires)
    model_path = cfg.model.model_name_or_path
    # bf16 (or pure_bf16) training loads bf16 weights; otherwise fp32 (exact, twice the memory)
    dtype = "bfloat16" if cfg.training.bf16 or cfg.finetune.pure_bf16 else "float32"
    modes = ModeSettings.from_config(cfg.finetune, bf16=cfg.training.bf16)
    ranks = _start_ranks(cfg)
    # a checkpoint or model save a kill interrupted: removed (a checkpoint it had moved aside restored) before the
    # preflight looks for the checkpoint to resume from
    main_writes(
        ranks,
        lambda: recover_checkpoints(cfg.training.output_dir) + recover_model_save(cfg.training.output_dir),
    )
    check_fsdp(cfg, ranks.world)  # FSDP2 settings, before any weight loads
    # output_dir, model files, lora_target, resume checkpoint, what the mode asks of the experts: checked before
    # any weight loads
    planned = check_before_load(cfg, dtype, modes, write_probe=ranks.is_main)
    check_shared_folder(ranks, Path(cfg.training.output_dir))  # several nodes: one output_dir seen by all
    # an adapter save a crash interrupted in output_dir is finished or removed now, not at the next save
    main_writes(ranks, lambda: recover_adapter(Path(cfg.training.output_dir)))
    tokenizer = load_tokenizer(cfg)
    data = prepare_datasets(cfg.data, tokenizer, seed=cfg.training.seed, codec=stage.codec)
    check_token_ids(tokenizer, data, planned)
    model = load_model(
        model_path,
        device=_device(cfg, ranks),
        dtype=dtype,
        experts=_experts_for(cfg, ranks),
        trust_remote_code=cfg.model.trust_remote_code,
        progress=progress,
        planned=planned,  # the preflight's: planned with the same dtype and expert options (threads aside)
    )
    model.config.use_cache = False  # packed rows need the no-cache mask path; training never uses the cache
    torch.manual_seed(
        cfg.training.seed
    )  # expert LoRA's A is drawn from the global RNG, as PEFT draws its own
    peft_model = apply_mode(model, modes, LoraSettings.from_config(cfg.finetune))
    if cfg.finetune.lora_experts is not None:  # after PEFT, which freezes every parameter it does not own
        from moetune.adapters.lora_experts import attach_lora_experts

        assert cfg.finetune.lora_expert_intermediate_size is not None, "validated with lora_experts"
        attach_lora_experts(peft_model, cfg.finetune.lora_experts, cfg.finetune.lora_expert_intermediate_size)
    return peft_model, tokenizer, data


def _experts_for(cfg: MoetuneConfig, ranks: Any) -> Any:
    """The expert options this process loads with: unless ``num_threads`` is set, the ranks on one machine
    share its cores (each would otherwise size its engine's pool to all of them): a pinned rank uses the cores
    it was pinned to, an unpinned one its share of them all."""
    import dataclasses

    from moetune.sysinfo import default_num_threads

    experts = cfg.engine.experts
    if experts.num_threads is not None or ranks.local_world == 1:
        return experts
    share = default_num_threads() if ranks.cpus else max(1, default_num_threads() // ranks.local_world)
    logger.info(
        "moetune rank %d: %d engine threads (the cores shared by %d ranks)",
        ranks.rank,
        share,
        ranks.local_world,
    )
    return dataclasses.replace(experts, num_threads=share)


def _check_requires(cfg: MoetuneConfig, packages: tuple[str, ...]) -> None:
    import importlib.util

    from moetune.errors import ConfigError

    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError(
            f"stage {cfg.finetune.stage.value!r} needs {', '.join(missing)}, which is not installed; "
            f"install moetune's dependencies (pip install 'trl>=1.16')"
        )


def train(cfg: MoetuneConfig, peft_model: Any, tokenizer: Any, data: Any, extra_callbacks: tuple = ()) -> Any:
    """Run the stage's training loop (resuming when the config says so); returns the trainer. ``extra_callbacks``:
    more ``TrainerCallback``s (a benchmark's timers: bench/dist.py)."""
    from transformers import PrinterCallback

    from moetune.train.fsdp import unsharded
    from moetune.train.guards import NumericalGuard, attach_guard
    from moetune.train.outputs import TrainerLog
    from moetune.train.stages import stage_for
    from moetune.train.trainer import ProgressBar

    args = dict(
        **training_arguments_kwargs(cfg),
        # non-reentrant: the CPU experts' forward is then reused by the recompute (moetune.layer.memo)
        activation_checkpointing_kwargs={"use_reentrant": False},
        include_num_input_tokens_seen="non_padding",
        disable_tqdm=True,  # ProgressBar replaces the Trainer's bar
        logging_nan_inf_filter=False,  # a NaN loss is logged as NaN; NumericalGuard stops or skips that step
    )
    callbacks = [ProgressBar(), TrainerLog(), *extra_callbacks]
    experts = cfg.engine.experts
    if experts.gpu_experts == "auto":  # the hot experts are chosen from the routing of the first steps
        from moetune.train.hot_auto import HotExpertsAuto

        assert experts.gpu_experts_budget is not None  # the config check requires it with auto
        callbacks.append(HotExpertsAuto(experts.gpu_experts_budget, experts.gpu_experts_warmup))
    ranks = _start_ranks(cfg)
    trainer = stage_for(cfg).build_trainer(
        cfg, peft_model, tokenizer, data, unsharded(args, ranks.world), callbacks
    )
    attach_guard(trainer, NumericalGuard(cfg.training.on_divergence, _vocab_size(peft_model)))
    if ranks.distributed:  # what the CPU engine trains is averaged outside DDP (moetune.train.host_grads)
        from moetune.train.fsdp import attach_fsdp, fsdp_requested
        from moetune.train.host_grads import attach_host_grads

        fsdp = fsdp_requested(trainer)
        attach_host_grads(trainer, ranks.world, fsdp)
        if fsdp:  # the dense part sharded (FSDP2; checked in setup), the experts not
            attach_fsdp(trainer)
    if hasattr(
        trainer, "expert_optim"
    ):  # full/freeze: the routed experts' optimizer (moetune.train.expert_optim)
        from moetune.train.expert_optim import spec_of_config

        trainer.expert_optim = spec_of_config(cfg)
    trainer.remove_callback(PrinterCallback)  # ProgressBar prints the logs
    resume = cfg.training.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=str(resume) if isinstance(resume, Path) else resume)
    if cfg.finetune.do_eval:  # as LLaMA-Factory: once more after training, into eval_results.json and the log
        trainer.save_metrics("eval", trainer.evaluate(metric_key_prefix="eval"))
    return trainer


def _vocab_size(peft_model: Any) -> int | None:
    """The output vocabulary of the model (the uniform-guess loss is its log), None if its config has none."""
    # full/freeze runs train the transformers model itself, LoRA runs its PeftModel
    base = peft_model.get_base_model() if hasattr(peft_model, "get_base_model") else peft_model
    return getattr(base.config.get_text_config(), "vocab_size", None)


def save(cfg: MoetuneConfig, trainer: Any, tokenizer: Any, seconds: float) -> dict[str, Any]:
    """Write the final adapter, tokenizer, trainer state, loss curve and run summary (the main process alone;
    the others wait until it is done); returns the summary."""
    from moetune.adapters.save import save_adapter
    from moetune.dist import main_writes
    from moetune.dist.shard import experts_held
    from moetune.train.fsdp import dense_memory, full_state_dict
    from moetune.train.model_save import save_model
    from moetune.train.modes import memory_report
    from moetune.train.outputs import (
        LOSS_CURVE,
        SUMMARY,
        peak_ram_gb,
        peak_vram_gb,
        train_losses,
        write_loss_curve,
        write_summary,
    )
    from moetune.train.templates import saved_chat_template

    ranks = _start_ranks(cfg)
    out = Path(cfg.training.output_dir)
    # FSDP2 gathers the dense part on the main process; sharded expert LoRA: every rank sends its rows, weight by
    # weight as the main process writes the whole adapter (both are collectives: every rank calls them)
    gathered = full_state_dict(trainer)
    sharded = getattr(trainer, "sharded_lora", None)
    streamed = sharded.gathered_adapter(trainer.model, gathered) if sharded is not None else None
    if streamed is not None and not ranks.is_main:
        streamed.send()

    def write_model() -> None:
        if cfg.finetune.finetuning_type is FinetuningType.LORA and streamed is not None:
            save_adapter(trainer.model, out, state_dict=streamed.state_dict, fetch=streamed.fetch)
            streamed.check_written()
        elif cfg.finetune.finetuning_type is FinetuningType.LORA:
            save_adapter(trainer.model, out, state_dict=gathered)
        else:
            save_model(trainer.model, out, state_dict=gathered)  # FSDP2: the dense part gathered whole
        # saved with the chat template the run trained with (its template, enable_thinking, default_system), so
        # that generate, chat and serving render prompts as training did; the tokenizer in hand keeps its own
        own, trained_with = tokenizer.chat_template, saved_chat_template(tokenizer, cfg.data)
        if trained_with is not None:
            tokenizer.chat_template = trained_with
        try:
            tokenizer.save_pretrained(out)
        finally:
            tokenizer.chat_template = own

    main_writes(ranks, write_model)
    trainer.save_state()  # the Trainer's own: written by the main process only
    state = trainer.state
    plot = cfg.training.plot_loss and ranks.is_main
    curve = write_loss_curve(state.log_history, out / LOSS_CURVE) if plot else None
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
        # load_best_model_at_end: the output holds this checkpoint's weights, not the last step's
        "best_metric": state.best_metric,
        "best_model_checkpoint": state.best_model_checkpoint,
        # optimizer steps the numerical guard skipped (on_divergence: skip); their loss is logged as computed
        "skipped_steps": list(trainer.guard.skipped) if trainer.guard is not None else [],
        "peak_ram_gb": round(peak_ram_gb(), 3),
        "peak_vram_gb": peak_vram_gb(),
        "finetuning_type": cfg.finetune.finetuning_type.value,
        "routed_experts": experts_held(trainer.model),  # this rank's: with expert_parallel sharded, its share
        "memory": memory_report(trainer.model, trainer.optimizer),
        "dense_part": dense_memory(trainer.model),  # this rank's: with fsdp, its shard of the dense weights
        "loss_curve": str(curve) if curve else None,
        "config": cfg.summary(),
    }
    main_writes(ranks, lambda: write_summary(summary, out / SUMMARY))
    return summary


def run(cfg: MoetuneConfig, *, progress: bool = True) -> TrainRun:
    """setup -> train -> save for a validated config."""
    from moetune.dist import failures_end_every_rank

    start = time.perf_counter()
    with failures_end_every_rank(_start_ranks(cfg)):  # several processes: a failure on one ends them all
        peft_model, tokenizer, data = setup(cfg, progress=progress)
        trainer = train(cfg, peft_model, tokenizer, data)
        summary = save(cfg, trainer, tokenizer, time.perf_counter() - start)
    return TrainRun(_without_autocast(peft_model), tokenizer, trainer, summary)


def _without_autocast(model: Any) -> Any:
    """``model`` with the forward it had before accelerate's mixed precision wrapped it in autocast (bf16 / fp16
    runs), so that the model a run hands back computes as the same model loaded from the saved adapter does."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_fp32_wrapper=False)
