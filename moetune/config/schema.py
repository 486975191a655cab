"""The typed training configuration: one frozen dataclass per section, field names = YAML keys.

The YAML is flat, as in LLaMA-Factory (``lora_rank: 8`` next to ``learning_rate: 1.0e-4``); each key
belongs to exactly one section below. moetune's own engine options sit in one nested mapping,
``moetune:``, parsed into :class:`EngineConfig`. Defaults follow LLaMA-Factory (which follows
transformers) so that a LLaMA-Factory YAML means the same thing here.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.config.datasets import DatasetSpec
from moetune.config.experts import ActivationPolicy, ExpertOptions
from moetune.config.fields import (
    derived,
    non_negative,
    option,
    positive,
    required,
    steps_or_ratio,
    unit_interval,
)

__all__ = [
    "ActivationPolicy",
    "DataConfig",
    "DivergenceAction",
    "EngineConfig",
    "FinetuneConfig",
    "FinetuningType",
    "IntervalStrategy",
    "ModelConfig",
    "MoetuneConfig",
    "PrefLoss",
    "Stage",
    "TrainingConfig",
]


class Stage(str, enum.Enum):
    """The training stage (LLaMA-Factory's ``stage``)."""

    SFT = "sft"
    PT = "pt"
    DPO = "dpo"
    KTO = "kto"


class PrefLoss(str, enum.Enum):
    """The DPO loss (LLaMA-Factory's ``pref_loss``); each is TRL ``DPOTrainer``'s loss of that name."""

    SIGMOID = "sigmoid"
    HINGE = "hinge"
    IPO = "ipo"


class FinetuningType(str, enum.Enum):
    """What is trained (LLaMA-Factory's ``finetuning_type``; ``moetune.train.modes`` applies it)."""

    LORA = "lora"
    FULL = "full"
    FREEZE = "freeze"


class ExpertUpdate(str, enum.Enum):
    """Which routed experts the full-mode optimizer updates each step (``moetune.train.expert_optim``): ``exact``
    every expert, as torch's AdamW with zero gradients; ``lazy`` only those that received tokens."""

    EXACT = "exact"
    LAZY = "lazy"


class DivergenceAction(str, enum.Enum):
    """What the numerical guard does on a non-finite loss or gradient norm (moetune.train.guards)."""

    STOP = "stop"  # stop before the update, naming the step, the cause and the last good checkpoint
    SKIP = "skip"  # skip that optimizer step (gradients dropped); stop after too many in a row


class IntervalStrategy(str, enum.Enum):
    """When to evaluate or save (transformers' ``IntervalStrategy``)."""

    NO = "no"
    STEPS = "steps"
    EPOCH = "epoch"


def _min_one(value: int) -> str | None:
    return None if value >= 1 else "must be >= 1"


def _max_steps(value: int) -> str | None:
    return None if value == -1 or value > 0 else "must be > 0, or -1 to train for num_train_epochs"


def _device(value: str) -> str | None:
    return None if re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) else "must be auto, cpu, cuda or cuda:N"


def _val_size(value: float) -> str | None:
    if 0 <= value < 1 or float(value).is_integer():
        return None
    return "must be a fraction of the training rows in [0, 1) or a whole number of rows"


def _lr_scheduler(value: str) -> str | None:
    from transformers.trainer_utils import SchedulerType  # transformers' own list, not a copy of it

    allowed = [s.value for s in SchedulerType]
    return None if value in allowed else f"allowed: {', '.join(allowed)}"


def _lora_target(value: tuple[str, ...]) -> str | None:
    if "all" in value and len(value) > 1:
        return "'all' targets every linear layer and cannot be combined with module names"
    return None


@dataclass(frozen=True)
class ModelConfig:
    """The base model."""

    model_name_or_path: str = required()  # a local folder, or a hub id in the local HF cache
    # passed to transformers' tokenizer loader and to load_model's config loader, which never runs a
    # checkpoint's code (kimi_k2 loads as transformers' DeepSeek-V3 either way: loading/model_types.py)
    trust_remote_code: bool = option(False)


