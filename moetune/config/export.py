"""YAML -> :class:`MergeConfig`: LLaMA-Factory's merge config (``llamafactory-cli export``) for ``moetune export``.

LLaMA-Factory merges a LoRA adapter into its base model from a config such as its ``examples/merge_lora``
ones::

    model_name_or_path: Qwen/Qwen3-30B-A3B-Instruct-2507
    adapter_name_or_path: saves/qwen3-30b-a3b/lora/sft
    template: qwen3
    trust_remote_code: true
    export_dir: output/qwen3_lora_sft
    export_size: 5
    export_device: cpu
    export_legacy_format: false

moetune reads the same keys (``moetune.export.merge`` does the merge). ``export_size`` (LLaMA-Factory's shard size
in GB) and ``export_device`` are accepted: the merged checkpoint keeps the base checkpoint's own shards and is
computed on the CPU. ``template``: the chat template travels in the tokenizer files beside the adapter, copied
over the model's. A quantized base is merged in bf16 unless the command line says ``--quantized requantize``. Refused, naming the key: another ``finetuning_type`` (full and freeze runs save whole models,
nothing to merge), ``export_legacy_format: true`` (``.bin`` files), several adapters, quantizing on export and
pushing to the Hub.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.config.fields import Problems, option, parse_section, positive, required, yaml_fields
from moetune.config.load import read_yaml

log = logging.getLogger(__name__)

# LLaMA-Factory keys a merge config may hold that moetune does not do, and why
REFUSED = {
    "export_quantization_bit": "quantizing while exporting (GPTQ) is not supported; the merged checkpoint is in "
    "the base checkpoint's float dtype, a quantized base's in bf16 (or its own format: moetune export "
    "--quantized requantize)",
    "export_quantization_dataset": "quantizing while exporting (GPTQ) is not supported",
    "export_quantization_nsamples": "quantizing while exporting (GPTQ) is not supported",
    "export_quantization_maxlen": "quantizing while exporting (GPTQ) is not supported",
    "export_hub_model_id": "moetune does not upload; push export_dir with huggingface-cli upload",
    "quantization_bit": "merging into a model quantized at load (bitsandbytes) is not supported",
}


def _lora(value: str) -> str | None:
    return (
        None if value == "lora" else "only lora adapters are merged (full and freeze runs save whole models)"
    )


def _device(value: str) -> str | None:
    return None if value in ("cpu", "auto") else "one of: cpu, auto"


def _not_legacy(value: bool) -> str | None:
    return (
        "legacy .bin weights are not written; the merged checkpoint is safetensors (set false)"
        if value
        else None
    )


@dataclass(frozen=True)
class MergeConfig:
    """A LoRA merge: the adapter in ``adapter_name_or_path`` into ``model_name_or_path``, written to ``export_dir``."""

    model_name_or_path: Path = required()
    adapter_name_or_path: Path = required()
    export_dir: Path = required()
    template: str | None = option(None)
    finetuning_type: str = option("lora", check=_lora)
    trust_remote_code: bool = option(False)
    export_size: int = option(5, check=positive)
    export_device: str = option("cpu", check=_device)
    export_legacy_format: bool = option(False, check=_not_legacy)


def load_merge_config(path: str | Path) -> MergeConfig:
    """Read and check a merge config; one ``ConfigError`` lists every problem."""
    path = Path(path)
    raw = read_yaml(path)
    problems = Problems(str(path))
    if not isinstance(raw, dict):
        problems.add("config", f"must be a mapping of keys to values; got {type(raw).__name__}")
        problems.raise_if_any()
    known = yaml_fields(MergeConfig)
    for key in raw:
        if key in REFUSED:
            problems.add(key, REFUSED[key])
        elif key not in known:
            problems.add(key, f"is not a merge config key; the keys are {', '.join(known)}")
    adapters = raw.get("adapter_name_or_path")
    if isinstance(adapters, str) and "," in adapters:
        problems.add("adapter_name_or_path", f"got {adapters!r}; merge one adapter at a time")
    config: MergeConfig = parse_section(MergeConfig, {k: v for k, v in raw.items() if k in known}, problems)
    problems.raise_if_any()
    _notes(raw)
    return config


def _notes(raw: dict[str, Any]) -> None:
    """One warning (shown on the console, as train's notes on keys without effect are) per key accepted with no
    effect on the merge."""
    if "export_size" in raw:
        log.warning(
            "export_size: %r has no effect: the merged checkpoint keeps the base checkpoint's own shards",
            raw["export_size"],
        )
    if raw.get("template"):
        log.warning(
            "template: %r has no effect on the merge: the merged checkpoint's chat template is the one in the "
            "tokenizer files beside the adapter (the one its run trained with), else the model's",
            raw["template"],
        )
