"""Save and load moetune LoRA as one stock PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

Every LoRA tensor, routed experts' included, sits in a PEFT LoRA layer (expert LoRA in
``moetune.adapters.expert_layer.ExpertsLora``, in ``ParamWrapper``'s layout), and the live PEFT config is in the
form stock PEFT loads on the unmodified model (``moetune.adapters.apply``), so the adapter is PEFT's own state
dict and config, and::

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)

computes what the moetune model computed. ``save_adapter`` writes what ``PeftModel.save_pretrained`` writes
(the config gets e.g. ``target_parameters: ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``, preceded
by ``"gate_proj.weight"``-style entries for dense and shared-expert MLPs whose names PEFT rewrites, and
``lora_dropout: 0`` when it has any). The two files are replaced together (``swap``: staged in the folder,
committed by one rename, moved in so that no crash pairs an old file with a new one; the next save or load
finishes or removes what a kill left).

LoRA experts (``moetune.adapters.lora_experts``), which stock PEFT cannot know, are saved in the same commit as
``moetune_lora_experts.safetensors`` beside the two files; ``load_adapter`` attaches and fills them when the
folder has that file. Stock PEFT loads the two stock files alone, i.e. the model without its LoRA experts.

``load_adapter(model, dir)`` attaches a saved adapter to a ``moetune.load_model`` model: the config's
``target_parameters`` name the routed experts and the linear weights to wrap, and PEFT's
``set_peft_model_state_dict`` fills every tensor. ``load_adapter_weights(peft_model, dir)`` copies a saved
adapter's values into one that is already attached.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetune.adapters.apply import linear_weight_paths, peft_model_with, weight_routers
from moetune.adapters.check import check_adapter_folder, check_finite, entry_matches
from moetune.adapters.lora_experts import FILE_NAME as LORA_EXPERTS_FILE
from moetune.adapters.lora_experts import (
    attach_lora_experts,
    load_lora_experts_state,
    spec_of,
    write_lora_experts,
)
from moetune.adapters.peft_layout import ExpertParamNames
from moetune.adapters.swap import CONFIG_NAME, save_pair
from moetune.errors import AdapterError
from moetune.layer import CpuExperts
from moetune.tensorfile import write_streamed


def adapter_config(peft_model: Any) -> dict[str, Any]:
    """The ``adapter_config.json`` contents for ``peft_model``: its live (stock-form) PEFT config, as saved."""
    config = peft_model.peft_config["default"].to_dict()
    if isinstance(config["target_modules"], (list, set)):
        config["target_modules"] = sorted(config["target_modules"])
    config["base_model_name_or_path"] = getattr(peft_model.base_model.model, "name_or_path", None)
    config["inference_mode"] = True
    return config


def adapter_state(
    peft_model: Any, state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """Every LoRA tensor under its stock PEFT key (``get_peft_model_state_dict``), on the CPU, contiguous; taken
    from ``state_dict`` (the model's, e.g. FSDP2's gathered one) when given. ``meta`` tensors in it (placeholders
    of tensors produced while the file is written: :func:`write_adapter_weights`) are kept as they are."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(peft_model, state_dict=state_dict)
    return {k: v if v.is_meta else v.detach().cpu().contiguous() for k, v in state.items()}


