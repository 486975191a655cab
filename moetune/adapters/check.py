"""Check a saved adapter folder before any model weight is read: :func:`check_adapter_folder`.

Everything here reads ``adapter_config.json`` and the safetensors *header* of ``adapter_model.safetensors``
only, so a bad adapter costs no model load. Used by ``moetune.load_model(adapter=...)`` (with the model's
config), ``moetune generate/chat --adapter`` (before anything else), :func:`moetune.adapters.load_adapter`
and :func:`moetune.adapters.load_adapter_weights` (resume). Each problem is an ``AdapterError`` naming the
file, the field or tensor, the value, what was expected and what to do.

Without a model config the folder is checked on its own: both files present, the config valid JSON with a
LORA ``peft_type``, an ``r`` >= 1, a numeric ``lora_alpha``, no option moetune would ignore (DoRA, LoRA bias,
``fan_in_fan_out``, rank or alpha patterns), the header readable and consistent with the file's size, only
floating ``lora_A`` / ``lora_B`` weights, each in a complete pair of rank ``r`` (an experts pair ``[E * r, in]``
/ ``[out, r * E]``), beside them only whole weights PEFT saves with an adapter: those of the modules in
``modules_to_save`` (LLaMA-Factory's ``additional_target``, e.g. a router trained fully) and an embedding layer's
base weight (``lm_head.base_layer.weight``: PEFT's ``save_embedding_layers``). With ``model_config`` (a
transformers config; the model is built on the meta device from it, nothing is read) each tensor must also
belong to a module of that model, an ``nn.Linear``, a routed experts module or a router that is not an
``nn.Linear`` (v5 ``TopKRouter``, adapted through ``target_parameters``), with that module's shapes
(``peft_layout`` documents the experts layout), each whole weight to a parameter of the model of its shape, and
every module the config targets must have its pair: when routed experts are targeted, every layer's expert LoRA.

A folder may also hold LoRA experts (``moetune_lora_experts.safetensors``, ``moetune.adapters.lora_experts``);
its header is checked too (moetune's metadata, fp32 tensors of the recorded sizes, whole blocks) and, with
``model_config``, its blocks must be the model's MoE blocks and its hidden size the model's.

The values are checked when the tensors are read (:func:`check_finite`, used by ``read_adapter``): a NaN or
Inf is an ``AdapterError`` naming the file and tensor.

An interrupted :func:`moetune.adapters.save_adapter` is recovered first (``adapters.swap``), so the folder
checked is the last adapter saved whole.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.adapters.swap import CONFIG_NAME, LORA_EXPERTS_NAME, WEIGHTS_NAME, recover_adapter
from moetune.errors import AdapterError, LoadError, listing
from moetune.tensorfile import TensorInfo, read_header

if TYPE_CHECKING:
    import torch

    from moetune.adapters.lora_experts import LoraExpertsSpec

PREFIX = "base_model.model."  # PEFT's saved keys: before a module path of the original model
LORA_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])\.weight")
WHOLE_KEY = re.compile(r"(?P<module>.+)\.(?P<param>weight|bias)")  # a module's whole parameter
# layers whose base weight PEFT saves beside their LoRA (its save_embedding_layers: a resized vocabulary)
EMBEDDING_NAMES = ("embed_tokens", "lm_head")
FLOAT_CODES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # safetensors dtype -> bytes per value
UNSUPPORTED = {  # config fields whose non-default values moetune's loader would not honour
    "use_dora": "DoRA",
    "lora_bias": "LoRA bias",
    "fan_in_fan_out": "fan_in_fan_out",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
}


@dataclass(frozen=True)
class AdapterFolder:
    """A checked adapter folder: its parsed config, rank, alpha and tensor headers (nothing read but these)."""

    folder: Path
    config: dict[str, Any]
    r: int
    lora_alpha: float
    tensors: dict[str, TensorInfo] = field(repr=False)
    lora_experts: LoraExpertsSpec | None = None  # the LoRA experts saved beside the adapter, if any

    @property
    def config_file(self) -> Path:
        return self.folder / CONFIG_NAME

    @property
    def weights_file(self) -> Path:
        return self.folder / WEIGHTS_NAME

    @property
    def lora_experts_file(self) -> Path:
        return self.folder / LORA_EXPERTS_NAME


def check_adapter_folder(
    path: str | Path, model_config: Any = None, *, meta_model: Any = None
) -> AdapterFolder:
    """Check the adapter in ``path`` (module docstring) and return it parsed; ``AdapterError`` otherwise.

    ``model_config``: the transformers config of the model the adapter is for (``model.config`` of a loaded or
    PEFT model works), to check names and shapes against; None checks the folder on its own. ``meta_model``: that
    model already built from ``model_config`` with its transformers experts modules (``plan_load``'s), so it is
    not built again.
    """
    folder = Path(path).expanduser()
    recover_adapter(folder)
    if not folder.is_dir():
        raise AdapterError(
            f"adapter {str(folder)!r} is not a folder ({'it is a file' if folder.exists() else 'it does not exist'}); "
            "pass the output_dir of `moetune train`, or a PEFT save_pretrained folder"
        )
    missing = [name for name in (CONFIG_NAME, WEIGHTS_NAME) if not (folder / name).is_file()]
    if missing:
        raise AdapterError(
            f"adapter folder {folder} lacks {' and '.join(missing)}; expected a PEFT LoRA adapter saved by moetune "
            "or PEFT (pass the output_dir of `moetune train`, or a PEFT save_pretrained folder)"
        )
    config, r, alpha = _read_config(folder / CONFIG_NAME)
    tensors = _read_header(folder / WEIGHTS_NAME)
    adapter = AdapterFolder(folder, config, r, alpha, tensors)
    pairs, whole = lora_pairs(adapter)
    targets = _model_targets(model_config, meta_model) if model_config is not None else None
    if targets is not None:
        _check_against_model(adapter, pairs, whole, model_config, targets)
    if adapter.lora_experts_file.is_file():
        from dataclasses import replace

        from moetune.adapters.lora_experts import check_lora_experts_file

        blocks = sorted({p.rpartition(".")[0] for p in targets.experts}) if targets is not None else None
        hidden = model_config.get_text_config().hidden_size if model_config is not None else None
        adapter = replace(
            adapter, lora_experts=check_lora_experts_file(adapter.lora_experts_file, blocks, hidden)
        )
    return adapter


def check_finite(tensors: Mapping[str, torch.Tensor], where: Path) -> None:
    """``AdapterError`` naming ``where`` and the first tensor holding NaN or Inf (tensors are LoRA-sized)."""
    import torch

    from moetune.finite import all_finite, non_finite_mask

    for key, t in tensors.items():
        if all_finite(t):
            continue
        bad = non_finite_mask(t)
        nan = int(torch.isnan(t).sum())
        raise AdapterError(
            f"{where}: tensor {key} holds {nan} NaN and {int(bad.sum()) - nan} Inf value(s); the adapter was "
            "saved from a diverged run or is damaged. Use an earlier checkpoint's adapter"
        )


def scan_adapter_values(adapter: AdapterFolder) -> None:
    """Refuse NaN/Inf in the adapter's files (:func:`scan_file_values`), before a model is loaded for it."""
    files = [adapter.weights_file] + ([adapter.lora_experts_file] if adapter.lora_experts else [])
    for path in files:
        scan_file_values(path)


def scan_file_values(path: Path) -> None:
    """Read the safetensors file ``path`` of an adapter one tensor at a time (safetensors' lazy reader: one tensor
    in memory at a time) and refuse NaN/Inf by :func:`check_finite`; an unreadable file is an ``AdapterError`` too."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            for key in list(f.keys()):  # safe_open is not iterable
                check_finite({key: f.get_tensor(key)}, path)
    except SafetensorError as e:
        raise AdapterError(f"{path} cannot be read ({e}); re-save the adapter") from None


def _read_config(path: Path) -> tuple[dict[str, Any], int, float]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise AdapterError(
            f"{path} is not valid JSON ({e}); re-save the adapter or restore the file"
        ) from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path} holds a JSON {type(config).__name__}; an adapter config is a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"{path}: peft_type {config.get('peft_type')!r}; moetune loads LORA adapters only")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise AdapterError(f"{path}: r is {r!r}; it must be a whole number >= 1 (the LoRA rank)")
    if "lora_alpha" not in config:
        raise AdapterError(f"{path} has no lora_alpha; add the alpha the adapter was trained with")
    alpha = config["lora_alpha"]
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise AdapterError(f"{path}: lora_alpha is {alpha!r}; it must be a finite number")
    if not isinstance(config.get("use_rslora", False), bool):
        raise AdapterError(f"{path}: use_rslora is {config['use_rslora']!r}; it must be true or false")
    used = [what for key, what in UNSUPPORTED.items() if config.get(key)]
    if used:
        raise AdapterError(f"{path} uses {', '.join(used)}, which moetune does not load; retrain without it")
    for key in ("target_modules", "target_parameters"):
        value = config.get(key)
        if not (value is None or isinstance(value, str) or _strings(value)):
            raise AdapterError(f"{path}: {key} is {value!r}; it must be a list of names, a pattern or null")
    if not config.get("target_modules") and not config.get("target_parameters"):
        raise AdapterError(f"{path} targets nothing: target_modules and target_parameters are both empty")
    return config, r, float(alpha)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _read_header(path: Path) -> dict[str, TensorInfo]:
    try:
        tensors = read_header(path)
    except LoadError as e:
        raise AdapterError(f"{path} is damaged: {e}; re-save the adapter or restore the file") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:  # a header entry that is not a tensor's
        raise AdapterError(f"{path} is damaged: its safetensors header is malformed ({e!r})") from None
    for key, info in tensors.items():
        size = FLOAT_CODES.get(info.dtype)
        if size is None:
            raise AdapterError(
                f"{path}: tensor {key} has dtype {info.dtype}; LoRA weights are floating point"
            )
        if info.nbytes != math.prod(info.shape) * size:
            raise AdapterError(
                f"{path} is damaged: tensor {key} spans {info.nbytes} bytes, its shape {list(info.shape)} and "
                f"dtype {info.dtype} need {math.prod(info.shape) * size}"
            )
    if not tensors:
        raise AdapterError(f"{path} holds no tensors; the adapter save did not finish: save it again")
    return tensors


def _saved_whole(key: str, config: Mapping[str, Any]) -> bool:
    """Whether ``key`` (without PEFT's prefix) is a whole parameter PEFT saves with a LoRA adapter: of a module in
    ``modules_to_save``, or an embedding layer's base weight."""
    m = WHOLE_KEY.fullmatch(key)
    if m is None:
        return False
    saved = config.get("modules_to_save") or []
    if isinstance(saved, list) and any(
        entry_matches(m["module"], entry) for entry in saved if isinstance(entry, str)
    ):
        return True
    layer, _, tail = m["module"].rpartition(".")
    return tail == "base_layer" and layer.rpartition(".")[2] in EMBEDDING_NAMES


def lora_pairs(
    adapter: AdapterFolder,
) -> tuple[dict[str, tuple[TensorInfo, TensorInfo]], dict[str, TensorInfo]]:
    """(``{module key prefix (without PEFT's prefix): (A, B)}``, ``{key: whole parameter}``): every key a LoRA
    weight or a whole parameter PEFT saves with one (:func:`_saved_whole`), every A with its B."""
    where, r = adapter.weights_file, adapter.r
    found: dict[str, dict[str, TensorInfo]] = {}
    whole: dict[str, TensorInfo] = {}
    other = []
    for key, info in adapter.tensors.items():
        m = LORA_KEY.fullmatch(key.removeprefix(PREFIX))
        if m is not None:
            found.setdefault(m["module"], {})[m["ab"]] = info
        elif _saved_whole(key.removeprefix(PREFIX), adapter.config):
            whole[key.removeprefix(PREFIX)] = info
        else:
            other.append(key)
    embedding = sorted(k for k in other if ".lora_embedding_" in k)
    if embedding:
        raise AdapterError(
            f"{where} holds LoRA on embedding layers ({listing(embedding[:4], inline=True)}: PEFT's "
            "lora_embedding_A / lora_embedding_B); moetune does not load or export LoRA on embeddings. Train the "
            "embedding in modules_to_save instead, or leave it out of lora_target"
        )
    if other:
        saved = adapter.config.get("modules_to_save")
        raise AdapterError(
            f"{where} holds tensors that are neither LoRA A/B weights nor whole weights of the modules in "
            f"modules_to_save ({saved!r} in adapter_config.json): {listing(sorted(other), inline=True)}; "
            "moetune loads LoRA adapters (with modules_to_save), not DoRA or prompt-learning ones"
        )
    half = sorted(f"{m}.lora_{'B' if 'A' in ab else 'A'}.weight" for m, ab in found.items() if len(ab) != 2)
    if half:
        raise AdapterError(
            f"{where} is incomplete: it lacks {listing(half, inline=True)}; save the adapter again"
        )
    pairs = {m: (ab["A"], ab["B"]) for m, ab in found.items()}
    for module, (a, b) in pairs.items():
        ok = len(a.shape) == 2 and len(b.shape) == 2 and a.shape[0] == b.shape[1] and a.shape[0] % r == 0
        if not ok:
            raise AdapterError(
                f"{where}: {module}'s lora_A {list(a.shape)} and lora_B {list(b.shape)} are not a rank-{r} pair "
                f"(adapter_config.json says r={r}): expected [r, in] and [out, r], or for routed experts "
                "[E * r, in] and [out, r * E]. Is r in adapter_config.json the rank the adapter was saved with?"
            )
    return pairs, whole


@dataclass(frozen=True)
class _Target:
    """One LoRA place of the model: ``(in, out)`` and ``E`` (1 for a Linear)."""

    n_in: int
    n_out: int
    experts: int = 1


@dataclass(frozen=True)
class _ModelTargets:
    """Where a model takes LoRA, and its parameters' shapes (for whole weights)."""

    linears: dict[str, _Target]  # nn.Linear paths
    experts: dict[str, dict[str, _Target]]  # routed-experts paths -> {param: shapes}
    routers: dict[str, _Target]  # routers that are not nn.Linear (LoRA on their weight, by target_parameters)
    shapes: dict[str, tuple[int, ...]]  # every parameter's


def _model_targets(model_config: Any, model: Any = None) -> _ModelTargets:
    """The LoRA places and parameter shapes of ``model``, the model of ``model_config`` on the meta device, built
    here when None (no weight exists or is read)."""
    import torch

    from moetune.adapters.apply import weight_routers
    from moetune.arch import find_experts, resolve_arch
    from moetune.loading import hf

    if model is None:
        model = hf.empty_model(model_config, torch.float32, "")
    sites = find_experts(model, resolve_arch(model_config.model_type), model_config.model_type)
    experts: dict[str, dict[str, _Target]] = {}
    for s in sites:
        # the transformers module's own 3-D parameters, in registration order, read as stock PEFT reads them:
        # [E, in, out] where the module declares is_transposed (gpt-oss), else [E, out, in] (Llama 4's flagless
        # [E, H, 2I] too: PEFT's roles swapped). Not the engine's sizes: a non-gated family's up_proj [E, I, H]
        # (NemotronH) and the zero-computation experts' rows (LongCat-Flash) are the module's
        module = model.get_submodule(s.path)
        experts[s.path] = {}
        for name, p in module.named_parameters(recurse=False):
            if p.dim() == 3:
                e, d1, d2 = p.shape
                flagged = s.layout.declares_transposed
                experts[s.path][name] = _Target(d1, d2, e) if flagged else _Target(d2, d1, e)
    inside = tuple(p + "." for p in experts)
    linears = {
        p: _Target(m.in_features, m.out_features)
        for p, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not p.startswith(inside)
    }
    routers = {
        p: _Target(*reversed(model.get_submodule(p).weight.shape))
        for p in weight_routers(model, list(experts))
    }
    # every name a parameter has (a tied lm_head's weight is the embedding's, listed under both)
    shapes = {name: tuple(t.shape) for name, t in model.named_parameters(remove_duplicate=False)}
    return _ModelTargets(linears, experts, routers, shapes)


def entry_matches(path: str, entry: str) -> bool:
    """Whether a ``target_modules`` / ``target_parameters`` entry names ``path``: exactly or as a dotted suffix,
    as PEFT matches them."""
    return path == entry or path.endswith("." + entry)


def expert_lora_prefixes(path: str, params: Sequence[str], config: Mapping[str, Any]) -> dict[str, str]:
    """``{parameter: LoRA key prefix}`` (without PEFT's prefix) for the fused parameters ``params`` (in the order
    the experts module at ``path`` registers them) that adapter ``config`` targets: by ``target_parameters``, or
    all of them when ``target_modules`` names the module. PEFT nests one ``ParamWrapper`` per targeted parameter,
    the last registered outermost, so the i-th of n has its pair under ``path + ".base_layer" * (n - 1 - i)``."""
    modules = config.get("target_modules") or []
    entries = config.get("target_parameters") or []
    named = [p for p in params if any(entry_matches(f"{path}.{p}", e) for e in entries)]
    by_module = isinstance(modules, list) and any(entry_matches(path, e) for e in modules)
    chosen = list(params) if by_module and not named else named
    return {p: path + ".base_layer" * (len(chosen) - 1 - n) for n, p in enumerate(chosen)}


def _check_against_model(
    adapter: AdapterFolder,
    pairs: dict[str, tuple[TensorInfo, TensorInfo]],
    whole: dict[str, TensorInfo],
    model_config: Any,
    targets: _ModelTargets,
) -> None:
    where, r = adapter.weights_file, adapter.r
    linears, experts = targets.linears, targets.experts
    modules = adapter.config.get("target_modules") or []
    params = adapter.config.get("target_parameters") or []

    expected: dict[str, _Target] = {}  # key prefix -> the shapes its pair must have
    for path, target in linears.items():
        if isinstance(modules, str):  # a pattern: PEFT matches the whole module path
            hit = re.fullmatch(modules, path) is not None
        else:
            hit = any(entry_matches(path, e) for e in modules)
        if hit or any(entry_matches(f"{path}.weight", e) for e in params):
            expected[path] = target
    for path, target in targets.routers.items():  # PEFT adapts them through target_parameters only
        if any(entry_matches(f"{path}.weight", e) for e in params):
            expected[path] = target
    for path in experts:  # registration order: gate_up first
        for param, prefix in expert_lora_prefixes(path, list(experts[path]), adapter.config).items():
            expected[prefix] = experts[path][param]
    unknown = sorted(set(pairs) - set(expected))
    if unknown:
        raise AdapterError(
            f"{where} holds LoRA for {listing(unknown, inline=True)}, which {type(model_config).__name__}'s model "
            "does not have or adapter_config.json does not target; was the adapter saved for this model?"
        )
    absent = sorted(set(expected) - set(pairs))
    if absent:
        raise AdapterError(
            f"{where} is incomplete: adapter_config.json targets {listing(absent, inline=True)} but the file has no "
            "LoRA for them (lora_A / lora_B); the save was cut short or the file was edited. Save the adapter again"
        )
    # the model's own parameter: an embedding's base weight is the layer's weight
    for key, info in whole.items():
        name = key.replace(".base_layer.", ".")
        shape = targets.shapes.get(name)
        if shape is None or tuple(info.shape) != shape:
            has = "has no such parameter" if shape is None else f"has it as {list(shape)}"
            raise AdapterError(
                f"{where}: {key} {list(info.shape)} (a whole weight saved with the adapter) does not fit "
                f"{type(model_config).__name__}'s model, which {has}; was the adapter saved for this model?"
            )
    for module, (a, b) in pairs.items():
        t = expected[module]
        want_a, want_b = [t.experts * r, t.n_in], [t.n_out, r * t.experts]
        if [*a.shape] != want_a or [*b.shape] != want_b:
            what = f"a routed-experts projection (E={t.experts})" if t.experts > 1 else "a Linear"
            raise AdapterError(
                f"{where}: {module}'s lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit {what} of the "
                f"model with r={r} (adapter_config.json): expected {want_a} / {want_b}. Was the adapter saved "
                "for this model, with this r?"
            )
