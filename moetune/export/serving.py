"""A trained adapter in the layout serving engines load: each LoRA pair named after the checkpoint weight it adapts.

moetune saves routed-expert LoRA as stock PEFT does on transformers 5's fused experts (``target_parameters``:
one ``lora_A`` ``[E * r, in]`` / ``lora_B`` ``[out, r * E]`` pair per fused parameter, ``peft_layout``). Serving
engines read fewer forms (checked in their sources, vLLM 0.34.0 and SGLang 0.5.23):

- vLLM applies such a fused pair only on models it marks as 3-D MoE LoRA (gpt-oss, Qwen3.5's multimodal class);
  on Qwen3-MoE, DeepSeek-V2/V3, Kimi-K2, GLM-4.5, ERNIE-4.5-MoE and OLMoE it refuses the adapter unless started
  with a mixed-format flag, and on Mixtral (checkpoint path ``block_sparse_moe``) the expert pairs match no module
  and are skipped. It reads per-expert pairs named as the checkpoint names its per-expert weights
  (``...experts.{e}.gate_proj``, Mixtral's ``...block_sparse_moe.experts.{e}.w1``) on every MoE model.
- SGLang reads per-expert pairs on its fused-MoE models when ``target_modules`` names the projections, scales by
  ``lora_alpha / r`` alone (no rsLoRA), and reads no ``target_parameters``.

So the serving layout writes, for a checkpoint that stores its experts one matrix per expert (every family above
but gpt-oss), per-expert pairs under the checkpoint's own tensor names: expert ``e``'s gate, up and down LoRA
(``A_e = lora_A[e r:(e + 1) r]``, ``B_e[o, j] = lora_B[o, j E + e]``, gate_up's B split into its gate rows and its
up rows), and every other pair under the checkpoint name of the weight it adapts. A checkpoint that stores fused
experts (gpt-oss) keeps PEFT's fused pairs, which vLLM reads there. rsLoRA is folded into B (``sqrt(r)``, so that
``lora_alpha / r`` scales it right everywhere). What no engine applies is refused, by name: router LoRA, whole
weights saved beside the LoRA (``modules_to_save``, a resized embedding) and moetune's LoRA experts.

The result is for serving only: stock PEFT on transformers 5 loads the adapter as trained (the source folder).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moetune.adapters.check import PREFIX, AdapterFolder, check_adapter_folder, lora_pairs
from moetune.adapters.peft_layout import ExpertParamNames, deinterleave_rows, lora_from_peft
from moetune.adapters.swap import CONFIG_NAME, WEIGHTS_NAME
from moetune.errors import AdapterError, listing
from moetune.loading.quant import ROLES

if TYPE_CHECKING:
    from moetune.loading.expert_plan import LayerPlan
    from moetune.loading.load import PlannedLoad

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


@dataclass(frozen=True)
class ServingAdapter:
    """The serving layout of one adapter: ``tensors`` (PEFT-prefixed keys: ``base_model.model.<checkpoint
    module>.lora_A.weight`` ``[r, in]`` / ``lora_B.weight`` ``[out, r]``, fused experts as trained), its
    ``config`` (adapter_config.json), and how many experts modules were written per expert and kept fused."""

    tensors: dict[str, torch.Tensor]
    config: dict[str, Any]
    per_expert: int
    fused: int


def _refusals(adapter: AdapterFolder, pairs: Mapping[str, Any], routers: list[str]) -> list[str]:
    """What serving engines would not apply, each with what to do instead."""
    problems = []
    if adapter.lora_experts is not None:
        problems.append(
            f"{adapter.lora_experts_file.name}: LoRA experts (added experts) are moetune's own; no serving engine "
            "computes them. Serve with moetune generate / chat, or train without lora_experts"
        )
    whole = sorted(k for k in adapter.tensors if not k.endswith((".lora_A.weight", ".lora_B.weight")))
    if whole:
        problems.append(
            f"{WEIGHTS_NAME} holds whole weights beside the LoRA ({listing(whole, inline=True)}: modules_to_save "
            "or a resized embedding); vLLM refuses such adapters and SGLang drops them. Train without "
            "modules_to_save / additional_target to serve the adapter"
        )
    on_router = sorted(m for m in pairs if m in routers)
    if on_router:
        problems.append(
            f"LoRA on the router ({listing(on_router, inline=True)}): SGLang applies no LoRA to routers and vLLM's "
            "is untested; leave the router out of lora_target to serve the adapter"
        )
    return problems


def _checkpoint_names(planned: PlannedLoad) -> dict[str, str]:
    """``{model parameter: checkpoint key}`` for the non-expert keys transformers only renames."""
    out: dict[str, str] = {}
    for key in planned.plan.other_keys:
        target = planned.targets[key]
        if not target.converted:
            out.setdefault(target.target, key)
    return out


def _targets(full: str, entries: list[str]) -> list[str]:
    """The target_parameters ``entries`` that name the parameter ``full`` (exactly or as a dotted suffix, as PEFT
    matches them)."""
    return [e for e in entries if full == e or full.endswith("." + e)]


def _expert_lora(
    tensors: Mapping[str, torch.Tensor], entries: list[str], path: str, module: Any, num_experts: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"gate_up" | "down": (a [E, r, in], b [E, out, r])}`` of the experts module at ``path`` for the fused
    parameters ``entries`` (the adapter's target_parameters) name, gate_up's rows gate first."""
    names = ExpertParamNames.from_module(module)
    params = {"gate_up": names.gate_up, "down": names.down}
    wanted = [proj for proj, param in params.items() if _targets(f"{path}.{param}", entries)]
    prefixes = names.key_prefixes(PREFIX + path) if len(wanted) == 2 else {}
    out = {}
    for proj in wanted:
        prefix = prefixes.get(proj, PREFIX + path)
        a, b = lora_from_peft(
            tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"], num_experts, label=prefix
        )
        out[proj] = (a, deinterleave_rows(b) if proj == "gate_up" and names.interleaved else b)
    return out


