"""What a run trains, resolved once: LoRA, full, or freeze (LLaMA-Factory's ``finetuning_type``).

    FinetuneConfig -> ModeSettings (once) -> check on the meta model, before any weight is read (check_mode)
      -> the loaded model made trainable (apply_mode):
         lora    PEFT LoRA on ``lora_target`` (routed experts in moetune's expert layer; a router that is not an
                 nn.Linear through ``target_parameters``); ``additional_target`` modules train fully beside it
                 (PEFT ``modules_to_save``). Experts not targeted keep no trainable tensor: their engine runs
                 frozen (backward forms only the input and routing gradients).
         full    every parameter trains; each routed-experts module's base weights become CPU parameters whose
                 gradient the engine forms (``TrainMode.FULL``); the Trainer's optimizer updates them on the host.
         freeze  the layers/modules chosen by ``freeze_trainable_layers`` / ``freeze_trainable_modules`` /
                 ``freeze_extra_modules`` train fully (routed experts included when chosen), the rest is frozen.
                 No LoRA is added (LLaMA-Factory's freeze is no hybrid either).

Full and freeze models save as plain checkpoints in the base model's key layout (``CpuExperts.export_weights``),
so they need dense float experts: a quantized expert format is refused before the model loads.

Trainable parameters are upcast to fp32 in a bf16 run, as LLaMA-Factory does (``cast_trainable_params_to_fp32``):
an optimizer step on bf16 weights loses updates smaller than 2^-8 of the weight. ``pure_bf16: true`` (LLaMA-Factory's
key) keeps them, their gradients and AdamW's moments in bf16: half the host memory of the trained experts.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetune.adapters.check import entry_matches
from moetune.config.schema import FinetuneConfig, FinetuningType
from moetune.errors import ConfigError, listing
from moetune.layer import CpuExperts

logger = logging.getLogger(__name__)

ALL = "all"
AUX_COEF = "router_aux_loss_coef"  # the config field of transformers' MoE families with a load-balancing loss
_INDEX = re.compile(r"\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class ModeSettings:
    """The training mode of a run, from a validated ``FinetuneConfig``."""

    method: FinetuningType
    trainable_layers: int = 2  # freeze: > 0 the last N decoder layers, < 0 the first -N
    trainable_modules: tuple[str, ...] = (ALL,)  # freeze: module names inside each chosen layer, or all
    extra_modules: tuple[str, ...] = ()  # freeze: modules outside the layers (embed_tokens, norm, lm_head)
    additional: tuple[str, ...] = ()  # lora: modules trained fully beside the LoRA (PEFT modules_to_save)
    upcast: bool = False  # trainable weights in fp32 (a bf16 run)
    aux_loss_coef: float | None = None  # the router's load-balancing loss joins the loss with this weight

    @classmethod
    def from_config(cls, finetune: FinetuneConfig, *, bf16: bool = False) -> ModeSettings:
        """The mode of a validated config (``bf16``: the run's ``bf16`` key; ``pure_bf16`` keeps bf16 weights)."""
        return cls(
            method=finetune.finetuning_type,
            trainable_layers=finetune.freeze_trainable_layers,
            trainable_modules=tuple(finetune.freeze_trainable_modules),
            extra_modules=tuple(finetune.freeze_extra_modules or ()),
            additional=tuple(finetune.additional_target or ()),
            upcast=bf16 and not finetune.pure_bf16,
            aux_loss_coef=finetune.moe_aux_loss_coef,
        )

    @property
    def trains_base(self) -> bool:
        """Full or freeze: base weights train and the model saves as a plain checkpoint."""
        return self.method in (FinetuningType.FULL, FinetuningType.FREEZE)


def decoder_layers(model: nn.Module) -> tuple[str, int]:
    """(path, count) of the model's decoder-layer list: the ``nn.ModuleList`` holding the routed-experts sites
    (the longest such list). ``ConfigError`` when there is none."""
    lists = [(p, len(m)) for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    experts = [p for p, m in model.named_modules() if _is_experts(m)]
    holding = [(p, n) for p, n in lists if any(e.startswith(p + ".") for e in experts)]
    if not holding:
        raise ConfigError(
            f"finetuning_type freeze: found no decoder-layer list holding the routed experts in {type(model).__name__}"
        )
    return max(holding, key=lambda pn: pn[1])


def _is_experts(module: nn.Module) -> bool:
    """A routed-experts module: moetune's, or (on the meta model, before loading) a transformers one."""
    gate_up = getattr(module, "gate_up_proj", None)
    return isinstance(module, CpuExperts) or (isinstance(gate_up, torch.Tensor) and gate_up.dim() == 3)


def freeze_selection(model: nn.Module, settings: ModeSettings) -> list[str]:
    """Module paths that train fully in freeze mode, by LLaMA-Factory's rules (README "training modes"):
    ``freeze_trainable_layers`` N > 0: the last N decoder layers, N < 0: the first -N; in each,
    ``freeze_trainable_modules`` (``all``: the whole layer; else names below the layer, e.g. ``mlp``,
    ``self_attn``, ``mlp.experts``); plus ``freeze_extra_modules``, modules outside the layers named by their
    last path component (``embed_tokens``, ``norm``, ``lm_head``). Out-of-range counts and unknown names raise
    ``ConfigError`` (LLaMA-Factory clamps the count silently)."""
    root, count = decoder_layers(model)
    n = settings.trainable_layers
    if n == 0 or abs(n) > count:
        raise ConfigError(
            f"freeze_trainable_layers: {n} is out of range for this model's {count} decoder layers ({root}); "
            f"allowed: 1..{count} (the last N layers) or -{count}..-1 (the first N); set it in that range"
        )
    ids = range(count - n, count) if n > 0 else range(-n)
    paths = {p for p, _ in model.named_modules()}
    chosen: list[str] = []
    for name in settings.trainable_modules:
        if name == ALL:
            chosen += [f"{root}.{i}" for i in ids]
            continue
        missing = [i for i in ids if f"{root}.{i}.{name}" not in paths]
        if missing:
            below = sorted(
                {p[len(f"{root}.{ids[0]}.") :] for p in paths if p.startswith(f"{root}.{ids[0]}.")}
            )
            raise ConfigError(
                f"freeze_trainable_modules: {name!r} is not a module of decoder layer(s) {missing} ({root}.N.{name}); "
                f"allowed: all, or a module below the layer:{listing(below)}"
            )
        chosen += [f"{root}.{i}.{name}" for i in ids]
    outside = [p for p in paths if p and not p.startswith(root + ".") and p != root]
    for name in settings.extra_modules:
        hits = [p for p in outside if p.rpartition(".")[2] == name]
        if not hits:
            leaves = sorted({p.rpartition(".")[2] for p in outside})
            raise ConfigError(
                f"freeze_extra_modules: {name!r} names no module outside the decoder layers; "
                f"allowed: {listing(leaves, inline=True)}"
            )
        chosen += hits
    return chosen


def _experts_under(model: nn.Module, paths: list[str]) -> list[str]:
    """Routed-experts module paths at or below any of ``paths``."""
    return [
        p
        for p, m in model.named_modules()
        if _is_experts(m) and any(p == q or p.startswith(q + ".") for q in paths)
    ]


def check_mode_before_load(
    model_path: str, experts: Any, settings: ModeSettings, trust_remote_code: bool
) -> None:
    """:func:`check_mode` on ``model_path`` built on the meta device with the run's expert options
    (``ExpertOptions``), before any weight is read; nothing to check for LoRA without ``additional_target``."""
    if settings.method is FinetuningType.LORA and not settings.additional and settings.aux_loss_coef is None:
        return
    from moetune.loading.load import plan_load
    from moetune.loading.options import LoadOptions

    planned = plan_load(model_path, LoadOptions.create(experts=experts, trust_remote_code=trust_remote_code))
    check_mode_planned(planned, experts, settings)


def check_mode_planned(planned: Any, experts: Any, settings: ModeSettings) -> None:
    """:func:`check_mode` on a load already planned on the meta device (``moetune.loading.load.plan_load``'s
    result, as ``moetune.train.preflight`` makes it) with the run's expert options."""
    stored = experts.expert_path is not None  # a pre-quantized store: never dense float weights
    formats = ["store" if stored else f.name for f in planned.formats]
    check_mode(planned.model, settings, formats, [layer.site.path for layer in planned.plan.layers])
    _check_hot(planned.model, settings, [path for path, ids in planned.hot.items() if ids])


def _check_hot(meta_model: nn.Module, settings: ModeSettings, hot: list[str]) -> None:
    """Experts modules with hot experts (``gpu_experts``: frozen device copies) must not train fully."""
    if not hot or settings.method is FinetuningType.LORA:
        return
    trained = (
        set(hot)
        if settings.method is FinetuningType.FULL
        else set(_experts_under(meta_model, freeze_selection(meta_model, settings))) & set(hot)
    )
    if trained:
        raise ConfigError(
            f"moetune.gpu_experts puts experts of {listing(sorted(trained), inline=True)} on the device as frozen "
            f"copies, but finetuning_type: {settings.method.value} trains those experts' base weights in the CPU "
            "engine; set gpu_experts to 0, or leave those experts untrained (lora, or freeze without them)"
        )


def check_mode(meta_model: nn.Module, settings: ModeSettings, formats: list[str], sites: list[str]) -> None:
    """Every check of the mode that needs no weight, on the model built on the meta device: the freeze
    selection resolves, and every experts module that would train or save fully is held dense (``formats[j]``
    is the format name of ``sites[j]``), and the model has a router loss to weight. ``ConfigError`` naming the key
    and value."""
    if settings.aux_loss_coef is not None and not hasattr(meta_model.config, AUX_COEF):
        raise ConfigError(
            f"moe_aux_loss_coef: {settings.aux_loss_coef} is set, but {type(meta_model).__name__} computes no router "
            f"auxiliary loss (its config has no {AUX_COEF}); remove it"
        )
    if settings.method is FinetuningType.LORA:
        _check_additional(meta_model, settings)
        return
    if settings.method is FinetuningType.FREEZE:
        freeze_selection(meta_model, settings)
    quantized = [f"{s} ({f})" for s, f in zip(sites, formats, strict=True) if f != "dense"]
    if quantized:
        raise ConfigError(
            f"finetuning_type: {settings.method.value} trains and saves the routed experts as dense float weights, "
            f"but these are held quantized:{listing(quantized)}\nSet `moetune: {{expert_format: dense}}` (float "
            "checkpoints only, no expert_path store), or use finetuning_type: lora, which trains quantized experts"
        )


def _additional_paths(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    """Module paths matching ``additional_target`` names (the path or a dotted suffix, as PEFT matches)."""
    out = []
    for p, _ in model.named_modules():
        if any(entry_matches(p, n) for n in names):
            out.append(p)
    return out


def _check_additional(model: nn.Module, settings: ModeSettings) -> None:
    """``additional_target`` names modules of ``model``, none of them routed experts (``ConfigError``)."""
    missing = [n for n in settings.additional if not _additional_paths(model, (n,))]
    if missing:
        raise ConfigError(
            f"additional_target: {missing} matched no module of {type(model).__name__} (a name matches a module "
            "whose path ends with it, as in PEFT's modules_to_save); e.g. gate for the routers"
        )
    experts = set(_experts_under(model, _additional_paths(model, settings.additional)))
    if experts:
        raise ConfigError(
            f"additional_target: {list(settings.additional)} includes routed experts "
            f"({listing(sorted(experts), inline=True)}), which cannot be PEFT modules_to_save (they live in the CPU "
            "engine); train experts fully with finetuning_type: freeze (freeze_trainable_modules: mlp.experts) "
            "or full, or give them LoRA with lora_target"
        )


def _set_aux_loss(model: nn.Module, coef: float) -> None:
    """transformers adds ``router_aux_loss_coef`` * the load-balancing loss to the loss when the model outputs its
    router logits (LLaMA-Factory's ``moe_aux_loss_coef`` sets the same); its CausalLM copies the weight from the
    config when built, so the instances holding it get the new value too."""
    setattr(model.config, AUX_COEF, coef)
    model.config.output_router_logits = True  # type: ignore[union-attr]
    for module in model.modules():
        if hasattr(module, AUX_COEF):
            setattr(module, AUX_COEF, coef)


def apply_mode(model: nn.Module, settings: ModeSettings, lora: Any = None) -> nn.Module:
    """Make the loaded ``model`` trainable as ``settings`` says; returns what to train (a ``PeftModel`` for
    LoRA, the model itself otherwise). ``lora``: the ``LoraSettings`` of a LoRA run (default: its defaults)."""
    if settings.aux_loss_coef is not None:
        _set_aux_loss(model, settings.aux_loss_coef)
    if settings.method is FinetuningType.LORA:
        from moetune.adapters.apply import attach_lora

        _check_additional(model, settings)
        trained: nn.Module = attach_lora(model, lora, modules_to_save=settings.additional)
    else:
        _train_fully(model, settings)
        trained = model
    if settings.upcast:
        for p in trained.parameters():
            if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
                p.data = p.data.float()
    report = memory_report(trained)
    logger.info(
        "moetune: %s training: %s", settings.method.value, ", ".join(f"{k}={v}" for k, v in report.items())
    )
    return trained


def _train_fully(model: nn.Module, settings: ModeSettings) -> None:
    """Full or freeze: mark the chosen parameters trainable, put the routed experts among them in full mode
    (fp32 copies when upcasting) and let every experts module save its weights."""
    if settings.method is FinetuningType.FULL:
        from moetune.adapters.apply import beside_language_model

        model.requires_grad_(True)
        for path in beside_language_model(model):  # a vision tower and projector: frozen, as for LoRA
            model.get_submodule(path).requires_grad_(False)
        experts = None  # all of them
    else:
        chosen = freeze_selection(model, settings)
        model.requires_grad_(False)
        for path in chosen:
            model.get_submodule(path).requires_grad_(True)
        experts = set(_experts_under(model, chosen))
    dtype = torch.float32 if settings.upcast else None
    full, frozen = [], []
    for path, module in model.named_modules():
        if isinstance(module, CpuExperts):
            if experts is None or path in experts:
                module.train_base(dtype)
                full.append(path)
            else:
                module.export_weights()
                frozen.append(path)
    logger.info(
        "moetune: %s: %d routed-experts modules train fully (%s), %d stay frozen (%s)",
        settings.method.value,
        len(full),
        listing(full, inline=True) or "none",
        len(frozen),
        listing(frozen, inline=True) or "none",
    )


def memory_report(model: nn.Module, optimizer: Any = None) -> dict[str, Any]:
    """Trainable parameters by where they live, and what training them holds, in GiB. Host = the routed experts
    (and expert LoRA) in CPU RAM. Also the device memory of the hot experts' frozen weight copies (``gpu_experts``,
    ``moetune.layer.hot``).

    Per trained tensor: the weights, a gradient and AdamW's two moments (torch's AdamW makes them with
    ``zeros_like``: the parameter's dtype). With the full-mode expert optimizer (``optimizer``, an
    ``ExpertAdamW``, possibly wrapped by accelerate) the routed experts' share is what it holds instead: the
    weights, the state in its format (``host_expert_state_gb``: fp32 / bf16 / 8-bit moments, as allocated) and
    the most sparse fp32 gradient bytes held at once so far (``host_expert_grads_peak_gb``; only experts that
    received tokens have one)."""
    from moetune.train.expert_optim import unwrap

    experts = unwrap(optimizer)
    expert_ids = (
        {id(p) for lay in experts.layers for p in lay.params.values()} if experts is not None else set()
    )
    host_ids = {id(q) for m in host_modules(model) for q in m.parameters()}
    host = device = host_bytes = device_bytes = 0
    for p in model.parameters():
        if not p.requires_grad:
            continue
        # the experts' weights only here; their grads and state come from the optimizer below
        state = (
            p.numel() * p.element_size() * (1 if id(p) in expert_ids else 4)
        )  # weight (+ grad + 2 moments)
        if id(p) in host_ids:
            host, host_bytes = host + p.numel(), host_bytes + state
        else:
            device, device_bytes = device + p.numel(), device_bytes + state
    gib = 2**30
    report: dict[str, Any] = {"trainable_host_params": host, "trainable_device_params": device}
    if experts is not None:
        held = experts.host_bytes()
        host_bytes += held["state"] + held["grads_peak"]
        report["host_expert_state_gb"] = round(held["state"] / gib, 6)
        report["host_expert_grads_peak_gb"] = round(held["grads_peak"] / gib, 6)
        report["expert_optim_state"] = experts.state_name()
        report["expert_update"] = experts.spec.update.value
    report.update(
        host_train_state_gb=round(host_bytes / gib, 6),
        device_train_state_gb=round(device_bytes / gib, 6),
        hot_experts_device_gb=round(
            sum(m.hot.nbytes for m in model.modules() if isinstance(m, CpuExperts) and m.hot is not None)
            / gib,
            6,
        ),
    )
    return report


def host_modules(model: nn.Module) -> list[nn.Module]:
    """The modules whose tensors live in host memory whatever the device: routed experts and their LoRA."""
    from moetune.adapters.expert_layer import ExpertsLora

    return [m for m in model.modules() if isinstance(m, (CpuExperts, ExpertsLora))]
