"""A trained adapter in the layout serving engines load: each LoRA pair named after the checkpoint weight it adapts.

moetune saves routed-expert LoRA as stock PEFT does on transformers 5's fused experts (``target_parameters``:
one ``lora_A`` ``[E * r, in]`` / ``lora_B`` ``[out, r * E]`` pair per fused parameter, ``peft_layout``). Serving
engines read fewer forms (checked in their sources, vLLM 0.34.0 and SGLang 0.5.23):

- vLLM applies such a fused pair only on models it marks as 3-D MoE LoRA (gpt-oss, Qwen3.5-MoE's and
  Qwen3-VL-MoE's multimodal classes); on Qwen3-MoE, DeepSeek-V2/V3, Kimi-K2, GLM-4.5, ERNIE-4.5-MoE and OLMoE it
  refuses the adapter unless started with a mixed-format flag, and on Mixtral (checkpoint path
  ``block_sparse_moe``) the expert pairs match no module and are skipped. It reads per-expert pairs named as the
  checkpoint names its per-expert weights (``...experts.{e}.gate_proj``, Mixtral's
  ``...block_sparse_moe.experts.{e}.w1``) on every other MoE model.
- SGLang reads per-expert pairs on its fused-MoE models when ``target_modules`` names the projections, scales by
  ``lora_alpha / r`` alone (no rsLoRA), and reads no ``target_parameters``.

So the serving layout writes, for a checkpoint that stores its experts one matrix per expert, per-expert pairs
under the checkpoint's own tensor names: expert ``e``'s gate, up and down LoRA (``A_e = lora_A[e r:(e + 1) r]``,
``B_e[o, j] = lora_B[o, j E + e]``, gate_up's B split into its gate rows and its up rows), and every other pair
under the checkpoint name of the weight it adapts. The classes vLLM reads fused pairs on (``FUSED_LORA_CLASSES``,
by ``config.json``'s ``architectures``) and checkpoints that store fused experts keep PEFT's fused pairs as
trained; vLLM needs both projections there (gate_up under ``experts.base_layer``, down under ``experts``). rsLoRA
is folded into B (``sqrt(r)``, so that ``lora_alpha / r`` scales it right everywhere). What no engine applies is
refused, by name: router LoRA, whole weights saved beside the LoRA (``modules_to_save``, a resized embedding),
moetune's LoRA experts, NaN/Inf values.

The result is for serving only: stock PEFT on transformers 5 loads the adapter as trained (the source folder).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moetune.adapters.apply import expert_target_parameters, weight_routers
from moetune.adapters.check import (
    PREFIX,
    AdapterFolder,
    check_adapter_folder,
    entry_matches,
    expert_lora_prefixes,
    lora_pairs,
)
from moetune.adapters.peft_layout import ExpertParamNames, deinterleave_rows, lora_from_peft, unwrapped_path
from moetune.adapters.swap import CONFIG_NAME, WEIGHTS_NAME
from moetune.errors import AdapterError, OutputDirError, listing
from moetune.loading.quant import ROLES

if TYPE_CHECKING:
    from moetune.loading.expert_plan import LayerPlan
    from moetune.loading.load import PlannedLoad

# model classes (config.json's architectures) whose routed experts vLLM 0.34 adapts with PEFT's fused 3-D pairs
# (``is_3d_moe_weight``); on its other MoE classes it reads one pair per expert and projection
FUSED_LORA_CLASSES = frozenset(
    {"GptOssForCausalLM", "Qwen3_5MoeForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"}
)
# files beside the adapter that travel with it (the tokenizer carries the chat template the run trained with)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
EXPORT_MARK = {"moetune_export": "serving"}  # in the weights file's metadata: what --overwrite may replace


@dataclass(frozen=True)
class ServingAdapter:
    """The serving layout of one adapter: ``tensors`` (PEFT-prefixed keys: ``base_model.model.<checkpoint
    module>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]``, fused experts as trained), its
    ``config`` (adapter_config.json), and how many experts modules were written per expert and kept fused."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    per_expert: int
    fused: int
    # for a merge (``merging=True``): the experts modules whose pairs stay fused (model paths), whole weights
    # saved beside the LoRA by the checkpoint key they replace, and each per-weight pair's module name -> the
    # checkpoint key of the weight it adapts
    fused_paths: tuple[str, ...] = ()
    whole: dict[str, torch.Tensor] = field(default_factory=dict)
    weights: dict[str, str] = field(default_factory=dict)