class _Writer:
    """The serving tensors, rsLoRA folded into each B, and the module names ``target_modules`` lists."""

    def __init__(self, fold: float) -> None:
        self.fold = fold  # B's factor: sqrt(r) under rsLoRA (alpha / sqrt(r) = sqrt(r) * alpha / r), else 1
        self.tensors: dict[str, torch.Tensor] = {}
        self.leaves: set[str] = set()

    def b(self, b: torch.Tensor) -> torch.Tensor:
        return (b.double() * self.fold).to(b.dtype) if self.fold != 1.0 else b

    def pair(self, module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """One LoRA pair under the checkpoint name ``module``: a ``[r, in]``, b ``[out, r]``."""
        self.tensors[f"{PREFIX}{module}.lora_A.weight"] = a.contiguous().clone()  # gate and up share A
        self.tensors[f"{PREFIX}{module}.lora_B.weight"] = self.b(b).contiguous().clone()
        self.leaves.add(module.rpartition(".")[2])


def _write_experts(
    writer: _Writer, tensors: Mapping[str, torch.Tensor], entries: list[str], layer: LayerPlan, module: Any
) -> set[str] | None:
    """One experts module's LoRA into ``writer``: per expert where the checkpoint stores one matrix per expert
    (returns None), else PEFT's fused pairs as trained (returns the target_parameters entries they need)."""
    path, sources, layout = layer.site.path, layer.sources, layer.site.layout
    lora = _expert_lora(tensors, entries, path, module, layout.num_experts)
    if all(s.expert is not None and s.role in ROLES for s in sources):
        for s in sources:
            proj = "down" if s.role == "down" else "gate_up"
            if proj in lora:
                a, b = lora[proj][0][s.expert], lora[proj][1][s.expert]
                i = layout.intermediate_size
                writer.pair(
                    s.info.key.removesuffix(".weight"), a, {"gate": b[:i], "up": b[i:], "down": b}[s.role]
                )
        return None
    if all(s.expert is None and s.role not in ROLES for s in sources):
        for (
            key,
            tensor,
        ) in tensors.items():  # as trained: vLLM reads PEFT's fused pairs where the checkpoint is fused
            if key.startswith(f"{PREFIX}{path}.") and ".lora_" in key:
                writer.tensors[key] = (writer.b(tensor) if ".lora_B." in key else tensor).contiguous()
        return {
            e for n, _ in module.named_parameters(recurse=False) for e in _targets(f"{path}.{n}", entries)
        }
    raise AdapterError(
        f"{path}: the checkpoint stores these experts per projection for all experts at once (neither one matrix "
        "per expert nor fused); moetune has no serving layout for them"
    )


def serving_adapter(model_path: str | Path, adapter_path: str | Path) -> ServingAdapter:
    """The serving layout (module docstring) of the adapter in ``adapter_path`` for the checkpoint in
    ``model_path``. Reads the checkpoint's headers and the adapter, no model weight; ``AdapterError`` names what
    has no serving layout."""
    from safetensors.torch import load_file

    from moetune.adapters.apply import weight_routers
    from moetune.loading.load import plan_load
    from moetune.loading.options import LoadOptions

    folder = check_adapter_folder(adapter_path).folder
    planned = plan_load(model_path, LoadOptions.create(device="cpu", dtype="float32", progress=False))
    adapter = check_adapter_folder(folder, planned.model.config, meta_model=planned.model)
    pairs, _ = lora_pairs(adapter)
    sites = {s.path: s for s in planned.sites}
    problems = _refusals(adapter, pairs, weight_routers(planned.model, list(sites)))
    if problems:
        raise AdapterError(f"adapter {folder} has no serving layout:{listing(problems)}")

    tensors = load_file(str(adapter.weights_file))
    writer = _Writer(math.sqrt(adapter.r) if adapter.config.get("use_rslora") else 1.0)
    names = _checkpoint_names(planned)
    expert_paths, unnamed = set(), []
    for module in sorted(pairs):
        path = module
        while path.endswith(".base_layer"):
            path = path.removesuffix(".base_layer")
        if path in sites:
            expert_paths.add(path)
        elif (key := names.get(f"{module}.weight")) is not None:
            a, b = (tensors[f"{PREFIX}{module}.lora_{x}.weight"] for x in "AB")
            writer.pair(key.removesuffix(".weight"), a, b)
        else:
            unnamed.append(module)
    if unnamed:
        raise AdapterError(
            f"adapter {folder}: {model_path} stores no weight of {listing(unnamed, inline=True)} under a name "
            "transformers only renames (it converts them at load), so a serving engine would not find them"
        )

    entries = [e for e in adapter.config.get("target_parameters") or [] if isinstance(e, str)]
    layers = {layer.site.path: layer for layer in planned.plan.layers}
    fused_entries: set[str] = set()
    per_expert = fused = 0
    for path in sorted(expert_paths):
        kept = _write_experts(writer, tensors, entries, layers[path], planned.model.get_submodule(path))
        if kept is None:
            per_expert += 1
        else:
            fused += 1
            fused_entries |= kept

    config = dict(adapter.config)
    config.update(
        target_modules=sorted(writer.leaves),
        target_parameters=sorted(fused_entries) or None,
        use_rslora=False,
        lora_dropout=0.0,
        modules_to_save=None,
    )
    return ServingAdapter(writer.tensors, config, per_expert, fused)


def export_serving_adapter(
    model_path: str | Path, adapter_path: str | Path, out_dir: str | Path, *, overwrite: bool = False
) -> ServingAdapter:
    """Write :func:`serving_adapter`'s result to ``out_dir`` (adapter_config.json, adapter_model.safetensors and
    the adapter folder's tokenizer files), staged beside it and moved in whole. ``out_dir`` must be new or empty,
    or with ``overwrite`` an earlier export; never the adapter's or the model's folder."""
    from safetensors.torch import save_file

    from moetune.atomic import fsync, replace_folder

    out = Path(out_dir).expanduser()
    source = Path(adapter_path).expanduser()
    for name, other in (("adapter", source), ("model", Path(model_path).expanduser())):
        if out.resolve() == other.resolve():
            raise AdapterError(f"output folder {out} is the {name} folder; give a new folder")
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not overwrite)):
        what = "a file" if not out.is_dir() else "a folder that is not empty"
        raise AdapterError(
            f"output folder {out} is {what}; give a new or empty folder, or --overwrite an export"
        )
    if overwrite and out.is_dir() and any(out.iterdir()):
        unknown = sorted(
            p.name for p in out.iterdir() if p.name not in (CONFIG_NAME, WEIGHTS_NAME, *TOKENIZER_FILES)
        )
        if unknown:
            raise AdapterError(
                f"output folder {out} holds files an export does not write ({listing(unknown, inline=True)}); "
                "overwrite replaces earlier exports only"
            )
    result = serving_adapter(model_path, source)
    staged, aside = out.with_name(out.name + ".export-staged"), out.with_name(out.name + ".export-old")
    shutil.rmtree(staged, ignore_errors=True)
    shutil.rmtree(aside, ignore_errors=True)
    staged.mkdir(parents=True)
    save_file(result.tensors, str(staged / WEIGHTS_NAME), metadata={"format": "pt"})
    (staged / CONFIG_NAME).write_text(
        json.dumps(result.config, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, staged / name)
    for path in staged.iterdir():
        fsync(path)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    replace_folder(staged, out, aside)
    return result
