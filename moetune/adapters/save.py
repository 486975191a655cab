"""Save and load moetune LoRA as one stock PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``).

Attention / dense-MLP LoRA is PEFT's own (keys from ``get_peft_model_state_dict``); routed-expert LoRA is
written in PEFT's ``target_parameters`` (``ParamWrapper``) layout by ``peft_layout``, so that::

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)

computes what the moetune model computed. The config gets ``target_parameters`` (e.g.
``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``, preceded by ``"gate_proj.weight"``-style entries
for dense and shared-expert MLPs whose names PEFT rewrites, see ``moetune.adapters.apply``) and
``lora_dropout: 0`` when it has any (PEFT's ``ParamWrapper`` refuses dropout; dropout changes no saved
weight). gpt-oss-style experts (gate/up interleaved) get their gate_up ``lora_B`` rows interleaved, as the
module they replaced orders its outputs (``CpuExperts.layout``). Files are written to a temporary folder
next to ``output_dir`` and renamed into place, so a crash leaves no half-written adapter.

``load_adapter(model, dir)`` attaches a saved adapter to a ``moetune.load_model`` model;
``load_adapter_weights(peft_model, dir)`` copies a saved adapter's values into one that is already attached
(checkpoint resume).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetune.adapters.apply import expert_modules, linear_weight_paths, peft_model_with, set_expert_lora
from moetune.adapters.peft_layout import (
    PEFT_MODEL_PREFIX,
    ExpertParamNames,
    expert_lora_from_peft_state,
    expert_lora_to_peft_state,
)
from moetune.atomic import replace_folder, write_atomically, write_text_atomically
from moetune.engine import LORA_NAMES, ExpertLoRA, lora_scaling
from moetune.errors import AdapterError
from moetune.layer import CpuExperts

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"


def _suffix_targets(paths: list[str], params: tuple[str, str]) -> list[str]:
    """``target_parameters`` for experts at ``paths``: ``<path without the layers.N. prefix>.<param>`` when that
    suffix is shared by every experts path (``mlp.experts.gate_up_proj``), else each full path."""
    tails = {_after_layer_index(p) for p in paths}
    if len(tails) == 1:
        (tail,) = tails
        return [f"{tail}.{name}" for name in params]
    return [f"{p}.{name}" for name in params for p in paths]


def _after_layer_index(path: str) -> str:
    """``model.layers.3.mlp.experts`` -> ``mlp.experts`` (the part after the last numeric component)."""
    parts = path.split(".")
    idx = max((i for i, part in enumerate(parts) if part.isdigit()), default=-1)
    return ".".join(parts[idx + 1 :])


def adapter_config(peft_model: Any) -> dict[str, Any]:
    """The ``adapter_config.json`` contents for ``peft_model`` (its PEFT config plus the expert targets)."""
    config = peft_model.peft_config["default"].to_dict()
    experts = list(expert_modules(peft_model))
    config["target_modules"] = sorted(config["target_modules"] or [])
    config["base_model_name_or_path"] = getattr(peft_model.base_model.model, "name_or_path", None)
    config["inference_mode"] = True
    # Linear weights PEFT cannot target by name (moetune.adapters.apply.peft_renamed), then the routed experts
    params = sorted(config.get("target_parameters") or [])
    if experts:
        names = ExpertParamNames()
        params += _suffix_targets(experts, (names.gate_up, names.down))
    config["target_parameters"] = params or None
    if params:  # ParamWrapper requires no dropout; training dropout does not change the saved weights
        config["lora_dropout"] = 0.0
    return config


def adapter_state(peft_model: Any) -> dict[str, torch.Tensor]:
    """Every LoRA tensor under its stock PEFT key: linear LoRA as PEFT saves it, expert LoRA in ParamWrapper layout."""
    from peft import get_peft_model_state_dict

    state = {
        k: v.detach().cpu().contiguous()
        for k, v in get_peft_model_state_dict(peft_model).items()
        if not any(k.endswith(f".lora_{n}") for n in LORA_NAMES)
    }
    for path, module in expert_modules(peft_model).items():
        names = ExpertParamNames.of(module)
        for k, v in expert_lora_to_peft_state(module, PEFT_MODEL_PREFIX + path, names).items():
            state[k] = v.cpu().contiguous()
    return state


def save_adapter(peft_model: Any, output_dir: str | Path) -> Path:
    """Write ``peft_model``'s LoRA to ``output_dir`` as a stock PEFT adapter, atomically; returns the folder.

    Files already in ``output_dir`` other than the adapter's two are kept (a Trainer checkpoint folder holds
    optimizer and scheduler state next to it).
    """
    from safetensors.torch import save_file

    out = Path(output_dir)
    state = adapter_state(peft_model)
    config = json.dumps(adapter_config(peft_model), indent=2, sort_keys=True) + "\n"

    def write_weights(path: Path) -> None:
        save_file(state, str(path), metadata={"format": "pt"})

    if out.is_dir():  # each file replaced atomically; the pair is written last
        write_atomically(out / WEIGHTS_NAME, write_weights)
        write_text_atomically(out / CONFIG_NAME, config)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:  # a new folder appears whole
        write_weights(staged / WEIGHTS_NAME)
        (staged / CONFIG_NAME).write_text(config)
        replace_folder(staged, out, aside=staged.with_name(staged.name + "-old"))
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return out


def read_adapter(adapter_dir: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config dict, state dict) of a saved adapter; ``AdapterError`` naming a missing or unreadable file."""
    from safetensors.torch import load_file

    folder = Path(adapter_dir)
    missing = [f for f in (CONFIG_NAME, WEIGHTS_NAME) if not (folder / f).is_file()]
    if missing:
        raise AdapterError(
            f"adapter folder {folder} lacks {missing}; expected a PEFT adapter saved by moetune or PEFT"
        )
    config = json.loads((folder / CONFIG_NAME).read_text())
    if config.get("peft_type") != "LORA":
        raise AdapterError(
            f"{folder / CONFIG_NAME}: peft_type {config.get('peft_type')!r}; moetune loads LORA adapters"
        )
    return config, load_file(str(folder / WEIGHTS_NAME))