def _refusals(
    adapter: AdapterFolder,
    whole: Mapping[str, Any],
    pairs: Mapping[str, Any],
    routers: list[str],
    merging: bool,
) -> list[str]:
    """What serving engines would not apply (``merging``: what a merged checkpoint cannot hold), each with what to
    do instead."""
    problems = []
    if adapter.lora_experts is not None:
        problems.append(
            f"{adapter.lora_experts_file.name}: LoRA experts (added experts) are moetune's own; "
            + (
                "the model's checkpoint format has no place for them. Use the adapter unmerged with moetune "
                "generate / chat, or train without lora_experts"
                if merging
                else "no serving engine computes them. Serve with moetune generate / chat, or train without "
                "lora_experts"
            )
        )
    if merging:
        return problems
    if whole:
        problems.append(
            f"{WEIGHTS_NAME} holds whole weights beside the LoRA ({listing(sorted(whole), inline=True)}: "
            "modules_to_save or a resized embedding); vLLM refuses such adapters and SGLang drops them. Train "
            "without modules_to_save / additional_target to serve the adapter"
        )
    on_router = sorted(m for m in pairs if m in routers)
    if on_router:
        problems.append(
            f"LoRA on the router ({listing(on_router, inline=True)}): SGLang applies no LoRA to routers and vLLM's "
            "is untested; leave the router out of lora_target to serve the adapter"
        )
    return problems


def checkpoint_names(planned: PlannedLoad) -> dict[str, str]:
    """``{model parameter: checkpoint key}`` for the non-expert keys transformers only renames."""
    out: dict[str, str] = {}
    for key in planned.plan.other_keys:
        target = planned.targets[key]
        if not target.converted:
            out.setdefault(target.target, key)
    return out