@dataclass(frozen=True)
class FinetuneConfig:
    """What is trained and how (LoRA on attention, dense MLPs and routed experts).

    ``lora_target`` is ``("all",)`` for every linear layer including the routed experts, or module names
    (e.g. ``q_proj, v_proj, experts``); the MoE router is a target only when named (e.g. ``gate``).
    ``lora_alpha`` is resolved to ``2 * lora_rank`` when unset, as in LLaMA-Factory.
    """

    stage: Stage = option(Stage.SFT, later={"rm": "reward modelling", "ppo": "PPO"})
    do_train: bool = option(True)
    do_eval: bool = option(False)  # LLaMA-Factory's: evaluate once more after training (eval_results.json)
    finetuning_type: FinetuningType = option(
        FinetuningType.LORA,
        later={"oft": "OFT"},
    )
    lora_rank: int = option(8, check=positive)
    lora_alpha: int | None = option(None, check=positive)
    lora_dropout: float = option(0.0, check=unit_interval)
    lora_target: tuple[str, ...] = option(("all",), check=_lora_target)
    use_rslora: bool = option(False)  # scale alpha / sqrt(rank) instead of alpha / rank
    # preference stages (dpo, kto; docs/stages.md): LLaMA-Factory's keys and defaults
    pref_beta: float = option(0.1, check=positive)
    pref_ftx: float = option(0.0, check=non_negative)  # dpo: weight of the NLL on the chosen response
    pref_loss: PrefLoss = option(
        PrefLoss.SIGMOID,
        later={
            "kto_pair": "the paired KTO loss; for KTO use stage: kto",
            "orpo": "ORPO, reference-free",
            "simpo": "SimPO, reference-free",
        },
    )
    kto_chosen_weight: float = option(1.0, check=positive)  # kto: weight of the desirable rows' loss
    kto_rejected_weight: float = option(1.0, check=positive)  # kto: weight of the undesirable rows' loss
    # lora: modules trained fully beside the LoRA (PEFT modules_to_save), e.g. a router
    additional_target: tuple[str, ...] | None = option(None)
    # freeze (README "training modes"): > 0 the last N decoder layers train, < 0 the first -N
    # 0 and counts past the model's layers: checked on the meta-device model before it loads, naming its range
    freeze_trainable_layers: int = option(2)
    freeze_trainable_modules: tuple[str, ...] = option(("all",))  # in those layers: all, or module names
    # freeze: modules outside the decoder layers (embed_tokens, norm, lm_head)
    freeze_extra_modules: tuple[str, ...] | None = option(None)
    # load in bf16 and keep trainable weights, their grads and optimizer state in bf16 (no fp32 upcast)
    pure_bf16: bool = option(False)
    # full/freeze: exact (every expert steps, as torch's AdamW) or lazy (only experts with tokens step)
    expert_update: ExpertUpdate = option(ExpertUpdate.EXACT)
    # the router's load-balancing loss weight (the model's router_aux_loss_coef; its aux loss joins the loss)
    moe_aux_loss_coef: float | None = option(None, check=non_negative)
    # lora: N LoRA experts of this intermediate size per MoE block (dense SwiGLU on the device, added to the
    # block's output; moetune.adapters.lora_experts); KTransformers' / LLaMA-Factory's keys map here
    lora_experts: int | None = option(None, check=positive)
    lora_expert_intermediate_size: int | None = option(None, check=positive)

    @property
    def targets_all(self) -> bool:
        """True when ``lora_target`` is ``all``: every linear layer and the routed experts, not the router."""
        return self.lora_target == ("all",)

    @property
    def lora_scale(self) -> float:
        """The factor on ``B A x``: alpha / rank, or alpha / sqrt(rank) with rsLoRA."""
        assert self.lora_alpha is not None, "lora_alpha is resolved during validation"
        return self.lora_alpha / (self.lora_rank**0.5 if self.use_rslora else self.lora_rank)


@dataclass(frozen=True)
class DataConfig:
    """Datasets, chat template and how examples become token sequences.

    ``template`` is unset (the tokenizer's own chat template), a LLaMA-Factory template name (``qwen3_nothink``,
    ``llama3``, ...: the tokenizer's own template with the name's switches, checked against the tokenizer's
    family; ``moetune.config.chat_templates``), or a path to a Jinja chat-template file.
    ``val_size`` < 1 is a fraction of the training rows held out for evaluation, >= 1 a row count.
    ``train_sources`` / ``eval_sources`` are ``dataset`` / ``eval_dataset`` resolved during validation.
    """

    dataset: tuple[str, ...] = required()
    eval_dataset: tuple[str, ...] | None = option(None)
    dataset_dir: Path = option(Path("data"))
    # a LLaMA-Factory template name (config/chat_templates.py) or a Jinja chat-template file; resolved into
    # template_name / template_file during validation
    template: str | None = option(None)
    cutoff_len: int = option(2048, check=positive)
    packing: bool = option(False)
    train_on_prompt: bool = option(False)
    mask_history: bool = option(False)  # train on the last assistant turn only
    default_system: str | None = option(None)  # system message for conversations that have none
    enable_thinking: bool | None = option(None)  # passed to the chat template when set
    max_samples: int | None = option(None, check=positive)  # per dataset, the first rows
    val_size: float = option(0.0, check=_val_size)
    overwrite_cache: bool = option(False)  # re-tokenize instead of reusing `datasets`' cache files
    preprocessing_num_workers: int | None = option(None, check=_min_one)
    preprocessing_batch_size: int = option(1000, check=positive)
    train_sources: tuple[DatasetSpec, ...] = derived(())
    template_name: str | None = derived(None)  # a key of chat_templates.NAMED_TEMPLATES
    template_file: Path | None = derived(None)
    eval_sources: tuple[DatasetSpec, ...] = derived(())


