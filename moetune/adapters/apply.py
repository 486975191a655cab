"""Attach LoRA to a loaded moetune model: stock PEFT on linear layers, engine expert LoRA on routed experts.

    model (from ``moetune.load_model``)
      -> resolve ``lora_target`` against the model: ``all`` = every ``nn.Linear`` except ``lm_head`` and the
         MoE routers, plus every routed-experts module (``CpuExperts``); names = modules whose path ends
         with the name (``q_proj``, ``experts``, ``gate`` for a linear router)
      -> each targeted ``CpuExperts`` is swapped, on the instance, for one whose engine (same weights object)
         carries an :class:`~moetune.engine.ExpertLoRA` (fp32 CPU parameters ``lora_gate_up_A`` ...)
      -> ``peft.get_peft_model`` wraps the linear targets; PEFT leaves trainable exactly the parameters whose
         names contain ``lora_``, which includes the experts' ``lora_*`` parameters.

Expert LoRA is initialised as PEFT initialises it (A kaiming-uniform, B zero) from the global torch RNG, so
seed with ``torch.manual_seed`` first for a reproducible run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetune.engine import ExpertLoRA
from moetune.errors import AdapterError
from moetune.layer import CpuExperts

logger = logging.getLogger(__name__)

ALL = "all"
EXCLUDED_LINEARS = ("lm_head",)  # never a target of "all" (LLaMA-Factory and PEFT's all-linear agree)
ROUTER_NAMES = ("gate", "router")  # the MoE block attribute holding the router in every supported family


@dataclass(frozen=True)
class LoraSettings:
    """What LoRA to attach. ``targets`` is ``("all",)`` or module names (path suffixes)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL,)
    use_rslora: bool = False

    @classmethod
    def from_config(cls, finetune: Any) -> LoraSettings:
        """From a validated ``moetune.config.FinetuneConfig``."""
        assert finetune.lora_alpha is not None, "lora_alpha is resolved during validation"
        return cls(
            rank=finetune.lora_rank,
            alpha=float(finetune.lora_alpha),
            dropout=finetune.lora_dropout,
            targets=tuple(finetune.lora_target),
            use_rslora=finetune.use_rslora,
        )


@dataclass(frozen=True)
class LoraTargets:
    """Resolved targets: module paths of the model that PEFT wraps, and of the experts that get engine LoRA."""

    linear: tuple[str, ...]
    experts: tuple[str, ...]


def _is_router(path: str, experts_blocks: set[str]) -> bool:
    block, _, leaf = path.rpartition(".")
    return leaf in ROUTER_NAMES and block in experts_blocks