def write_adapter_weights(
    peft_model: Any,
    path: Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    fetch: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """``adapter_model.safetensors`` of ``peft_model`` at ``path`` (not atomic: callers write a temporary file),
    what ``PeftModel.save_pretrained`` writes (``save_file``'s layout, metadata ``{"format": "pt"}``), streamed
    tensor by tensor (``moetune.tensorfile.write_streamed``): a ``meta`` tensor of ``state_dict`` is produced by
    ``fetch(placeholder)`` when its turn comes and dropped once written (with ``expert_parallel: sharded``, one
    expert-LoRA weight gathered from every rank: ``moetune.train.sharded_lora.GatheredAdapter``)."""
    write_streamed(path, adapter_state(peft_model, state_dict), {"format": "pt"}, fetch)


def save_adapter(
    peft_model: Any,
    output_dir: str | Path,
    state_dict: dict[str, torch.Tensor] | None = None,
    fetch: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Path:
    """Write ``peft_model``'s LoRA to ``output_dir`` as a stock PEFT adapter, atomically; returns the folder.

    Files already in ``output_dir`` other than the adapter's are kept (a Trainer checkpoint folder holds
    optimizer and scheduler state next to it); the adapter's files, its LoRA experts' included, are replaced
    together (``moetune.adapters.swap``). ``state_dict``: the model's whole state dict to take the LoRA from
    (FSDP2 gathers it on the main process: ``moetune.train.fsdp.full_state_dict``), else the live tensors;
    ``fetch``: for its ``meta`` placeholders, as :func:`write_adapter_weights` (with ``expert_parallel: sharded``
    the expert LoRA, gathered weight by weight while the file is written).
    """
    out = Path(output_dir)
    config = json.dumps(adapter_config(peft_model), indent=2, sort_keys=True) + "\n"
    extras = (
        {LORA_EXPERTS_FILE: lambda path: write_lora_experts(peft_model, path)} if spec_of(peft_model) else {}
    )
    save_pair(out, config, lambda path: write_adapter_weights(peft_model, path, state_dict, fetch), extras)
    return out


def read_adapter(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state dict) of a saved adapter, checked (``check.check_adapter_folder``) and its values
    finite; ``AdapterError`` naming the file and field or tensor otherwise."""
    adapter = check_adapter_folder(adapter_dir)
    return adapter.config, read_tensors(adapter.weights_file)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """A checked safetensors file of the adapter, read whole, its values finite."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{path} cannot be read ({e}); re-save the adapter") from None
    check_finite(state, path)
    return state


def restore_lora_experts(peft_model: Any, adapter_dir: str | Path, *, attach: bool) -> None:
    """Fill ``peft_model``'s LoRA experts from the adapter folder (``attach``: add them first, with the saved
    sizes). The folder's LoRA experts and the model's must agree: both absent, or the same sizes and blocks
    (``AdapterError`` naming the file otherwise)."""
    adapter = check_adapter_folder(adapter_dir)
    spec = adapter.lora_experts
    have = None if attach else spec_of(peft_model)
    if spec is None:
        if have is not None:
            raise AdapterError(
                f"adapter {adapter.folder} has no {LORA_EXPERTS_FILE}, but the model has LoRA experts "
                f"(N={have.num_experts}, I'={have.intermediate_size}); resume from a checkpoint of a run with the "
                "same lora_experts, or remove lora_experts"
            )
        return
    if attach:
        attach_lora_experts(peft_model, spec.num_experts, spec.intermediate_size)
    elif have is None or have != spec:
        had = "none" if have is None else f"N={have.num_experts}, I'={have.intermediate_size}"
        raise AdapterError(
            f"{adapter.lora_experts_file} holds LoRA experts N={spec.num_experts}, I'={spec.intermediate_size}; the "
            f"model has {had}. Set lora_experts / lora_expert_intermediate_size as the adapter was trained"
        )
    load_lora_experts_state(peft_model, read_tensors(adapter.lora_experts_file), adapter.lora_experts_file)


def expert_targets(
    model: nn.Module, target_parameters: Sequence[str], where: str
) -> tuple[list[str], set[str]]:
    """(paths of the ``CpuExperts`` whose gate_up and down parameters ``target_parameters`` name, the entries that
    name them). An entry matches ``<module path>.<param>`` exactly or as a dotted suffix, as in PEFT; ``where``
    names the config file in errors."""
    paths: list[str] = []
    used: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, CpuExperts):
            continue
        names = ExpertParamNames.of(module)
        hits = {
            param: [e for e in target_parameters if entry_matches(f"{path}.{param}", e)]
            for param in (names.gate_up, names.down)
        }
        missing = [param for param, entries in hits.items() if not entries]
        if len(missing) == 1:
            raise AdapterError(
                f"{where}: target_parameters {list(target_parameters)} adapt one fused projection of {path} but "
                f"not {missing[0]}; moetune's expert LoRA adapts {names.gate_up} and {names.down} together"
            )
        if not missing:
            paths.append(path)
            used.update(e for entries in hits.values() for e in entries)
    return paths, used


def stock_key(name: str) -> str:
    """The key stock PEFT saves parameter ``name`` of adapter ``default`` under: ``...lora_A.default.weight`` ->
    ``...lora_A.weight``, ``...gate.modules_to_save.default.weight`` -> ``...gate.weight``."""
    return name.replace(".modules_to_save.default", "").replace(".default", "")


def put_adapter_state(peft_model: Any, state: dict[str, torch.Tensor], where: str | Path) -> None:
    """Put a saved adapter's tensors (stock keys, ``base_model.model.<path>.lora_A.weight``) into the LoRA of
    ``peft_model`` (adapter ``default``); ``AdapterError`` naming ``where`` when a LoRA tensor has no place, a place
    no tensor, or a shape does not fit.

    The LoRA tensors go in under the model's own names (the adapter name put back, as PEFT does) by
    ``load_state_dict``, not through ``set_peft_model_state_dict``: PEFT 0.21 passes every adapter through
    transformers 5's checkpoint conversion for the model type, meant for the keys of transformers-4 checkpoints.
    moetune's adapters carry the model's own keys, which some conversions rename again (Mistral Large 4's
    ``mlp.experts`` -> ``mlp.mlp.experts``, DeepSeek-OCR-2's ``language_model`` twice, Laguna, Inkling 2), and
    PEFT then left them out with a warning. Modules' load hooks still run (a sharded ``ExpertsLora`` cuts a whole
    adapter to its rows); a tensor already sharded like its place (FSDP2's ``shard_like``) loads as it is. Whole
    weights (``modules_to_save``, an embedding's base weight) go through PEFT, which does not convert them."""
    from peft import set_peft_model_state_dict

    live = {  # stock key -> the parameter's name: PEFT's LoRA of adapter "default" (not LoRA experts)
        stock_key(name): name
        for name, _ in peft_model.named_parameters()
        if ".lora_" in name and ".default" in name
    }
    lora = {k: t for k, t in state.items() if ".lora_" in k}
    unexpected, missing = sorted(set(lora) - set(live)), sorted(set(live) - set(lora))
    if unexpected or missing:
        raise AdapterError(
            f"adapter {where} does not fit {type(peft_model.get_base_model()).__name__}: unexpected LoRA tensors "
            f"{unexpected[:10]}, missing {missing[:10]}; was it saved for this model and lora_target?"
        )
    try:
        result = peft_model.load_state_dict({live[k]: t for k, t in lora.items()}, strict=False)
        if result.unexpected_keys:  # the hooks left a key no parameter takes
            raise RuntimeError(f"unexpected keys {result.unexpected_keys[:10]}")
    except RuntimeError as exc:  # load_state_dict's size mismatches: another rank or number of experts
        raise AdapterError(
            f"adapter {where} does not fit {type(peft_model.get_base_model()).__name__}: {exc}"
        ) from exc
    whole = {k: t for k, t in state.items() if ".lora_" not in k}
    if whole:
        loaded: Any = set_peft_model_state_dict(peft_model, whole)
        if loaded.unexpected_keys:
            raise AdapterError(
                f"adapter {where}: whole weights with no place in the model {loaded.unexpected_keys[:10]}"
            )


