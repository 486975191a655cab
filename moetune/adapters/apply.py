"""Attach LoRA to a loaded moetune model: PEFT on linear layers and, through moetune's PEFT layer, routed experts.

    model (from ``moetune.load_model``)
      -> resolve ``lora_target`` against the model: ``all`` = every ``nn.Linear`` except ``lm_head`` and the
         MoE routers (attention, dense MLPs, shared experts, shared-expert gates), plus every routed-experts
         module (``CpuExperts``); names = modules whose path ends with the name (``q_proj``, ``experts``,
         ``gate`` for a linear router)
      -> each targeted ``CpuExperts`` is wrapped in place, adapter-less, in two nested
         :class:`~moetune.adapters.expert_layer.ExpertsLora` layers (the module itself, its engine, layout and
         shared-experts overlap stay as they are); linear modules whose names stock PEFT rewrites for this
         model type (see :func:`peft_renamed`) are wrapped in PEFT's ``lora.Linear`` directly
      -> ``peft.get_peft_model`` with ``target_modules`` = the other linear targets and the experts modules:
         PEFT adds adapter ``"default"`` to them (to the experts through ``ExpertsLora.update_layer``), then
         casts and marks trainable all of its LoRA layers, expert LoRA included
      -> the live config is rewritten into the form stock PEFT loads on the unmodified transformers model:
         the experts and the directly wrapped linears move from ``target_modules`` to ``target_parameters``
         (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``, ``<module>.weight``) and ``lora_dropout``
         becomes 0 when there are any (``ParamWrapper`` refuses dropout; it changes no saved weight, and the
         layers keep the dropout they were built with). ``PeftModel.save_pretrained``, a plain ``Trainer``'s
         checkpoints and :func:`moetune.adapters.save_adapter` all write this config.

PEFT's ``ParamWrapper`` over a 2-D weight computes ``(W + s B A) x``, the same as a LoRA ``Linear``, with the
same state-dict keys; over the fused experts parameters it has the keys and shapes ``ExpertsLora`` has.

LoRA is initialised as PEFT initialises it (A kaiming-uniform, B zero) from the global torch RNG, so seed with
``torch.manual_seed`` first for a reproducible run.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from moetune.adapters.check import entry_matches
from moetune.adapters.peft_layout import PEFT_MODEL_PREFIX, ExpertParamNames, unwrapped_path
from moetune.errors import AdapterError, listing
from moetune.layer import CpuExperts

logger = logging.getLogger(__name__)

GRADIENT_CHECKPOINTING_DEPRECATION = "`is_gradient_checkpointing` is deprecated"  # transformers 5's warning

ALL = "all"
EXCLUDED_LINEARS = ("lm_head",)  # never a target of "all" (LLaMA-Factory and PEFT's all-linear agree)
# PEFT 0.21 refuses LoRA on these module names in these model types (its _check_lora_target_modules_mamba: a Mamba
# mixer's out_proj and conv1d), wherever they sit in the model
PEFT_REFUSED = {
    t: ("out_proj", "conv1d") for t in ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")
}
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
    routers: tuple[str, ...] = ()  # MoE routers that are not nn.Linear (v5 TopKRouter): LoRA on their weight


def _plain_linear(module: nn.Module) -> bool:
    """Whether ``module`` computes as ``nn.Linear`` does (its class does not override ``forward``)."""
    return type(module).forward is nn.Linear.forward


def _is_router(path: str, experts_blocks: set[str]) -> bool:
    block, _, leaf = path.rpartition(".")
    return leaf in ROUTER_NAMES and block in experts_blocks


def _is_weight_router(path: str, module: nn.Module, experts_blocks: set[str]) -> bool:
    """A router that is not an ``nn.Linear`` but owns a 2-D ``weight`` (transformers v5 ``TopKRouter``): PEFT
    gives it LoRA through ``target_parameters`` (``ParamWrapper``: ``(W + s B A) x``)."""
    weight = getattr(module, "weight", None)
    return (
        _is_router(path, experts_blocks)
        and not isinstance(module, nn.Linear)
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 2
    )


def weight_routers(model: nn.Module, experts: Sequence[str]) -> list[str]:
    """Paths of ``model``'s MoE routers that are not ``nn.Linear`` but own a 2-D ``weight`` (transformers v5
    ``TopKRouter``; :func:`_is_weight_router`), given the routed-experts module paths ``experts``."""
    blocks = {p.rpartition(".")[0] for p in experts}
    return [p for p, m in model.named_modules() if _is_weight_router(p, m, blocks)]


def language_model_path(model: nn.Module) -> str:
    """The path of ``model``'s language model (transformers' ``get_decoder()``: ``model.language_model`` in a
    vision-language model, ``model`` in a text one), or ``""`` where the model names none (all of it counts)."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    return next((p for p, m in model.named_modules() if m is decoder and decoder is not model), "")