@dataclass(frozen=True)
class TrainingConfig:
    """The optimisation loop and its outputs; these become transformers ``TrainingArguments``.

    ``warmup_ratio`` and ``warmup_steps`` are alternatives. ``logging_steps``, ``save_steps`` and
    ``eval_steps`` are whole steps, or ratios of the total steps below 1 (as in transformers).
    ``resume_from_checkpoint`` is a checkpoint folder, or ``true`` for the latest ``checkpoint-*`` in
    ``output_dir``; it is passed to ``Trainer.train``, not to ``TrainingArguments``.
    ``gradient_checkpointing`` defaults to on, as in LLaMA-Factory (``disable_gradient_checkpointing``
    is read as its negation).
    """

    output_dir: Path = required()
    overwrite_output_dir: bool = option(False)
    per_device_train_batch_size: int = option(8, check=positive)
    per_device_eval_batch_size: int = option(8, check=positive)
    gradient_accumulation_steps: int = option(1, check=positive)
    learning_rate: float = option(5e-5, check=positive)
    lr_scheduler_type: str = option("linear", check=_lr_scheduler)
    lr_scheduler_kwargs: dict | None = option(None)
    warmup_ratio: float | None = option(None, check=unit_interval)
    warmup_steps: int | None = option(None, check=non_negative)
    num_train_epochs: float = option(3.0, check=positive)
    max_steps: int = option(-1, check=_max_steps)
    weight_decay: float = option(0.0, check=non_negative)
    max_grad_norm: float = option(1.0, check=non_negative)  # 0 disables clipping
    logging_steps: float = option(500, check=steps_or_ratio)
    save_strategy: IntervalStrategy = option(IntervalStrategy.STEPS)
    save_steps: float = option(500, check=steps_or_ratio)
    save_total_limit: int | None = option(None, check=positive)
    save_only_model: bool = option(False)
    eval_strategy: IntervalStrategy = option(IntervalStrategy.NO)
    eval_steps: float | None = option(None, check=steps_or_ratio)
    seed: int = option(42)
    bf16: bool = option(False)
    gradient_checkpointing: bool = option(True)
    resume_from_checkpoint: bool | Path | None = option(None)
    report_to: tuple[str, ...] = option(("none",))
    run_name: str | None = option(None)
    # LLaMA-Factory's key: the loss curve PNG in output_dir (moetune's default: on)
    plot_loss: bool = option(True)
    dataloader_num_workers: int = option(0, check=non_negative)
    ddp_timeout: int = option(1800, check=positive)
    # moetune's numerical guard: `stop` (default) or `skip` a step whose loss or gradient norm is NaN/Inf
    on_divergence: DivergenceAction = option(DivergenceAction.STOP)
    # other transformers TrainingArguments fields from the YAML, coerced (moetune.config.hf_args)
    extra_args: tuple[tuple[str, Any], ...] = derived(())


@dataclass(frozen=True)
class EngineConfig:
    """moetune's own options: the ``moetune:`` mapping of the YAML.

    ``device`` runs the dense part (``auto``: cuda when available); ``bind_cpus`` pins each of several processes
    on one machine to its share of the cores (``moetune.dist.affinity``); every other key is a field of
    :class:`~moetune.config.experts.ExpertOptions` (``expert_format``, ``int4_group_size``, ``int4_symmetric``,
    ``int8_activations``, ``expert_path``, ``expert_residency``, ``expert_residency_budget``, ``activation_policy``,
    ``num_threads``, ``check_finite``), validated by the same check as ``load_model``'s keywords and passed to it whole.
    docs/formats.md compares the expert formats.
    """

    device: str = option("auto", check=_device)
    # several processes on one machine: each pinned to its share of the cores, NUMA node by node
    # (moetune.dist.affinity); false leaves the launcher's placement alone
    bind_cpus: bool = option(True)
    experts: ExpertOptions = derived(ExpertOptions())


@dataclass(frozen=True)
class MoetuneConfig:
    """A validated ``moetune train`` configuration. Build it with :func:`moetune.config.load_config`."""

    model: ModelConfig
    finetune: FinetuneConfig
    data: DataConfig
    training: TrainingConfig
    engine: EngineConfig
    source: Path | None = None  # the YAML file it came from

    def summary(self) -> dict[str, Any]:
        """The settings as plain values (enums as strings, paths as str), for logs and run records."""
        return _plain(self)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# sections parsed from the flat top level, in order; the `moetune:` mapping is EngineConfig
FLAT_SECTIONS: tuple[type, ...] = (ModelConfig, FinetuneConfig, DataConfig, TrainingConfig)
ENGINE_KEY = "moetune"
ENGINE_OWN_KEYS = ("device", "bind_cpus")  # EngineConfig's own keys; the others are ExpertOptions'
ENGINE_KEYS = (*ENGINE_OWN_KEYS, *ExpertOptions.names())  # the keys of the `moetune:` mapping
