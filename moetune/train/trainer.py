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
LoRA experts (``moetune.adapters.lora_experts``), which PEFT does not save, are written into every checkpoint beside
the adapter (``moetune_lora_experts.safetensors``, inside the staged folder, so atomic with it) and restored on
resume and by ``load_best_model_at_end`` (``moetune.train.lora_experts_checkpoints``, shared with the TRL trainers).
A full/freeze model (``moetune.train.modes``; no PEFT wrapper) checkpoints its weights and optimizer state layer by
layer as safetensors instead of ``model.safetensors`` / ``optimizer.pt`` (``moetune.train.layered``), and a resume
that would leave routed-expert weights unloaded raises ``LoadError`` (the Trainer only warns about missing keys).
Its optimizer is ``moetune.train.expert_optim.ExpertAdamW`` (torch's AdamW plus the experts' sparse in-place
update, state per ``optim``): clipping and the logged gradient norm cover the experts' sparse gradients too, and
with ``max_grad_norm: 0`` (no global norm needed first) and no guard that may skip a step, each experts module is
updated while the backward of the layers below it runs.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer import SCHEDULER_NAME

from moetune.config.schema import DivergenceAction
from moetune.errors import LoadError
from moetune.train.checkpoints import STAGING_PREFIX, AtomicCheckpoints
from moetune.train.expert_optim import ExpertAdamW, ExpertOptimSpec, build_expert_optimizer, unwrap
from moetune.train.fsdp import gathered_optimizer_state, gathered_state_dict
from moetune.train.guards import GuardedSteps
from moetune.train.host_grads import AveragesHostGrads
from moetune.train.layered import (
    OPTIMIZER_INDEX,
    load_model_by_layer,
    load_optimizer_by_layer,
    save_model_by_layer,
    save_optimizer_by_layer,
)
from moetune.train.lora_experts_checkpoints import LoraExpertsCheckpoints
from moetune.train.other_kind import ResumesOtherKind, load_scheduler
from moetune.train.sharded_lora import ShardsExpertLora

__all__ = ["STAGING_PREFIX", "MoetuneTrainer", "ProgressBar"]