def beside_language_model(model: nn.Module) -> list[str]:
    """Paths of the language model's siblings in the base model (``model.visual`` beside
    ``model.language_model``: a vision tower and its projector), which moetune, training on text, keeps frozen as
    LLaMA-Factory's freeze_vision_tower / freeze_multi_modal_projector defaults do; none in a text model (its
    language model ``model`` sits at the root, beside ``lm_head``)."""
    inside = language_model_path(model)
    parent, _, _ = inside.rpartition(".")
    if not parent:
        return []
    return [
        f"{parent}.{name}"
        for name, _ in model.get_submodule(parent).named_children()
        if f"{parent}.{name}" != inside
    ]


def resolve_targets(
    model: nn.Module, targets: Sequence[str], experts: Sequence[str] | None = None
) -> LoraTargets:
    """Which modules of ``model`` get LoRA for ``lora_target`` ``targets``; ``AdapterError`` if nothing matches.

    ``experts``: the routed-experts module paths; by default the model's ``CpuExperts``. A model built on the
    meta device from the config (``moetune.train.preflight``, before any weight loads) passes the paths
    ``moetune.arch.find_experts`` found, so a typo is reported with the same words before the load.
    """
    experts = (
        list(experts)
        if experts is not None
        else [p for p, m in model.named_modules() if isinstance(m, CpuExperts)]
    )
    blocks = {p.rpartition(".")[0] for p in experts}
    # moetune trains on text: a vision tower's and a projector's linears stay frozen (beside_language_model)
    inside = language_model_path(model)
    outside = tuple(f"{p}." for p in beside_language_model(model))
    every = [p for p, m in model.named_modules() if isinstance(m, nn.Linear) and _plain_linear(m)]
    linears = [p for p in every if not p.startswith(outside)]  # startswith(()) is False: all, in a text model
    frozen = [p for p in every if p.startswith(outside)]
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    refused: tuple[str, ...] = PEFT_REFUSED.get(model_type, ())
    # nn.Linear subclasses computing something else (DeepSeek-V4's block-diagonal o_a_proj): PEFT's Linear LoRA
    # would add a full-matrix update to a grouped product (it fails on their 4-D input)
    own = {
        p: type(m).__name__
        for p, m in model.named_modules()
        if isinstance(m, nn.Linear) and not _plain_linear(m)
    }
    routers = weight_routers(model, experts)
    if tuple(targets) == (ALL,):
        linear = [
            p
            for p in linears
            if p.rpartition(".")[2] not in (*EXCLUDED_LINEARS, *refused)
            # a router, or a Linear inside one (LongCat-Flash's router.classifier, whose weight the router reads
            # directly: Linear LoRA there would never run)
            and not _is_router(p, blocks)
            and not _is_router(p.rpartition(".")[0], blocks)
        ]
        if left := [p for p in linears if p.rpartition(".")[2] in refused]:
            logger.info(
                "moetune: lora_target all leaves out %d module(s) named %s, which PEFT refuses LoRA on in %s models",
                len(left),
                "/".join(refused),
                model_type,
            )
        if own:
            logger.info(
                "moetune: lora_target all leaves out %d nn.Linear subclass(es) with their own forward, which LoRA "
                "for nn.Linear does not fit: %s",
                len(own),
                listing(sorted(f"{p} ({c})" for p, c in own.items()), inline=True),
            )
        if frozen:
            logger.info(
                "moetune: lora_target all leaves the %d nn.Linear modules outside the language model (%s) frozen",
                len(frozen),
                inside,
            )
        chosen = LoraTargets(tuple(linear), tuple(experts))
    else:
        unmatched, linear, exp, router = [], [], [], []
        for name in targets:

            def hit(path: str, name: str = name) -> bool:
                return entry_matches(path, name)

            if odd := [p for p in linears if hit(p) and p.rpartition(".")[2] in refused]:
                raise AdapterError(
                    f"lora_target {name!r} names {listing(odd[:4], inline=True)}: PEFT refuses LoRA on modules named "
                    f"{' or '.join(refused)} in {model_type} models (a Mamba mixer's projections); "
                    "leave them out of lora_target"
                )

            found_l, found_e = [p for p in linears if hit(p)], [p for p in experts if hit(p)]
            if odd := sorted(f"{p} ({c})" for p, c in own.items() if hit(p)):
                raise AdapterError(
                    f"lora_target {name!r} names nn.Linear subclasses with their own forward, {listing(odd, inline=True)}: "
                    "they do not compute x @ W^T + b (DeepSeek-V4's o_a_proj is a block-diagonal grouped projection), "
                    "so PEFT's LoRA for nn.Linear does not fit them; leave them out of lora_target"
                )
            found_r = [p for p in routers if hit(p)]
            if not found_l and not found_e and not found_r:
                if vision := [p for p in frozen if hit(p)]:
                    raise AdapterError(
                        f"lora_target {name!r} names only modules outside the language model "
                        f"({listing(vision[:4], inline=True)}{', ...' if len(vision) > 4 else ''}): moetune trains on "
                        "text and keeps a vision tower and projector frozen (LLaMA-Factory's freeze_vision_tower / "
                        "freeze_multi_modal_projector defaults); target the language model's modules"
                    )
                unmatched.append(name)
            linear += [p for p in found_l if p not in linear]
            exp += [p for p in found_e if p not in exp]
            router += [p for p in found_r if p not in router]
        if unmatched:
            leaves = sorted({p.rpartition(".")[2] for p in [*linears, *experts, *routers]})
            raise AdapterError(
                f"lora_target {unmatched} matched no module of {type(model).__name__}: searched the "
                f"{len(linears)} nn.Linear modules, {len(experts)} routed-experts modules and {len(routers)} "
                f"routers (a name matches a module whose path ends with it). Their names: {', '.join(leaves)}; "
                "or use 'all'."
            )
        chosen = LoraTargets(tuple(linear), tuple(exp), tuple(router))
    if not chosen.linear and not chosen.experts and not chosen.routers:
        raise AdapterError(
            f"lora_target {list(targets)} selects nothing in {type(model).__name__}: it has "
            f"{len(linears)} nn.Linear modules ({', '.join(linears[:5])}...) and {len(experts)} CpuExperts"
        )
    return chosen


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
    instead. The rule is PEFT's own, asked per leaf name (the conversion matches names as dotted suffixes). PEFT 0.22
    keeps a converted name beside the fused parameters it adds, and only where ``model`` has them, so on moetune's
    models it renames fewer (often none) and those modules are targeted by name, saved as ``mlp.gate_proj``
    (:func:`qualified_targets`).
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