class _Writer:
    """The serving tensors, rsLoRA folded into each B, and the module names ``target_modules`` lists."""

    def __init__(self, fold: float, copy: bool) -> None:
        self.fold = fold  # B's factor: sqrt(r) under rsLoRA (alpha / sqrt(r) = sqrt(r) * alpha / r), else 1
        self.copy = copy  # own copies (a file to write holds no shared storage), else views of the adapter's
        self.tensors: dict[str, torch.Tensor] = {}
        self.leaves: set[str] = set()
        self.weights: dict[str, str] = {}  # pair's module name -> the checkpoint weight it adapts

    def b(self, b: torch.Tensor) -> torch.Tensor:
        """B with the fold; in fp32 when the fold is not a power of two (it would round a bf16 B again)."""
        if self.fold == 1.0:
            return b
        exact = math.frexp(self.fold)[0] == 0.5
        return (b.double() * self.fold).to(b.dtype if exact else torch.promote_types(b.dtype, torch.float32))

    def pair(self, key: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """One LoRA pair for checkpoint weight ``key``, under its module's name: a ``[r, in]``, b ``[out, r]``."""
        module = key.removesuffix(".weight")
        a, b = a.contiguous(), self.b(b).contiguous()
        self.tensors[f"{PREFIX}{module}.lora_A.weight"] = a.clone() if self.copy else a  # gate and up share A
        self.tensors[f"{PREFIX}{module}.lora_B.weight"] = b.clone() if self.copy else b
        self.leaves.add(module.rpartition(".")[2])
        self.weights[module] = key


def _write_experts(
    writer: _Writer,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    layer: LayerPlan,
    module: Any,
    fused_class: bool,
    r: int,
    merging: bool,
) -> set[str] | None:
    """One experts module's LoRA into ``writer``: per expert and projection where the checkpoint stores one matrix
    per expert and the engine's class reads that (returns None), else PEFT's fused pairs as trained (returns the
    target_parameters entries they need)."""
    path, sources, layout = layer.site.path, layer.sources, layer.site.layout
    # non-gated experts (NemotronH) have up_proj [E, I, H] where the others have gate_up_proj
    names = ExpertParamNames.from_module(
        module, gate_up="gate_up_proj" if layout.gated else "up_proj", transposed=layout.transposed
    )
    order = [names.gate_up, names.down] if names.gate_up_first else [names.down, names.gate_up]
    prefixes = expert_lora_prefixes(path, order, config)
    per_expert = all(s.expert is not None and s.role in ROLES for s in sources)
    if per_expert and not fused_class:
        lora = {}  # "gate_up" | "down" -> (a [E, r, in], b [E, out, r]), gate_up's rows gate first
        for param, prefix in prefixes.items():
            proj = "gate_up" if param == names.gate_up else "down"
            lora_a = tensors[f"{PREFIX}{prefix}.lora_A.weight"]
            # the module's expert count (LongCat-Flash's holds its zero-computation experts' rows too)
            a, b = lora_from_peft(
                lora_a,
                tensors[f"{PREFIX}{prefix}.lora_B.weight"],
                lora_a.shape[0] // r,
                label=PREFIX + prefix,
                swapped=names.swapped,
            )
            lora[proj] = (a, deinterleave_rows(b) if proj == "gate_up" and names.interleaved else b)
        i = layout.intermediate_size
        for s in sources:
            proj = "down" if s.role == "down" else "gate_up"
            if proj in lora:
                a, b = lora[proj][0][s.expert], lora[proj][1][s.expert]
                rows = b if s.role == "down" or not layout.gated else b[:i] if s.role == "gate" else b[i:]
                writer.pair(s.info.key, a, rows)
        return None
    if not per_expert and not all(s.expert is None and s.role not in ROLES for s in sources):
        raise AdapterError(
            f"{path}: the checkpoint stores these experts per projection for all experts at once (neither one "
            "matrix per expert nor fused); moetune has no serving layout for them"
        )
    if len(prefixes) != 2 and not merging:
        raise AdapterError(
            f"{path}: the adapter has LoRA on {', '.join(prefixes)} only; vLLM reads fused expert LoRA with both "
            f"{names.gate_up} and {names.down} (it asserts both are there). Target both to serve it"
        )
    for prefix in prefixes.values():  # as trained: vLLM reads PEFT's fused pairs here
        for x in "AB":
            key = f"{PREFIX}{prefix}.lora_{x}.weight"
            writer.tensors[key] = (writer.b(tensors[key]) if x == "B" else tensors[key]).contiguous()
    entries = config.get("target_parameters") or []
    named = {e for p in order for e in entries if entry_matches(f"{path}.{p}", e)}
    # experts named in target_modules instead: the entries attach_lora writes for them
    return named or set(expert_target_parameters([path], names))


def serving_adapter(model_path: str | Path, adapter_path: str | Path) -> ServingAdapter:
    """The serving layout (module docstring) of the adapter in ``adapter_path`` for the checkpoint in
    ``model_path``. Reads the checkpoint's headers and the adapter, no model weight; ``AdapterError`` names what
    has no serving layout."""
    from moetune.loading.load import plan_load
    from moetune.loading.options import LoadOptions

    # the folder alone first: no checkpoint header read for it
    folder = check_adapter_folder(adapter_path).folder
    planned = plan_load(model_path, LoadOptions.create(device="cpu", dtype="float32", progress=False))
    return checkpoint_pairs(planned, folder, merging=False)


def checkpoint_pairs(planned: PlannedLoad, folder: Path, *, merging: bool) -> ServingAdapter:
    """The adapter in ``folder`` with each pair under the checkpoint name of the weight it adapts (module
    docstring), for the checkpoint ``planned`` (headers only). ``merging``: for merging into the checkpoint
    (``moetune.export.merge``): expert pairs per expert wherever the checkpoint stores experts per expert, router
    LoRA kept and whole weights mapped to the checkpoint keys they replace; only LoRA experts are refused."""
    from moetune.adapters.save import read_tensors

    adapter = check_adapter_folder(folder, planned.model.config, meta_model=planned.model)
    pairs, whole = lora_pairs(adapter)
    sites = {s.path: s for s in planned.sites}
    problems = _refusals(adapter, whole, pairs, weight_routers(planned.model, list(sites)), merging)
    if problems:
        raise AdapterError(
            f"adapter {folder} has no {'merged' if merging else 'serving'} layout:{listing(problems)}"
        )
    tensors = read_tensors(adapter.weights_file)

    writer = _Writer(math.sqrt(adapter.r) if adapter.config.get("use_rslora") else 1.0, copy=not merging)
    names = checkpoint_names(planned)
    expert_paths, unnamed = set(), []
    for module in sorted(pairs):
        if (path := unwrapped_path(module)) in sites:
            expert_paths.add(path)
        elif (key := names.get(f"{module}.weight")) is not None:
            a, b = (tensors[f"{PREFIX}{module}.lora_{x}.weight"] for x in "AB")
            writer.pair(key, a, b)
        else:
            unnamed.append(f"{module}.weight")
    replaced = {}
    for key in sorted(whole):  # a module's whole weight (modules_to_save), or an embedding's base weight
        if (stored := names.get(key.replace(".base_layer.", "."))) is not None:
            replaced[stored] = tensors[PREFIX + key]
        else:
            unnamed.append(key)
    if unnamed:
        raise AdapterError(
            f"adapter {folder}: {planned.checkpoint.path} stores no tensor that loads as "
            f"{listing(unnamed, inline=True)} by a plain rename (tied to another weight, or made by a conversion "
            "at load), so no weight of that name takes what the adapter holds for it"
        )

    architectures = planned.checkpoint.config.get("architectures") or []
    fused_class = not merging and any(a in FUSED_LORA_CLASSES for a in architectures)
    layers = {layer.site.path: layer for layer in planned.plan.layers}
    fused_entries: set[str] = set()
    per_expert, fused_paths = 0, []
    for path in sorted(expert_paths):
        experts = planned.model.get_submodule(path)
        kept = _write_experts(
            writer, tensors, adapter.config, layers[path], experts, fused_class, adapter.r, merging
        )
        if kept is None:
            per_expert += 1
        else:
            fused_paths.append(path)
            fused_entries |= kept

    config = dict(adapter.config)
    config.update(
        target_modules=sorted(writer.leaves),
        target_parameters=sorted(fused_entries) or None,
        use_rslora=False,
        lora_dropout=0.0,
        modules_to_save=None,
    )
    return ServingAdapter(
        writer.tensors,
        config,
        per_expert,
        len(fused_paths),
        tuple(fused_paths),
        replaced if merging else {},
        writer.weights,
    )


def _is_export(folder: Path, mark: Mapping[str, str]) -> bool:
    """Whether ``folder`` holds what an export with ``mark`` writes (a safetensors file in it carries the mark)."""
    from safetensors import safe_open

    for path in folder.glob("*.safetensors"):
        try:
            with safe_open(str(path), "pt") as f:
                if (f.metadata() or {}).get("moetune_export") == mark["moetune_export"]:
                    return True
        except Exception:  # noqa: BLE001 - not a safetensors file: not an export either way
            continue
    return False


def _check_out(out: Path, source: Path, model: Path, overwrite: bool, mark: Mapping[str, str]) -> None:
    """``OutputDirError`` unless ``out`` may take an export: new, empty, or (``overwrite``) an earlier export."""
    for name, other in (("adapter", source), ("model", model)):
        if out == other.resolve():
            raise OutputDirError(f"--out {out} is the {name} folder; give a new folder")
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputDirError(f"--out {out} is a file; give a new or empty folder")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise OutputDirError(
            f"--out {out} is a folder that is not empty; give a new or empty folder, or --overwrite an earlier export"
        )
    if not _is_export(out, mark):
        raise OutputDirError(
            f"--out {out} holds files that are not an earlier moetune export of this kind (no safetensors file in "
            f"it carries the mark {dict(mark)}); --overwrite replaces earlier exports only. Give a new folder"
        )


def _aside(out: Path) -> tuple[Path, Path]:
    """Where an export of ``out`` is staged, and where the earlier one waits while it moves in."""
    return out.with_name(out.name + ".export-staged"), out.with_name(out.name + ".export-old")


def prepare_out(
    out_dir: str | Path,
    adapter_path: str | Path,
    model_path: str | Path,
    overwrite: bool,
    mark: Mapping[str, str],
) -> tuple[Path, Path]:
    """(``out``, the folder to stage the export in) after what a killed export left is put right and ``out`` is
    checked (``OutputDirError``: new or empty, or with ``overwrite`` an earlier export carrying ``mark``; never the
    adapter's or the model's folder). Nothing is read from the model or the adapter."""
    from moetune.atomic import recover_folder

    out = Path(out_dir).expanduser().resolve()  # a link's target, and "." by its name
    staged, aside = _aside(out)
    recover_folder(out, staged, aside)  # what a killed export left: the previous export back in place
    _check_out(out, Path(adapter_path).expanduser(), Path(model_path).expanduser(), overwrite, mark)
    return out, staged


def publish(staged: Path, out: Path) -> None:
    """Move the staged export in whole, in place of ``out`` (an empty folder, or an earlier export)."""
    from moetune.atomic import replace_folder

    if out.is_dir() and not any(out.iterdir()):
        os.rmdir(out)
    replace_folder(staged, out, _aside(out)[1])


def export_serving_adapter(
    model_path: str | Path, adapter_path: str | Path, out_dir: str | Path, *, overwrite: bool = False
) -> ServingAdapter:
    """Write :func:`serving_adapter`'s result to ``out_dir`` (adapter_config.json, adapter_model.safetensors and
    the adapter folder's tokenizer files), staged beside it and moved in whole. ``out_dir`` must be new or empty,
    or with ``overwrite`` an earlier export; never the adapter's or the model's folder. ``OutputDirError`` for an
    unusable ``out_dir``, before anything is read."""
    from safetensors.torch import save_file

    from moetune.atomic import fsync

    out, staged = prepare_out(out_dir, adapter_path, model_path, overwrite, EXPORT_MARK)
    source = Path(adapter_path).expanduser()
    result = serving_adapter(model_path, source)
    staged.mkdir(parents=True)
    save_file(result.tensors, str(staged / WEIGHTS_NAME), metadata={"format": "pt", **EXPORT_MARK})
    (staged / CONFIG_NAME).write_text(
        json.dumps(result.config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, staged / name)
    for path in staged.iterdir():
        fsync(path)
    publish(staged, out)
    return result