class MoetuneTrainer(
    GuardedSteps,
    AveragesHostGrads,
    AtomicCheckpoints,
    ResumesOtherKind,
    LoraExpertsCheckpoints,
    ShardsExpertLora,
    Trainer,
):
    """A ``Trainer`` (a subclass; no library class is patched) whose checkpoints are renamed into place only
    once complete (:class:`~moetune.train.checkpoints.AtomicCheckpoints`) and whose steps a numerical guard can
    stop or skip (:class:`~moetune.train.guards.GuardedSteps`)."""

    # full/freeze: the routed experts' optimizer (the recipe sets the run's); None: the Trainer's own, dense grads
    expert_optim: ExpertOptimSpec | None = ExpertOptimSpec()

    def create_optimizer(self, model: Any = None) -> Any:
        """Full/freeze with routed experts in full mode: :class:`ExpertAdamW` over the Trainer's own parameter
        groups (weight decay except biases and norms), with ``optim``'s hyperparameters; else the Trainer's."""
        opt_model: Any = self.model if model is None else model
        if self.optimizer is None and self._layered() and self.expert_optim is not None:
            decay = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [
                {"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
            ]
            args = self.args
            optim = str(getattr(args.optim, "value", args.optim))
            built = build_expert_optimizer(
                opt_model,
                groups,
                self.expert_optim,
                lr=args.learning_rate,
                betas=(args.adam_beta1, args.adam_beta2),
                eps=args.adam_epsilon,
                fused=optim == "adamw_torch_fused" or None,
            )
            if built is not None:
                self.optimizer = built
                return built
        return super().create_optimizer(model)

    def _expert_optimizer(self) -> ExpertAdamW | None:
        return unwrap(self.optimizer)

    def _dense_params(self, model: Any) -> list[torch.Tensor]:
        return [p for p in model.parameters() if p.grad is not None]

    def _clip_grad_norm(self, model: Any) -> Any:
        experts = self._expert_optimizer()
        if experts is None:
            return super()._clip_grad_norm(model)
        self.accelerator.unscale_gradients()
        return experts.clip_grad_norm_(self._dense_params(model), self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        experts = self._expert_optimizer()
        if experts is not None and grad_norm is None:  # no clipping: the norm over dense and expert grads
            grad_norm = experts.grad_norm(self._dense_params(model))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def overlaps_expert_step(self) -> bool:
        """Whether the experts' update may run during the backward of the step's last micro-batch: only when
        nothing must see every gradient first (clipping's global norm, a guard that may skip the step, the
        average over several processes)."""
        skip = self.guard is not None and self.guard.action is DivergenceAction.SKIP
        # several processes: the gradients are averaged over the ranks after the backward (host_grads) first
        return not (self.args.max_grad_norm or 0) > 0 and not skip and self.host_grads is None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        experts = self._expert_optimizer()
        if experts is not None and self.accelerator.sync_gradients and self.overlaps_expert_step():
            experts.arm()
        return super().training_step(model, inputs, num_items_in_batch)

    def _layered(self) -> bool:
        """A full/freeze model (``moetune.train.modes``): its checkpoints are written layer by layer."""
        from peft import PeftModel

        from moetune.layer import CpuExperts

        model: Any = self.model
        # a plain torch model (no routed experts in engines) keeps the Trainer's own checkpoint
        return not isinstance(model, PeftModel) and any(isinstance(m, CpuExperts) for m in model.modules())

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if self._staging is None or not self._layered():
            super()._save(output_dir, state_dict)  # LoraExpertsCheckpoints: the LoRA experts too
            return
        if not self.args.should_save:  # transformers calls _save on every rank; the main one writes
            return
        # a checkpoint: weights in the live modules' layout, which resume's load_sharded_checkpoint matches; the
        # final save_model writes the base checkpoint's own layout instead
        out = str(output_dir if output_dir is not None else self.args.output_dir)
        save_model_by_layer(self.model, out, state_dict)  # FSDP2: gathered whole (save_model)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(out)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not (self.is_fsdp_enabled and self._layered()):
            super().save_model(output_dir, _internal_call)
            return
        # FSDP2, full/freeze: the shards gathered whole on the main process (every rank joins), the routed experts
        # taken as they are (accelerate's get_state_dict would copy them: the whole model's bytes once more)
        self._save(output_dir, state_dict=gathered_state_dict(self.model, self.args.should_save))

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._layered():
            super()._save_optimizer_and_scheduler(output_dir)
            return
        assert self.optimizer is not None and self.lr_scheduler is not None
        # FSDP2: every rank joins the gathers of the sharded moments; without it the state is replicated
        gathered = (
            gathered_optimizer_state(self.optimizer, self.args.should_save) if self.is_fsdp_enabled else None
        )
        if not self.args.should_save:  # several processes: the main one writes
            return
        save_optimizer_by_layer(self.optimizer, self.model, output_dir, gathered)  # type: ignore[arg-type]
        torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_INDEX)):
            # ResumesOtherKind (next in the bases) takes a LoRA checkpoint of the other kind
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self.optimizer is not None and self.lr_scheduler is not None
        load_optimizer_by_layer(self.optimizer, self.model, checkpoint)  # type: ignore[arg-type]
        load_scheduler(self.lr_scheduler, checkpoint)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        # ResumesOtherKind (next in the bases) takes a LoRA checkpoint of the other kind
        if not (self.is_fsdp_enabled and self._layered()):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        # FSDP2, full/freeze: the layer files hold whole tensors; each rank loads its shards (accelerate's
        # load_fsdp_model reads its own pytorch_model_fsdp.bin only)
        self._issue_warnings_after_load(
            load_model_by_layer(model if model is not None else self.model, resume_from_checkpoint)
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
