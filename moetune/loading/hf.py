"""The seam with transformers' loader: an empty model, its key renaming rules, loading the non-expert weights.

``from_pretrained`` would materialise every expert weight (its conversions even stack per-expert tensors
into fused ones), and neither ``device_map`` nor ``key_mapping`` avoids that. So moetune runs the same
steps as ``PreTrainedModel.from_pretrained`` itself, with the experts taken out in between:

1. build the model under transformers' own init context (meta device, target dtype, no weight init);
2. rename checkpoint keys with the model's conversion mapping (``get_model_conversion_mapping``) to tell
   expert tensors from the rest;
3. after moetune has replaced the experts modules on the instance, hand the remaining tensors (lazy
   safetensors slices) to ``_load_pretrained_model`` and ``_finalize_model_loading``, which rename and
   convert them, place them on ``device`` in the right dtype (fp32-kept routers included), initialise the
   non-persistent buffers (RoPE), tie weights and report missing or unexpected keys.

These are transformers-internal entry points (stable across 5.x, pinned below 5.25 in pyproject); they live
here alone so a change in transformers breaks one file.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from huggingface_hub.errors import StrictDataclassError

from moetune.arch.spec import supported_summary
from moetune.errors import ArchError, LoadError, listing
from moetune.loading.checkpoint import Checkpoint, ShardReader
from moetune.loading.model_types import MODEL_TYPE_ALIASES
from moetune.loading.quant import Dequantized, QuantizedWeight, QuantMethod

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The checkpoint's tokenizer, told the config moetune builds (``load_config``: a ``kimi_k2`` folder is
    DeepSeek-V3's), so that a plain tokenizer beside remote model code loads without running that code; a
    tokenizer that is remote code itself (Kimi's tiktoken one) still needs ``trust_remote_code``."""
    from transformers import AutoTokenizer

    config = load_config(Checkpoint.open(path), trust_remote_code)
    return AutoTokenizer.from_pretrained(str(path), config=config, trust_remote_code=trust_remote_code)