def load_adapter(model: nn.Module, adapter_dir: str | Path, *, is_trainable: bool = False) -> Any:
    """Attach the adapter saved in ``adapter_dir`` to a ``moetune.load_model`` model; returns the ``PeftModel``.

    Expert LoRA goes into ``ExpertsLora`` layers (fp32, on the host), linear LoRA into PEFT's. Every tensor of the
    file must find its place and every target its tensors (``AdapterError`` otherwise). ``is_trainable`` keeps
    the LoRA trainable.
    """
    from peft import LoraConfig

    config, state = read_adapter(adapter_dir)
    r, alpha, rslora = config["r"], float(config["lora_alpha"]), config.get("use_rslora", False)
    target_parameters = list(config.get("target_parameters") or [])
    where = str(Path(adapter_dir) / CONFIG_NAME)
    experts, expert_entries = expert_targets(model, target_parameters, where)
    dense = linear_weight_paths(model, target_parameters)  # Linear weights targeted as parameters
    cpu_experts = [p for p, m in model.named_modules() if isinstance(m, CpuExperts)]
    router_weights = [f"{p}.weight" for p in weight_routers(model, cpu_experts)]
    routers = [  # routers that are not nn.Linear: PEFT's own target_parameters LoRA (ParamWrapper), as attach_lora
        e for e in target_parameters if any(entry_matches(w, e) for w in router_weights)
    ]
    unknown = [
        e for e in target_parameters if e not in dense and e not in expert_entries and e not in routers
    ]
    if unknown:
        raise AdapterError(
            f"{where}: target_parameters {unknown} name no nn.Linear weight, no routed-experts parameter and no "
            f"router weight of {type(model).__name__}; was the adapter saved for this model?"
        )
    target_modules = config.get("target_modules")
    if isinstance(target_modules, str) and experts:
        raise AdapterError(
            f"{where}: target_modules is the pattern {target_modules!r}; moetune loads adapters whose "
            "target_modules is a list when they also adapt routed experts"
        )
    if isinstance(
        target_modules, list
    ):  # experts named as modules (an adapter added by add_adapter, as saved)
        named = [p for p in cpu_experts if p not in experts]
        experts += [p for p in named if any(entry_matches(p, e) for e in target_modules)]
    peft_config = LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]  # PEFT annotates int; alpha / r is float math
        lora_dropout=0.0,
        target_modules=target_modules,
        target_parameters=routers or None,
        use_rslora=rslora,
        modules_to_save=list(config.get("modules_to_save") or []) or None,  # whole modules, as saved
        bias="none",
        task_type="CAUSAL_LM",
    )
    by_weight = [p for paths in dense.values() for p in paths]
    peft_model = peft_model_with(model, peft_config, by_weight, experts, list(dense))
    put_adapter_state(peft_model, state, adapter_dir)
    restore_lora_experts(peft_model, adapter_dir, attach=True)
    if not is_trainable:  # LoRA, LoRA experts and modules_to_save's copies alike
        peft_model.requires_grad_(False)
        peft_model.eval()
    return peft_model


def load_adapter_weights(peft_model: Any, adapter_dir: str | Path) -> None:
    """Copy the values of a saved adapter into the same LoRA already attached to ``peft_model`` (resume)."""

    expected = adapter_state(peft_model)
    _, state = read_adapter(adapter_dir)
    if set(state) != set(expected):
        raise AdapterError(
            f"checkpoint adapter {adapter_dir} does not match the model's LoRA: missing "
            f"{sorted(set(expected) - set(state))[:10]}, unexpected {sorted(set(state) - set(expected))[:10]}"
        )
    put_adapter_state(peft_model, state, adapter_dir)
    restore_lora_experts(peft_model, adapter_dir, attach=False)
