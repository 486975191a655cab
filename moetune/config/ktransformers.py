"""KTransformers' LLaMA-Factory keys, read as moetune's own options.

LLaMA-Factory's KTransformers integration (``use_kt: true`` plus flat ``kt_*`` keys, older ``cpu_infer`` /
``chunk_size`` / ``kt_optimize_rule``, and the newer ``kt_config:`` mapping of ``KTConfig`` fields) configures
another CPU expert backend. moetune's engine takes that backend's place, so each key is one of:

- **mapped** onto a ``moetune:`` engine option (``kt_backend`` / ``kt_expert_weight_format`` ->
  ``expert_format``, ``cpu_infer`` / ``kt_num_threads`` -> ``num_threads``, ``kt_cpu_activation`` ->
  ``activation_policy``, ``kt_num_gpu_experts`` -> ``gpu_experts``); setting the same option both ways is an error;
- **inert**: the other backend's tuning knobs, accepted with one logged line each saying why they have no
  effect here;
- **LoRA experts** (``kt_use_lora_experts``, ``kt_lora_expert_num``, ``kt_lora_expert_intermediate_size``): handed
  back to the top level, where ``moetune.config.lora_experts`` reads them as ``lora_experts`` /
  ``lora_expert_intermediate_size``;
- **refused** where it asks for something moetune does differently (``kt_weight_path``: a KTransformers
  ``.kt`` tree; convert with ``moetune convert`` instead).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from moetune.config.fields import Problems
from moetune.config.lora_experts import KT_KEYS as LORA_EXPERT_KEYS

log = logging.getLogger(__name__)

KT_CONFIG = "kt_config"

# kt_backend (any case) -> moetune expert_format; "auto" follows kt_expert_weight_format, else the checkpoint
_BACKEND_FORMATS = {
    "auto": "auto",
    "amxbf16": "bf16",
    "int8": "int8",
    "amxint8": "int8",
    "amxint4": "int4",
    "fp8": "fp8",
    "amxfp8": "fp8",
}
_WEIGHT_FORMATS = {"bf16": "bf16", "int8": "int8", "fp8": "fp8"}

_CONVERT = (
    "moetune reads routed experts from the checkpoint, or from a store written by `moetune convert "
    "MODEL_DIR STORE_DIR --format int8` (set `moetune: {expert_path: STORE_DIR}`); it does not read "
    "KTransformers .kt files. Remove it and convert once instead"
)

# keys with no effect here: why
_INERT: dict[str, str] = {
    "chunk_size": "KTransformers' CPU chunk length; moetune's engine runs each micro-batch's tokens in one pass",
    "kt_threadpool_count": "KTransformers' per-NUMA thread pools; moetune uses torch's one intra-op pool "
    "(size it with cpu_infer / moetune.num_threads)",
    "kt_tp_enabled": "KTransformers' tensor parallelism over NUMA nodes; moetune's engine runs in one pool",
    "kt_optimize_rule": "KTransformers' module-injection rules; moetune swaps the MoE experts itself",
    "kt_max_cache_depth": "KTransformers' activation cache depth; moetune keeps one saved forward per layer call",
    "kt_share_backward_bb": "a KTransformers buffer-sharing switch; moetune's engine reuses its buffers itself",
    "kt_share_cache_pool": "a KTransformers buffer-sharing switch; moetune's engine reuses its buffers itself",
    "kt_model_max_length": "KTransformers' buffer capacity; moetune sizes buffers per batch (cutoff_len bounds it)",
    "kt_maxlen": "KTransformers' engine capacity; moetune sizes buffers per batch (cutoff_len bounds it)",
    "kt_use_cuda_graph": "KTransformers' CUDA graphs; moetune runs eagerly",
    "kt_mode": "KTransformers' long-context mode; moetune has one mode",
    "mode": "KTransformers' long-context mode; moetune has one mode",
    "kt_force_think": "a KTransformers inference switch; `moetune train` does not generate",
    "kt_weight_lifecycle": "persistent is how moetune holds experts (for paging from disk see expert_residency)",
}
# keys whose value decides: a function from the value to a refusal (None: accepted, inert)
_CHECKED: dict[str, Callable[[Any], str | None]] = {
    "kt_weight_path": lambda v: None if v is None else _CONVERT,
    "kt_non_expert_weight_path": lambda v: None if v is None else _CONVERT,
    "kt_expert_checkpoint_path": lambda v: (
        None
        if v is None
        else "moetune reads the routed experts from model_name_or_path (or a store, `moetune: {expert_path: ...}`); "
        "remove it"
    ),
    "kt_weight_lifecycle": lambda v: (
        None
        if str(v).lower() == "persistent"
        else "moetune holds experts persistently; to page them from disk convert once (`moetune convert`) and set "
        "`moetune: {expert_path: ..., expert_residency: disk}`"
    ),
}
# key -> (engine option, value translation); None from the translation: the value is not allowed
_MAPPED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "kt_backend": ("expert_format", lambda v: _BACKEND_FORMATS.get(str(v).lower())),
    "kt_expert_weight_format": ("expert_format", lambda v: _WEIGHT_FORMATS.get(str(v).lower())),
    "cpu_infer": ("num_threads", lambda v: v),
    "kt_num_threads": ("num_threads", lambda v: v),
    "kt_num_gpu_experts": (
        "gpu_experts",
        lambda v: v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None,
    ),
    "kt_cpu_activation": (
        "activation_policy",
        lambda v: str(v).lower() if str(v).lower() in ("retain", "recompute") else None,
    ),
}
_ALLOWED = {
    "kt_backend": ", ".join(_BACKEND_FORMATS),
    "kt_expert_weight_format": ", ".join(_WEIGHT_FORMATS),
    "kt_cpu_activation": "retain, recompute",
    "kt_num_gpu_experts": "a number of experts per MoE layer, 0 or more",
}


def is_kt_key(key: str) -> bool:
    """True for a KTransformers key this module reads (``use_kt``, ``kt_config`` and the keys above)."""
    return (
        key in ("use_kt", KT_CONFIG)
        or key in _INERT
        or key in _CHECKED
        or key in _MAPPED
        or key in LORA_EXPERT_KEYS
    )


def translate_kt(flat: dict[str, Any], engine: dict[str, Any], problems: Problems) -> dict[str, str]:
    """Remove the KTransformers keys from ``flat`` (and its ``kt_config`` mapping), writing mapped values into
    ``engine`` (the ``moetune:`` mapping), logging inert ones and reporting refused ones. Returns engine option
    -> the KTransformers key it came from (so that a bad value is reported under the user's key)."""
    keys = {k: flat.pop(k) for k in list(flat) if isinstance(k, str) and is_kt_key(k)}
    nested = keys.pop(KT_CONFIG, None)
    if nested is not None and not isinstance(nested, Mapping):
        problems.add(KT_CONFIG, f"got {nested!r}; expected a mapping of KTransformers settings")
    elif nested:
        for key, value in nested.items():
            if key in keys:
                problems.add(f"{KT_CONFIG}.{key}", f"is also set at the top level; set {key} once")
            elif isinstance(key, str) and is_kt_key(key) and key not in ("use_kt", KT_CONFIG):
                keys[key] = value
            else:
                problems.add(f"{KT_CONFIG}.{key}", "is not a KTransformers setting moetune knows; remove it")
    for key in LORA_EXPERT_KEYS:  # flat training options (moetune.config.lora_experts reads them)
        if key in keys:
            flat[key] = keys.pop(key)
    use_kt = keys.pop("use_kt", None)
    if use_kt not in (None, True, False):
        problems.add("use_kt", f"got {use_kt!r}; expected true or false")
    elif use_kt:
        log.warning(
            "use_kt: true: moetune's own CPU expert engine runs the routed experts (KTransformers is not used)"
        )
    origins: dict[str, str] = {}
    for key, value in keys.items():
        option = _one(key, value, engine, problems)
        if option is not None:
            origins[option] = key
    return origins


def _one(key: str, value: Any, engine: dict[str, Any], problems: Problems) -> str | None:
    """Apply one key; returns the engine option it set, if any."""
    if key in _CHECKED:
        refusal = _CHECKED[key](value)
        if refusal is not None:
            problems.add(key, f"got {value!r}; {refusal}")
            return None
    if key in _MAPPED:
        option, translate = _MAPPED[key]
        mapped = translate(value)
        if key == "kt_backend" and mapped == "auto":
            log.warning(
                "kt_backend: auto: moetune's expert_format follows kt_expert_weight_format, else the checkpoint"
            )
        elif mapped is None:
            problems.add(key, f"got {value!r}; allowed: {_ALLOWED[key]} (read as moetune's {option})")
        elif option in engine and str(engine[option]).lower() != str(mapped).lower():
            problems.add(
                key,
                f"is read as `moetune: {{{option}: {mapped}}}`, but {option} is already {engine[option]!r}; set it once",
            )
        else:
            engine[option] = mapped
            log.warning("%s: %r read as moetune's %s: %r", key, value, option, mapped)
            return option
        return None
    if key in _INERT and value is not None:
        log.warning("%s: %r has no effect in moetune: %s", key, value, _INERT[key])
    return None
