"""Full/freeze checkpoints written layer by layer: model weights and optimizer state as safetensors, index last.

A full-mode checkpoint holds every routed expert's weights and two AdamW moments per parameter (for a large MoE,
hundreds of GB; the experts' moments in the format the expert optimizer holds them, fp32, bf16 or 8-bit codes
with their scales, ``moetune.train.expert_optim``, each tensor in its own dtype). They are written one decoder layer at a time, each file atomically (``moetune.atomic``), then an
index naming every file; a reader trusts only files an index names, so a crash mid-save never yields a checkpoint
that looks complete (the Trainer checkpoint folder itself is also staged and renamed whole: ``trainer.py``).

    <checkpoint>/model-<part>.safetensors       the model's state dict (live layout) of one decoder layer, or
                                                 of everything outside the layers (``other``)
    <checkpoint>/model.safetensors.index.json   transformers' shard index: the Trainer's resume reads it
                                                 (``load_sharded_checkpoint``)
    <checkpoint>/optimizer-<part>.safetensors   each trained parameter's optimizer state tensors, keyed
                                                 ``<parameter name>/<state key>``
    <checkpoint>/optimizer.index.json           param groups (hyperparameters, parameters by name), which file
                                                 holds each parameter's state, and non-tensor state values

The optimizer state is keyed by parameter *name*, not by torch's positional index, so resume checks that the
checkpoint's parameters are exactly the run's (``LoadError`` otherwise) instead of loading moments into the
wrong tensors.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetune.atomic import write_atomically, write_text_atomically
from moetune.errors import LoadError
from moetune.train.fsdp import shard_like

MODEL_INDEX = "model.safetensors.index.json"  # transformers' SAFE_WEIGHTS_INDEX_NAME
OPTIMIZER_INDEX = "optimizer.index.json"
_LAYER = re.compile(r"^(.*?\.layers\.\d+)\.")


def part_of(name: str) -> str:
    """The file part of a parameter or state-dict key: its decoder layer (``model.layers.3``) or ``other``."""
    m = _LAYER.match(name)
    return m.group(1) if m else "other"


def _by_part(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in items:
        out.setdefault(part_of(key), {})[key] = t
    return out


def _write_parts(folder: Path, stem: str, parts: dict[str, dict[str, torch.Tensor]]) -> dict[str, str]:
    """Write each part to ``<stem>-<part>.safetensors`` atomically; returns ``{key: file name}``."""
    from safetensors.torch import save_file

    where: dict[str, str] = {}
    for part, tensors in parts.items():
        name = f"{stem}-{part}.safetensors"
        plain = {k: t.detach().contiguous() for k, t in tensors.items()}

        def write(tmp: Path, plain: dict[str, torch.Tensor] = plain) -> None:
            save_file(plain, str(tmp), metadata={"format": "pt"})

        write_atomically(folder / name, write)
        where.update(dict.fromkeys(tensors, name))
    return where


def save_model_by_layer(model: Any, folder: str | Path, state_dict: dict[str, Any] | None = None) -> None:
    """The model's state dict (the live modules' layout) and its config, one file per decoder layer, index last.
    ``state_dict``: the model's, already gathered whole (FSDP2: ``moetune.train.fsdp.gathered_state_dict``)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    whole = model.state_dict() if state_dict is None else state_dict
    state = remove_tied_weights_from_state_dict(whole, model)
    where = _write_parts(out, "model", _by_part(state.items()))
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}
    write_text_atomically(out / MODEL_INDEX, json.dumps(index, indent=2) + "\n")


def _names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """The name of every optimizer parameter, in torch's state-dict index order (groups, then positions)."""
    by_id = {id(p): n for n, p in model.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in by_id:
                raise LoadError(
                    "the optimizer holds a tensor that is no parameter of the model; cannot name its state"
                )
            names.append(by_id[id(p)])
    return names


def save_optimizer_by_layer(
    optimizer: torch.optim.Optimizer,
    model: nn.Module,
    folder: str | Path,
    state_dict: dict[str, Any] | None = None,
) -> None:
    """``optimizer``'s state, one file per decoder layer, keyed by parameter name; the index last. ``state_dict``:
    the optimizer's, already gathered whole (FSDP2: ``moetune.train.fsdp.gathered_optimizer_state``)."""
    out = Path(folder)
    names = _names(optimizer, model)
    sd = optimizer.state_dict() if state_dict is None else state_dict
    tensors: list[tuple[str, torch.Tensor]] = []
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                if type(value) is not torch.Tensor:
                    raise LoadError(
                        f"optimizer state {names[idx]}/{key} is a {type(value).__name__}, which safetensors cannot "
                        "store; use an optim moetune's full mode supports (README, training modes: adamw_torch, "
                        "adamw_anyprecision, adamw_8bit)"
                    )
                tensors.append((f"{names[idx]}/{key}", value))
            else:
                scalars.setdefault(names[idx], {})[key] = value
    where = _write_parts(out, "optimizer", _by_part(tensors))
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    index = {"param_groups": groups, "files": dict(sorted(where.items())), "scalars": scalars}
    write_text_atomically(out / OPTIMIZER_INDEX, json.dumps(index, indent=2, default=str) + "\n")


def load_optimizer_by_layer(optimizer: torch.optim.Optimizer, model: nn.Module, folder: str | Path) -> None:
    """Restore what :func:`save_optimizer_by_layer` wrote into ``optimizer`` (built over the same parameters)."""
    from safetensors.torch import load_file

    src = Path(folder)
    index = json.loads((src / OPTIMIZER_INDEX).read_text())
    names = _names(optimizer, model)
    saved = [n for g in index["param_groups"] for n in g["params"]]
    if saved != names:
        missing, extra = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
        raise LoadError(
            f"{src / OPTIMIZER_INDEX}: the checkpoint's optimizer trains other parameters than this run "
            f"(missing {missing[:4]}, extra {extra[:4]}, or another order); resume with the same "
            "finetuning_type and freeze settings"
        )
    position = {n: i for i, n in enumerate(names)}
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict[str, Any]] = {}
    for file in sorted(set(index["files"].values())):
        for key, t in load_file(str(src / file)).items():
            name, _, what = key.rpartition("/")
            # FSDP2: this rank's shard of a sharded parameter's moments (the file holds them whole)
            state.setdefault(position[name], {})[what] = shard_like(t, params[position[name]])
    for name, values in index["scalars"].items():
        state.setdefault(position[name], {}).update(values)
    groups, start = [], 0
    for g in index["param_groups"]:
        groups.append({**g, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def load_model_by_layer(model: nn.Module, folder: str | Path) -> Any:
    """What :func:`save_model_by_layer` wrote, loaded into ``model`` whose dense part FSDP2 shards: each file's
    tensors cut to this rank's shards (``shard_like``) and loaded (not strict); returns the missing and unexpected
    keys as ``load_state_dict`` does (the Trainer's resume reads them). Without FSDP the Trainer's own
    ``load_sharded_checkpoint`` reads the same files."""
    from safetensors.torch import load_file
    from torch.nn.modules.module import _IncompatibleKeys

    src = Path(folder)
    files = sorted(set(json.loads((src / MODEL_INDEX).read_text())["weight_map"].values()))
    live = model.state_dict()
    missing, unexpected = set(live), []
    for file in files:
        part = load_file(str(src / file))
        unexpected += [k for k in part if k not in live]
        model.load_state_dict({k: shard_like(t, live[k]) for k, t in part.items() if k in live}, strict=False)
        missing -= set(part)
    return _IncompatibleKeys(sorted(missing), unexpected)