def _expert_paths(model: nn.Module) -> list[str]:
    from moetune.layer import CpuExperts

    return [
        p.removeprefix("base_model.model.") for p, m in model.named_modules() if isinstance(m, CpuExperts)
    ]


def _expert_lora(module: CpuExperts) -> ExpertLoRA:
    lora = module.engine.lora
    if lora is None:
        raise AdapterError("a routed-experts module has no expert LoRA attached to load the adapter into")
    return lora


def load_adapter(model: nn.Module, adapter_dir: str | Path, *, is_trainable: bool = False) -> Any:
    """Attach the adapter saved in ``adapter_dir`` to a ``moetune.load_model`` model; returns the ``PeftModel``.

    Expert LoRA goes into the engines (fp32), linear LoRA through PEFT. Every tensor of the file must find its
    place and every target its tensors (``AdapterError`` otherwise). ``is_trainable`` keeps the LoRA trainable.
    """
    from peft import LoraConfig, set_peft_model_state_dict

    config, state = read_adapter(adapter_dir)
    r, alpha, rslora = int(config["r"]), float(config["lora_alpha"]), bool(config.get("use_rslora", False))
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise AdapterError(f"{adapter_dir}: rank_pattern / alpha_pattern are not supported by moetune yet")
    scaling = lora_scaling(r, alpha, rslora)
    used: set[str] = set()
    target_parameters = list(config.get("target_parameters") or [])
    if target_parameters:
        for path in _expert_paths(model):
            prefix = PEFT_MODEL_PREFIX + path
            if not any(k.startswith(prefix + ".") for k in state):
                continue
            experts = model.get_submodule(path)
            assert isinstance(experts, CpuExperts)
            lora = expert_lora_from_peft_state(
                state,
                prefix,
                num_experts=experts.engine.num_experts,
                scaling=scaling,
                names=ExpertParamNames.of(experts),
            )
            lora = lora.astype(torch.float32)
            set_expert_lora(model, path, lora)
            used |= {k for k in state if k.startswith(prefix + ".")}
    dense = linear_weight_paths(model, target_parameters)  # Linear weights targeted as parameters
    linear_state = {k: v for k, v in state.items() if k not in used}
    peft_config = LoraConfig(
        r=r,
        lora_alpha=alpha,  # type: ignore[arg-type]  # PEFT annotates int; alpha / r is float math
        lora_dropout=0.0,
        target_modules=config.get("target_modules"),
        use_rslora=rslora,
        bias="none",
        task_type="CAUSAL_LM",
    )
    by_weight = [p for paths in dense.values() for p in paths]
    peft_model = peft_model_with(model, peft_config, by_weight, list(dense))
    result: Any = set_peft_model_state_dict(peft_model, linear_state)
    lora_missing = [
        k
        for k in result.missing_keys
        if ".lora_" in k and not any(k.endswith(f".lora_{n}") for n in LORA_NAMES)
    ]
    if result.unexpected_keys or lora_missing:
        raise AdapterError(
            f"adapter {adapter_dir} does not fit {type(model).__name__}: unexpected keys "
            f"{result.unexpected_keys[:10]}, missing LoRA keys {lora_missing[:10]}"
        )
    for experts in expert_modules(peft_model).values():
        for p in experts.parameters():
            p.requires_grad_(is_trainable)
    if not is_trainable:
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.requires_grad_(False)
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
    from peft import set_peft_model_state_dict

    experts = expert_modules(peft_model)
    linear = {
        k: v for k, v in state.items() if not any(k.startswith(PEFT_MODEL_PREFIX + p + ".") for p in experts)
    }
    set_peft_model_state_dict(peft_model, linear)
    with torch.no_grad():
        for path, module in experts.items():
            lora = expert_lora_from_peft_state(
                state,
                PEFT_MODEL_PREFIX + path,
                num_experts=module.engine.num_experts,
                scaling=_expert_lora(module).scaling,
                names=ExpertParamNames.of(module),
            )
            for name in LORA_NAMES:
                getattr(module, f"lora_{name}").copy_(getattr(lora, name))