def load_config(checkpoint: Checkpoint, trust_remote_code: bool = False) -> Any:
    """The transformers config of ``checkpoint``, always one of transformers' own config classes.

    A model type transformers knows is read by ``AutoConfig`` (its own class, never the checkpoint's
    ``auto_map`` code); one of ``MODEL_TYPE_ALIASES`` (``kimi_k2``) is checked and mapped onto the type it
    stands for; any other is an ``ArchError``. ``trust_remote_code`` changes none of this: moetune swaps the
    experts of transformers' own modules and never runs a checkpoint's Python code (the flag only reaches
    the tokenizer, in ``moetune train``); with it set, the log says which class runs instead.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    model_type = checkpoint.model_type
    if not model_type:
        raise LoadError(f"{checkpoint.path}/config.json has no model_type: cannot tell the architecture")
    remote = checkpoint.config.get("auto_map")
    alias = MODEL_TYPE_ALIASES.get(model_type) if model_type in MODEL_TYPE_ALIASES else None
    if alias is None and model_type not in CONFIG_MAPPING:
        import transformers

        code = (
            f" Its config.json names remote code (auto_map {remote}); moetune never runs a checkpoint's "
            "code, whatever trust_remote_code says: it swaps the experts of transformers' own modules."
            if remote
            else ""
        )
        raise ArchError(
            f"model_type {model_type!r} ({checkpoint.path}/config.json) is not an architecture transformers "
            f"{transformers.__version__} knows, nor one moetune maps onto one "
            f"({', '.join(MODEL_TYPE_ALIASES.names())}).{code} moetune supports:\n{supported_summary()}"
        )
    where = f"{checkpoint.path}/config.json"
    try:
        if alias is not None:
            config = CONFIG_MAPPING[alias.target].from_dict(alias.config_dict(checkpoint.config, where))
        else:
            config = AutoConfig.from_pretrained(str(checkpoint.path), trust_remote_code=False)
    except (ValueError, KeyError, TypeError, StrictDataclassError) as e:
        # StrictDataclassError: a field of the wrong type (``"hidden_size": "64"``), from huggingface_hub
        raise LoadError(
            f"transformers cannot read {where} as a {model_type!r} config: {e}; fix that field of config.json"
        ) from e
    if alias is not None or (trust_remote_code and remote):
        logger.info(
            "moetune: %s (model_type %r) loads as transformers' own %s%s",
            checkpoint.path,
            model_type,
            type(config).__name__,
            f"; the checkpoint's remote code (auto_map {remote}) is not run" if remote else "",
        )
    for part in [config, *(getattr(config, key, None) for key in config.sub_configs)]:
        if part is not None and hasattr(part, "quantization_config"):
            # moetune reads the quantization itself (loading.quant): it dequantizes every non-expert weight and
            # holds the experts in its engine, so the transformers model is not a quantized one (a composite
            # model, Kimi-K2.5, declares it in its text config).
            del part.quantization_config
    return config


def model_class(config: Any) -> tuple[type[PreTrainedModel], Any]:
    """The class ``load_model`` builds for ``config`` (the checkpoint's own model), and the config it takes.

    The class the checkpoint's ``architectures`` names, where transformers' ``AutoModelForCausalLM`` or
    ``AutoModelForImageTextToText`` maps ``config``'s type to it; else, for a vision-language config, the
    ``AutoModelForImageTextToText`` class (``...ForConditionalGeneration``, vision tower included), else the
    ``AutoModelForCausalLM`` one. A class built on the text sub-config (``Qwen3_5MoeForCausalLM`` named by a
    ``qwen3_5_moe`` checkpoint) gets that sub-config, as transformers' auto classes do.
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    def classes(cfg: Any) -> list[Any]:
        found = [
            m[type(cfg)]
            for m in (MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING)
            if type(cfg) in m
        ]
        return [
            c for entry in found for c in (entry if isinstance(entry, tuple) else (entry,)) if c is not None
        ]

    candidates = classes(config)
    if not candidates:  # an omni model without a trainable whole (Qwen3-Omni): its text-generating part
        parts = [getattr(config, key, None) for key in config.sub_configs]
        part = next((p for p in parts if p is not None and classes(p)), None)
        if part is not None:
            return classes(part)[0], part
    if not candidates:
        raise ArchError(
            f"model_type {config.model_type!r} has no causal-LM or image-text-to-text class in transformers "
            f"(not a text generation model). moetune supports:\n{supported_summary()}"
        )
    named = [c for c in candidates if c.__name__ in (getattr(config, "architectures", None) or [])]
    cls = cast("type[PreTrainedModel]", (named or candidates)[0])
    text_config_class = config.sub_configs.get("text_config")
    if text_config_class is not None and getattr(cls, "config_class", None) is text_config_class:
        config = config.get_text_config()
    return cls, config


def empty_model(config: Any, dtype: torch.dtype, name_or_path: str) -> PreTrainedModel:
    """The model of ``config`` (``model_class``) on the meta device, built the way ``from_pretrained`` builds it."""
    from transformers.monkey_patching import patch_output_recorders
    from transformers.utils import ContextManagers

    cls, config = model_class(config)
    config = copy.deepcopy(config)
    config.name_or_path = name_or_path
    for sub in [config, *(getattr(config, key) for key in config.sub_configs)]:
        if sub is not None:  # as from_pretrained: every sub-config (vision, text) in the load dtype
            sub.dtype = dtype
    with ContextManagers(cls.get_init_context(dtype, False, False, False)):
        model = cls(config)
        patch_output_recorders(model)
    return model


def _split_mapping(model: PreTrainedModel) -> tuple[list[Any], list[Any]]:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    return renamings, converters


@dataclass(frozen=True)
class KeyTarget:
    """Where one checkpoint key goes under transformers' rules for the model."""

    target: str  # the model tensor it loads into (renamings, at most one converter, base-model prefix fixed)
    renamed: str  # after the renamings only: a per-expert key still names its expert here
    converted: bool  # a converter (merge, split, transpose ...) maps it, not only a rename
    # A converter that splits one list of tensors over several modules (ERNIE-4.5-VL: experts 0..E-1 to the
    # text experts, E..2E-1 to the vision experts): all its targets in order, ``target`` first; else empty.
    split: tuple[str, ...] = ()
    # the converter's operations by class name (``Interleave``, ``Concatenate`` ...)
    ops: tuple[str, ...] = ()


def checkpoint_targets(model: PreTrainedModel, keys: list[str]) -> dict[str, KeyTarget]:
    """Each checkpoint key's destination, decided as ``convert_and_load_state_dict_in_model`` decides it."""
    from transformers.core_model_loading import apply_renamings, rename_source_key

    renamings, converters = _split_mapping(model)
    meta = model.state_dict()
    prefix = model.base_model_prefix
    out = {}
    for key in keys:
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if target not in meta and key in meta:  # transformers' fallback: keep the name, fix only the prefix
            target, pattern = rename_source_key(key, [], [], prefix, meta)
        renamed = apply_renamings(key, renamings)
        conv = next((c for c in converters if c.rename_source_key(renamed)[1] is not None), None)
        if pattern is None or conv is None:
            out[key] = KeyTarget(target, renamed, pattern is not None)
            continue
        patterns = list(conv.target_patterns)
        split = tuple(target.replace(patterns[0], p) for p in patterns) if len(patterns) > 1 else ()
        ops = tuple(type(op).__name__ for op in conv.operations)
        out[key] = KeyTarget(target, renamed, True, split if patterns[0] in target else (), ops)
    return out


def check_non_expert(
    model: PreTrainedModel, checkpoint: Checkpoint, targets: dict[str, KeyTarget], keys: list[str]
) -> None:
    """Before loading: every model tensor has a checkpoint key, and plainly renamed ones have its shape.

    ``model`` has its experts modules replaced already. Coverage is checked only when no key loading into
    the model needs a converter (one source may feed several targets); ``load_weights`` checks again after.
    """
    meta = model.state_dict()
    problems = []
    for key in keys:
        dest, info = targets[key], checkpoint.tensors[key]
        if not dest.converted and dest.target in meta and info.shape != tuple(meta[dest.target].shape):
            want = tuple(meta[dest.target].shape)
            problems.append(f"{info.file}: {key} has shape {info.shape}, the model's {dest.target} is {want}")
    if not any(targets[k].converted and targets[k].target in meta for k in keys):
        ignored = [re.compile(p) for p in (getattr(model, "_keys_to_ignore_on_load_missing", None) or [])]
        covered = {targets[k].target for k in keys} | set(model.all_tied_weights_keys)
        missing = sorted(k for k in meta if k not in covered and not any(p.search(k) for p in ignored))
        problems += [f"no tensor for {k} in any shard" for k in missing]
    if problems:
        raise LoadError(f"checkpoint {checkpoint.path} does not fit its config.json:{listing(problems)}")


def skip_weight_init(model: PreTrainedModel, paths: list[str]) -> None:
    """Keep transformers' initialisation of missing weights (``_initialize_missing_keys``) off the modules ``paths``.

    Some families' ``_init_weights`` reach from the MoE block into ``block.experts.gate_up_proj`` (Qwen3-Omni),
    which a moetune experts module does not have. Skipping the blocks loses nothing: every weight they hold is
    loaded from the checkpoint, and ``load_weights`` raises for any that is missing.
    """
    for path in paths:
        block: Any = model.get_submodule(path)
        block._is_hf_initialized = True  # the flag transformers itself sets on modules it has initialised


def load_weights(
    model: PreTrainedModel,
    checkpoint: Checkpoint,
    keys: list[str],
    device: torch.device,
    dtype: torch.dtype,
    quantized: Mapping[str, QuantizedWeight] | None = None,
    method: QuantMethod | None = None,
) -> None:
    """Load tensors ``keys`` of ``checkpoint`` into ``model`` on ``device`` through transformers' own loader.

    ``quantized`` maps the logical keys among ``keys`` that are quantized weights of ``method`` to their
    stored tensors; those reach transformers dequantized (``quant.Dequantized``), as plain float tensors it
    casts to ``dtype``.

    ``LoadError`` if the model still has parameters without a value afterwards (a non-expert tensor missing
    from the checkpoint): training would silently start from random weights.
    """
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.modeling_utils import LoadStateDictConfig

    cls = type(model)
    load_config = LoadStateDictConfig(
        pretrained_model_name_or_path=str(checkpoint.path),
        device_map={"": str(device)},
        dtype=dtype,
        dtype_plan=model._get_dtype_plan(dtype),
        weight_mapping=get_model_conversion_mapping(model),  # type: ignore[arg-type]  # transformers' hints
        use_safetensors=True,
    )
    wanted = set(keys)
    dequantized = {k: w for k, w in (quantized or {}).items() if k in wanted}
    plain = [k for k in keys if k not in dequantized]
    files = {checkpoint.tensors[k].file for k in plain} | {f for w in dequantized.values() for f in w.files}
    with ShardReader(checkpoint, [files]) as reader:
        lazy: dict[str, Any] = {k: reader.file(checkpoint.tensors[k].file).get_slice(k) for k in plain}
        if dequantized:  # read on assignment, like the slices
            assert method is not None, "quantized weights come with their method"
            lazy.update({k: Dequantized(method, w, reader) for k, w in dequantized.items()})
        # transformers raises RuntimeError for size mismatches and failed conversions
        try:
            info, _ = cls._load_pretrained_model(model, lazy, None, load_config)
            info = cls._finalize_model_loading(model, load_config, info)
        except RuntimeError as e:
            raise LoadError(
                f"transformers could not load the non-expert weights of {checkpoint.path}: {e}"
            ) from e
    missing = sorted(info.missing_keys)
    if missing:
        raise LoadError(
            f"checkpoint {checkpoint.path} lacks {len(missing)} non-expert tensor(s) the model needs: "
            f"{listing(missing, inline=True)}"
        )
    if info.unexpected_keys:
        logger.warning(
            "moetune: %d checkpoint tensor(s) of %s are not used by %s: %s",
            len(info.unexpected_keys),
            checkpoint.path,
            cls.__name__,
            listing(sorted(info.unexpected_keys), inline=True),
        )


def finish(model: PreTrainedModel, checkpoint: Checkpoint) -> None:
    """What ``from_pretrained`` ends with: eval mode, no hub kernels, the checkpoint's generation config."""
    model.eval()
    model.set_use_kernels(False)
    if model.can_generate() and (Path(checkpoint.path) / "generation_config.json").is_file():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(checkpoint.path))