def resolve_targets(model: nn.Module, targets: Sequence[str]) -> LoraTargets:
    """Which modules of ``model`` get LoRA for ``lora_target`` ``targets``; ``AdapterError`` if nothing matches."""
    experts = [p for p, m in model.named_modules() if isinstance(m, CpuExperts)]
    blocks = {p.rpartition(".")[0] for p in experts}
    linears = [p for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    if tuple(targets) == (ALL,):
        linear = [
            p for p in linears if p.rpartition(".")[2] not in EXCLUDED_LINEARS and not _is_router(p, blocks)
        ]
        chosen = LoraTargets(tuple(linear), tuple(experts))
    else:
        unmatched, linear, exp = [], [], []
        for name in targets:

            def hit(path: str, name: str = name) -> bool:
                return path == name or path.endswith("." + name)

            found_l, found_e = [p for p in linears if hit(p)], [p for p in experts if hit(p)]
            if not found_l and not found_e:
                unmatched.append(name)
            linear += [p for p in found_l if p not in linear]
            exp += [p for p in found_e if p not in exp]
        if unmatched:
            leaves = sorted({p.rpartition(".")[2] for p in linears} | {p.rpartition(".")[2] for p in experts})
            raise AdapterError(
                f"lora_target {unmatched} matched no module of {type(model).__name__}: searched the "
                f"{len(linears)} nn.Linear modules and {len(experts)} routed-experts modules (a name matches a "
                f"module whose path ends with it). Their names: {', '.join(leaves)}; or use 'all'. "
                "(Routers that are not nn.Linear cannot take LoRA.)"
            )
        chosen = LoraTargets(tuple(linear), tuple(exp))
    if not chosen.linear and not chosen.experts:
        raise AdapterError(
            f"lora_target {list(targets)} selects nothing in {type(model).__name__}: it has "
            f"{len(linears)} nn.Linear modules ({', '.join(linears[:5])}...) and {len(experts)} CpuExperts"
        )
    return chosen


def add_expert_lora(
    model: nn.Module, paths: Sequence[str], settings: LoraSettings, dtype: torch.dtype = torch.float32
) -> None:
    """Swap each ``CpuExperts`` at ``paths`` for one with fresh expert LoRA (fp32 master weights, PEFT's init).

    fp32 because the optimizer updates these tensors in place on the CPU: bf16 masters would lose small updates.
    """
    for path in paths:
        old = model.get_submodule(path)
        assert isinstance(old, CpuExperts), path
        eng = old.engine
        if eng.lora is not None:
            raise AdapterError(f"{path} already has expert LoRA; attach LoRA once per model")
        lora = ExpertLoRA.init(
            eng.num_experts,
            eng.hidden_size,
            eng.intermediate_size,
            settings.rank,
            settings.alpha,
            dropout=settings.dropout,
            use_rslora=settings.use_rslora,
            dtype=dtype,
        )
        set_expert_lora(model, path, lora)


def set_expert_lora(model: nn.Module, path: str, lora: ExpertLoRA) -> CpuExperts:
    """Replace the ``CpuExperts`` at ``path`` by one over the same weights with ``lora``; return the new module."""
    old = model.get_submodule(path)
    assert isinstance(old, CpuExperts), path
    new = CpuExperts(old.engine.with_lora(lora))
    new.train(old.training)
    new.shared_ahead = old.shared_ahead
    model.set_submodule(path, new)
    return new


def peft_target_modules(model: nn.Module, paths: Sequence[str]) -> list[str]:
    """Short PEFT ``target_modules`` entries naming exactly ``paths`` among ``model``'s modules.

    A module's last name (``q_proj``) is used when every module with that name is a target, else its full path.
    PEFT matches an entry against a module path exactly or as a dotted suffix.
    """
    chosen = set(paths)
    by_leaf: dict[str, list[str]] = {}
    for p, _ in model.named_modules():
        if p:
            by_leaf.setdefault(p.rpartition(".")[2], []).append(p)
    out: list[str] = []
    for p in paths:
        leaf = p.rpartition(".")[2]
        entry = leaf if all(q in chosen for q in by_leaf[leaf]) else p
        if entry not in out:
            out.append(entry)
    return out


def _without_remapped(model: nn.Module, linear: Sequence[str], settings: LoraSettings) -> list[str]:
    """``linear`` minus modules whose names stock PEFT rewrites for this model type, so that the adapter means
    the same thing when stock PEFT loads it.

    PEFT (0.19+) converts transformers-v4 MoE target names for some families when it injects an adapter,
    including when loading one: in Qwen2/Qwen3-MoE ``gate_proj``/``up_proj``/``down_proj`` become the fused
    experts' ``target_parameters`` (with doubled rank), so a dense or shared MLP with those names cannot carry
    a portable LoRA there. With ``all`` they are skipped (and logged); named explicitly, that is an error.
    """
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    names = peft_target_modules(model, linear)
    probe = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, target_modules=list(names))  # type: ignore[arg-type]
    convert_peft_config_for_transformers(probe, model, None)
    kept_names = set(probe.target_modules or ())
    remapped = [n for n in names if n not in kept_names]
    if not remapped:
        return list(linear)
    dropped = [p for p in linear if any(p == n or p.endswith("." + n) for n in remapped)]
    if tuple(settings.targets) != (ALL,):
        raise AdapterError(
            f"lora_target names {remapped} in {getattr(model.config, 'model_type', '?')} cannot be saved as a stock PEFT adapter: "
            f"PEFT rewrites them into the routed experts' target_parameters when loading (modules {dropped}). "
            "Leave them out (the routed experts are targeted as 'experts')."
        )
    logger.warning(
        "moetune: lora_target all skips %d linear modules PEFT would reinterpret as routed experts for %s: %s",
        len(dropped),
        getattr(model.config, "model_type", "?"),
        ", ".join(dropped),
    )
    return [p for p in linear if p not in dropped]


def attach_lora(model: nn.Module, settings: LoraSettings | None = None, **kwargs: Any) -> Any:
    """Give a ``moetune.load_model`` model trainable LoRA; returns the ``peft.PeftModel`` to train.

    ``settings`` (or keyword arguments of :class:`LoraSettings`: ``rank``, ``alpha``, ``dropout``, ``targets``,
    ``use_rslora``). Linear targets get stock PEFT LoRA; routed experts get engine expert LoRA. Everything
    else is frozen. Save the result with :func:`moetune.adapters.save_adapter` (stock PEFT format).
    """
    from peft import LoraConfig, get_peft_model

    settings = settings or LoraSettings(**kwargs)
    targets = resolve_targets(model, settings.targets)
    add_expert_lora(model, targets.experts, settings)
    if not targets.linear:
        raise AdapterError(
            f"lora_target {list(settings.targets)} selects only routed experts; moetune trains them through a "
            "PEFT model, which needs at least one linear target too (add e.g. q_proj, v_proj, or use 'all')"
        )
    linear = _without_remapped(model, targets.linear, settings)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # PEFT annotates int; float works
        lora_dropout=settings.dropout,
        target_modules=peft_target_modules(model, linear),
        use_rslora=settings.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(model, config)
    # PEFT 0.21 finds adapter parameters structurally (its own tuner layers), not by the "lora_" in their names,
    # so it freezes the experts' LoRA parameters too: make them trainable again.
    for experts in expert_modules(peft_model).values():
        for p in experts.parameters():
            p.requires_grad_(True)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    logger.info(
        "moetune: LoRA r=%d alpha=%g on %d linear modules and %d routed-experts modules; %d trainable parameters",
        settings.rank,
        settings.alpha,
        len(linear),
        len(targets.experts),
        trainable,
    )
    return peft_model


def expert_modules(model: nn.Module) -> dict[str, CpuExperts]:
    """``{path in the original model: CpuExperts}`` for every experts module carrying LoRA (PEFT prefix removed)."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, CpuExperts) and m.engine.lora is not None:
            out[path.removeprefix("base_model.model.")] = m
    return out