def expert_target_parameters(paths: Sequence[str], names: ExpertParamNames | None = None) -> list[str]:
    """``target_parameters`` for experts modules at ``paths``: ``<path after its layer index>.<param>`` when that
    suffix is shared by every path (``mlp.experts.gate_up_proj``), else each full path; gate_up then down.
    ``names``: the modules' parameter names (default ``gate_up_proj`` / ``down_proj``)."""
    names = names or ExpertParamNames()
    tails = {_after_layer_index(p) for p in paths}
    if len(tails) == 1:
        (tail,) = tails
        return names.target_parameters(tail)
    return [entry for p in paths for entry in names.target_parameters(p)]


def _after_layer_index(path: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``mlp.experts`` (the part after the last numeric component)."""
    parts = path.split(".")
    idx = max((i for i, part in enumerate(parts) if part.isdigit()), default=-1)
    return ".".join(parts[idx + 1 :])


def to_stock_config(
    peft_model: Any, adapter_name: str = "default", weight_entries: Sequence[str] = ()
) -> None:
    """Rewrite adapter ``adapter_name``'s live PEFT config, in place, into the form stock PEFT loads on the
    unmodified transformers model, which ``save_pretrained`` then writes.

    The routed-experts modules carrying the adapter leave ``target_modules`` and appear in ``target_parameters``
    as their fused parameters (:func:`expert_target_parameters`), after ``weight_entries`` (``<module>.weight``
    of linears wrapped directly, see :func:`peft_model_with`) and the entries it already has; ``lora_dropout``
    becomes 0 when there are any (``ParamWrapper`` refuses dropout; the layers keep the dropout they were built
    with and no saved weight depends on it). Idempotent. Call it after ``peft_model.add_adapter(name, config)``
    with the experts in ``target_modules`` to save that adapter for stock PEFT.
    """
    live = peft_model.peft_config[adapter_name]
    carrying = {p: m for p, m in expert_modules(peft_model).items() if adapter_name in m.lora_A}
    experts = list(carrying)
    if isinstance(live.target_modules, str) and experts:
        raise AdapterError(
            f"adapter {adapter_name!r}: target_modules is the pattern {live.target_modules!r}; name the modules "
            "in a list to save routed-expert LoRA for stock PEFT"
        )
    modules = set(live.target_modules or ())  # PEFT may have made it a set
    in_experts = {e for e in modules if any(entry_matches(p, e) for p in experts)}
    names = ExpertParamNames.of(next(iter(carrying.values())).experts) if carrying else None
    expert_params = expert_target_parameters(experts, names)
    others = {*weight_entries, *(live.target_parameters or ())} - set(expert_params)
    params = sorted(others) + expert_params
    live.target_modules = qualified_targets(peft_model, adapter_name, sorted(modules - in_experts)) or None
    live.target_parameters = params or None
    if params:
        live.lora_dropout = 0.0


def qualified_targets(peft_model: Any, adapter_name: str, entries: Sequence[str]) -> list[str]:
    """``target_modules`` ``entries`` with each bare name (``gate_proj``) replaced by the distinct
    ``<parent>.<name>`` suffixes of the modules carrying adapter ``adapter_name`` under it (``mlp.gate_proj``,
    ``shared_expert.gate_proj``): the same modules, named so that stock PEFT 0.22's loader leaves them alone. On a
    model whose experts transformers 5 fused, PEFT 0.22 maps a bare name a transformers-4 checkpoint gave its expert
    projections (``gate_proj``, ``up_proj``, ``down_proj``, ``w1`` ...) onto the fused expert parameters as well,
    twice the rank for gate_up, and then refuses the adapter (size mismatch); ``mlp.gate_proj`` maps onto no
    parameter (``mlp.experts.gate_up_proj`` does not end in ``.mlp.gate_up_proj``). Entries with a dot, and bare
    names no module carries the adapter under, are kept as they are."""
    carrying = [
        unwrapped_path(path.removeprefix(PEFT_MODEL_PREFIX))
        for path, module in peft_model.named_modules()
        if isinstance(getattr(module, "lora_A", None), nn.ModuleDict) and adapter_name in module.lora_A
    ]
    out: set[str] = set()
    for entry in entries:
        hits = (
            {".".join(p.split(".")[-2:]) for p in carrying if entry_matches(p, entry)}
            if "." not in entry
            else set()
        )
        out |= hits or {entry}
    return sorted(out)


def peft_model_with(
    model: nn.Module,
    config: Any,
    by_weight: Sequence[str],
    experts: Sequence[str],
    weight_entries: Sequence[str],
) -> Any:
    """What ``get_peft_model(model, config)`` builds, with LoRA also on the ``nn.Linear`` modules at ``by_weight`` and the
    ``CpuExperts`` at ``experts``; the live config is then in stock form (:func:`to_stock_config`).

    The linears get PEFT's own ``lora.Linear`` for adapter ``"default"``, the layer ``get_peft_model`` would
    create (``config``'s rank, alpha, dropout, rsLoRA and init), made here because PEFT would rename them (see
    :func:`peft_renamed`); ``weight_entries`` are their ``target_parameters``. The experts are wrapped
    adapter-less (``expert_layer.wrap``) and named in ``target_modules``, so that ``get_peft_model`` adds the
    adapter to them with ``update_layer`` (it cannot create their layers itself: ``expert_layer`` says why).
    """
    from peft import MODEL_TYPE_TO_PEFT_MODEL_MAPPING, PeftModel
    from peft.tuners.lora import Linear as LoraLinear

    from moetune.adapters.expert_layer import wrap

    expert_entries = peft_target_modules(model, experts)
    # PEFT freezes the base model only when it finds no LoRA layer in it; with the ones below in place it keeps
    # the trainability it finds, so freeze first (it makes its adapters trainable itself).
    model.requires_grad_(False)
    for path in by_weight:
        base = model.get_submodule(path)
        assert isinstance(base, nn.Linear), path
        model.set_submodule(
            path, LoraLinear(base, "default", config=config, r=config.r, lora_alpha=config.lora_alpha)
        )
    for path in experts:
        module = model.get_submodule(path)
        assert isinstance(module, CpuExperts), path
        model.set_submodule(path, wrap(module))
    config.target_modules = [*(config.target_modules or []), *expert_entries]
    # The class get_peft_model builds for a LoRA config (its task type's PeftModel subclass, else PeftModel) and
    # its one other step for it, recording the base model's name. get_peft_model itself would warn that the model
    # already holds PEFT layers ("modify a model with PEFT for a second time"): the ones just made for this call.
    config.base_model_name_or_path = model.__dict__.get("name_or_path") or None
    with warnings.catch_warnings():
        # PeftModel reads model.is_gradient_checkpointing, which transformers 5 deprecates with a FutureWarning on
        # every construction: PEFT's call into transformers, nothing a user of moetune can act on
        warnings.filterwarnings("ignore", message=GRADIENT_CHECKPOINTING_DEPRECATION, category=FutureWarning)
        peft_model = MODEL_TYPE_TO_PEFT_MODEL_MAPPING.get(config.task_type, PeftModel)(model, config)
    to_stock_config(peft_model, "default", weight_entries)
    from moetune.adapters.lora_experts_config import carry_lora_experts

    carry_lora_experts(peft_model, model)  # PEFT's save_pretrained keeps the LoRA-experts file in step
    return peft_model


def linear_weight_paths(model: nn.Module, target_parameters: Sequence[str]) -> dict[str, list[str]]:
    """``{entry: nn.Linear module paths}`` for the ``target_parameters`` entries that name Linear weights.

    An entry matches ``<module path>.weight`` exactly or as a dotted suffix, as in PEFT; entries naming no
    Linear weight (the routed experts' ``gate_up_proj`` / ``down_proj``) are left out.
    """
    weights = [p for p, m in model.named_modules() if isinstance(m, nn.Linear)]
    out: dict[str, list[str]] = {}
    for entry in target_parameters:
        hits = [p for p in weights if entry_matches(f"{p}.weight", entry)]
        if hits:
            out[entry] = hits
    return out


def check_router_dropout(targets: LoraTargets, dropout: float) -> None:
    """``AdapterError`` when ``targets`` hold non-Linear routers and ``dropout`` is not 0 (PEFT's
    ``target_parameters`` LoRA refuses dropout); also asked before the weights load (``moetune.train.preflight``)."""
    if targets.routers and dropout:
        raise AdapterError(
            f"lora_dropout: {dropout} with the routers {list(targets.routers[:2])}... among lora_target: "
            "PEFT gives a non-Linear router LoRA through target_parameters, which refuses dropout; set lora_dropout: 0"
        )


def attach_lora(
    model: nn.Module,
    settings: LoraSettings | None = None,
    *,
    modules_to_save: Sequence[str] = (),
    **kwargs: Any,
) -> Any:
    """Give a ``moetune.load_model`` model trainable LoRA; returns the ``peft.PeftModel`` to train.

    ``settings`` (or keyword arguments of :class:`LoraSettings`: ``rank``, ``alpha``, ``dropout``, ``targets``,
    ``use_rslora``). Linear targets get stock PEFT LoRA; routed experts get expert LoRA in moetune's PEFT layer
    (:class:`~moetune.adapters.expert_layer.ExpertsLora`). Everything else is frozen. Save the result with
    ``peft_model.save_pretrained(dir)`` or :func:`moetune.adapters.save_adapter` (atomic): a stock PEFT
    adapter that ``PeftModel.from_pretrained`` loads on the unmodified transformers model.

    A router named in the targets that is not an ``nn.Linear`` (transformers v5 ``TopKRouter``) gets LoRA on its
    ``weight`` through PEFT's ``target_parameters``. ``modules_to_save``: module names trained fully beside the
    LoRA (PEFT's own ``modules_to_save``: a trainable copy saved with the adapter; LLaMA-Factory's
    ``additional_target``), e.g. a router.
    """
    from peft import LoraConfig
    from peft.tuners.tuners_utils import BaseTunerLayer

    settings = settings or LoraSettings(**kwargs)
    if any(isinstance(m, BaseTunerLayer) for m in model.modules()):
        raise AdapterError(
            f"{type(model).__name__} already has LoRA attached; attach LoRA once per model. Add another adapter "
            "with peft_model.add_adapter(name, LoraConfig(target_modules=[..., 'experts'], ...))."
        )
    targets = resolve_targets(model, settings.targets)
    by_weight = peft_renamed(model, targets.linear)
    by_name = [p for p in targets.linear if p not in by_weight]
    check_router_dropout(targets, settings.dropout)
    if not by_name and not targets.experts and not targets.routers:
        raise AdapterError(
            f"lora_target {list(settings.targets)} selects only {len(by_weight)} MLP projections whose names PEFT "
            "rewrites and no module PEFT targets by name; moetune trains through a PEFT model, which needs at "
            "least one (add e.g. q_proj, v_proj or experts, or use 'all')"
        )
    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,  # type: ignore[arg-type]  # PEFT annotates int; float works
        lora_dropout=settings.dropout,
        target_modules=peft_target_modules(model, by_name),
        target_parameters=[f"{entry}.weight" for entry in peft_target_modules(model, targets.routers)]
        or None,
        use_rslora=settings.use_rslora,
        modules_to_save=list(modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    weight_entries = [f"{entry}.weight" for entry in peft_target_modules(model, by_weight)]
    peft_model = peft_model_with(model, config, by_weight, targets.experts, weight_entries)
    trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
    logger.info(
        "moetune: LoRA r=%d alpha=%g on %d linear modules (%d by weight, as stock PEFT will load them), %d "
        "routed-experts modules and %d routers by weight; modules trained fully: %s; %d trainable parameters",
        settings.rank,
        settings.alpha,
        len(targets.linear),
        len(by_weight),
        len(targets.experts),
        len(targets.routers),
        list(modules_to_save) or "none",
        trainable,
    )
    if renamed := stock_peft_renames(peft_model):
        warnings.warn(
            f"stock PEFT will not load this adapter as saved on {peft_model.config.model_type}: its "
            "PeftModel.from_pretrained passes adapters through transformers' checkpoint conversion for the model, "
            f"which renames {len(renamed)} of its keys (e.g. {renamed[0][0]} -> {renamed[0][1]}) and then leaves "
            "them out with a warning. moetune.load_model(path, adapter=...), moetune generate / chat and resuming "
            "load it as saved; moetune export writes the copy serving engines load",
            UserWarning,
            stacklevel=2,
        )
    return peft_model


def stock_peft_renames(peft_model: Any) -> list[tuple[str, str]]:
    """``(saved key, the key stock PEFT turns it into)`` for the keys of ``peft_model``'s adapter that PEFT 0.21's
    loading renames: ``set_peft_model_state_dict`` applies transformers 5's checkpoint conversion for the model
    type to every adapter, and some conversions rename keys that are already the model's own (Mistral Large 4,
    DeepSeek-OCR-2, Laguna, Inkling 2). Empty where PEFT loads the adapter as saved."""
    from peft import get_peft_model_state_dict
    from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers

    state = get_peft_model_state_dict(peft_model)
    converted = convert_peft_adapter_state_dict_for_transformers(
        peft_model, peft_model.peft_config["default"], dict(state)
    )
    gone, new = sorted(set(state) - set(converted)), sorted(set(converted) - set(state))
    return list(zip(gone, new, strict=False)) if gone or new else []


def expert_modules(model: nn.Module) -> dict[str, Any]:
    """``{path in the original model: outer ExpertsLora}`` for every routed-experts module carrying LoRA (PEFT
    prefix removed); ``.parameters()`` of each are its LoRA tensors, ``.experts`` the ``CpuExperts``."""
    from moetune.adapters.expert_layer import ExpertsLora

    return {
        path.removeprefix(PEFT_MODEL_PREFIX): m
        for path, m in model.named_modules()
        if isinstance(m, ExpertsLora) and isinstance(m.base_layer, ExpertsLora) and m.lora_A
    }
