"""Attach LoRA to a loaded moetune model: stock PEFT on linear layers, engine expert LoRA on routed experts.

    model (from ``moetune.load_model``)
      -> resolve ``lora_target`` against the model: ``all`` = every ``nn.Linear`` except ``lm_head`` and the
         MoE routers (attention, dense MLPs, shared experts, shared-expert gates), plus every routed-experts
         module (``CpuExperts``); names = modules whose path ends with the name (``q_proj``, ``experts``,
         ``gate`` for a linear router)
      -> each targeted ``CpuExperts`` is swapped, on the instance, for one whose engine (same weights object)
         carries an :class:`~moetune.engine.ExpertLoRA` (fp32 CPU parameters ``lora_gate_up_A`` ...)
      -> linear modules whose names stock PEFT rewrites for this model type (see :func:`peft_renamed`) are
         wrapped in PEFT's ``lora.Linear`` directly; ``peft.get_peft_model`` wraps the other linear targets by
         name, then casts and marks trainable all of PEFT's LoRA layers. The experts' ``lora_*`` parameters
         are made trainable again after it (PEFT freezes everything that is not one of its layers).

The live PEFT config records the directly wrapped modules as ``target_parameters`` (``<module>.weight``): that
is how stock PEFT must target them when it loads the saved adapter (PEFT's ``ParamWrapper`` over a 2-D weight
computes ``(W + s B A) x``, the same as a LoRA ``Linear``, with the same state-dict keys).

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
    new = old.with_engine(old.engine.with_lora(lora))
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


def peft_renamed(model: nn.Module, linear: Sequence[str]) -> list[str]:
    """The modules among ``linear`` that stock PEFT cannot target by module name for this model type.

    PEFT (0.19+) converts transformers-v4 MoE target names whenever it injects an adapter, also when it loads
    a saved one (``convert_peft_config_for_transformers``): for model types converted with the Qwen2-MoE
    pattern (Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, ERNIE-4.5-MoE, ...) every ``target_modules``
    entry ending in ``gate_proj`` / ``up_proj`` / ``down_proj`` becomes the routed experts' fused
    ``gate_up_proj`` / ``down_proj`` (with doubled rank), and a lone ``gate_proj`` is an error. A dense MLP
    or a shared expert with those names therefore cannot be targeted by name; moetune targets its weight
    instead. The rule is PEFT's own, asked per leaf name (the conversion matches names as dotted suffixes).
    """
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers

    renamed = set()
    for leaf in sorted({p.rpartition(".")[2] for p in linear}):
        probe = LoraConfig(target_modules=[leaf])
        try:
            convert_peft_config_for_transformers(probe, model, None)
        except ValueError:  # a fused pair named alone (gate_proj without up_proj): PEFT refuses to load it
            renamed.add(leaf)
            continue
        if leaf not in (probe.target_modules or ()):
            renamed.add(leaf)
    return [p for p in linear if p.rpartition(".")[2] in renamed]


def peft_model_with(
    model: nn.Module, config: Any, by_weight: Sequence[str], weight_entries: Sequence[str]
) -> Any:
    """``get_peft_model(model, config)``, plus LoRA on the ``nn.Linear`` modules at ``by_weight``.

    Those get PEFT's own ``lora.Linear`` for adapter ``"default"``, the layer ``get_peft_model`` would create
    (``config``'s rank, alpha, dropout, rsLoRA and init), made here because PEFT would rename them (see
    :func:`peft_renamed`); ``get_peft_model`` then casts their dtype like its own layers. ``weight_entries``
    (their ``target_parameters``, how stock PEFT must target them) go into the live config, so that the saved
    config carries them.
    """
    from peft import get_peft_model
    from peft.tuners.lora import Linear as LoraLinear

    # PEFT freezes the base model only when it finds no LoRA layer in it; with the ones below in place it keeps
    # the trainability it finds, so freeze first (it makes its adapters trainable itself).
    model.requires_grad_(False)
    for path in by_weight:
        base = model.get_submodule(path)
        assert isinstance(base, nn.Linear), path
        model.set_submodule(
            path, LoraLinear(base, "default", config=config, r=config.r, lora_alpha=config.lora_alpha)
        )
    peft_model = get_peft_model(model, config)
    if weight_entries:
        peft_model.peft_config["default"].target_parameters = list(weight_entries)
    return peft_model


def linear_weight_paths(model: nn.Module, target_parameters: Sequence[str]) -> dict[str, list[str]]:
    """``{entry: nn.Linear module paths}`` for the ``target_parameters`` entries that name Linear weights.

    An entry matches ``<module path>.weight`` exactly or as a dotted suffix, as in PEFT; entries naming no
    Linear weight (the routed experts' ``gate_up_proj`` / ``down_proj``) are left out.
    """
    weights = [p for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    out: dict[str, list[str]] = {}
    for entry in target_parameters:
        hits = [p for p in weights if f"{p}.weight" == entry or f"{p}.weight".endswith("." + entry)]
        if hits:
            out[entry] = hits
    return out


def attach_lora(model: nn.Module, settings: LoraSettings | None = None, **kwargs: Any) -> Any:
    """Give a ``moetune.load_model`` model trainable LoRA; returns the ``peft.PeftModel`` to train.

    ``settings`` (or keyword arguments of :class:`LoraSettings`: ``rank``, ``alpha``, ``dropout``, ``targets``,
    ``use_rslora``). Linear targets get stock PEFT LoRA; routed experts get engine expert LoRA. Everything
    else is frozen. Save the result with :func:`moetune.adapters.save_adapter` (stock PEFT format).
    """
    from peft import LoraConfig

    settings = settings or LoraSettings(**kwargs)
    targets = resolve_targets(model, settings.targets)
    by_weight = peft_renamed(model, targets.linear)
    by_name = [p for p in targets.linear if p not in by_weight]
    if not by_name:
        raise AdapterError(
            f"lora_target {list(settings.targets)} selects {len(targets.experts)} routed-experts modules and "
            f"{len(by_weight)} MLP projections whose names PEFT rewrites, but no linear layer PEFT targets by "
            "name; moetune trains through a PEFT model, which needs at least one (add e.g. q_proj, v_proj, or "
            "use 'all')"
        )
    add_expert_lora(model, targets.experts, settings)
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # PEFT annotates int; float works
        lora_dropout=settings.dropout,
        target_modules=peft_target_modules(model, by_name),
        use_rslora=settings.use_rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    weight_entries = [f"{entry}.weight" for entry in peft_target_modules(model, by_weight)]
    peft_model = peft_model_with(model, config, by_weight, weight_entries)
    # PEFT 0.21 finds adapter parameters structurally (its own tuner layers), not by the "lora_" in their names,
    # so it freezes the experts' LoRA parameters too: make them trainable again.
    for experts in expert_modules(peft_model).values():
        for p in experts.parameters():
            p.requires_grad_(True)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    logger.info(
        "moetune: LoRA r=%d alpha=%g on %d linear modules (%d by weight, as stock PEFT will load them) and %d "
        "routed-experts modules; %d trainable parameters",
        settings.rank,
        settings.alpha,
        len(targets.linear),
        len(by_weight),
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
