"""The LoRA-experts keys (``lora_experts``, ``lora_expert_intermediate_size``): their other spellings, and the
rules between them and the rest of the config.

KTransformers' ``KTConfig`` (``kt_use_lora_experts`` + ``kt_lora_expert_num`` + ``kt_lora_expert_intermediate_size``,
top level or in ``kt_config:``) and LLaMA-Factory's KTransformers branch (``use_lora_expert`` + ``lora_expert_num``
+ ``lora_expert_intermediate_size``) ask for the same thing as moetune's ``lora_experts: N`` (the definition:
``moetune.adapters.lora_experts``), so they are read as it, each mapping logged. A count without its switch
set to true, a switch without a count, or two spellings with different values are errors.
"""

from __future__ import annotations

import logging
from typing import Any

from moetune.config.fields import Problems

log = logging.getLogger(__name__)

KT_KEYS = ("kt_use_lora_experts", "kt_lora_expert_num", "kt_lora_expert_intermediate_size")
# (switch, count, size) per spelling; None: the size key is moetune's own
_SPELLINGS: tuple[tuple[str, str, str | None], ...] = (
    ("use_lora_expert", "lora_expert_num", None),  # LLaMA-Factory's KTransformers branch
    KT_KEYS,  # KTransformers' KTConfig
)
_COUNT, _SIZE = "lora_experts", "lora_expert_intermediate_size"


def translate_lora_expert_keys(flat: dict[str, Any], problems: Problems) -> None:
    """Replace the other spellings in ``flat`` (the top-level keys, KTransformers' nested ones already lifted)
    by ``lora_experts`` / ``lora_expert_intermediate_size``, reporting inconsistent ones."""
    for switch, count, size in _SPELLINGS:
        on, n = flat.pop(switch, None), flat.pop(count, None)
        width = flat.pop(size, None) if size is not None else None
        if on not in (None, True, False):
            problems.add(switch, f"got {on!r}; expected true or false")
            continue
        if not on:
            for key, value in ((count, n), (size, width)):
                if value is not None and key is not None:
                    problems.add(key, f"is set but {switch} is not true; set {switch}: true, or remove {key}")
            if on is False and n is None and width is None:
                log.warning("%s: false accepted: it asks for no LoRA experts", switch)
            continue
        if n is None:
            problems.add(switch, f"is true but {count} (how many LoRA experts) is not set; set it")
            continue
        _put(flat, _COUNT, n, count, problems)
        if width is not None and size is not None:
            _put(flat, _SIZE, width, size, problems)


def _put(flat: dict[str, Any], key: str, value: Any, source: str, problems: Problems) -> None:
    if key in flat and flat[key] != value:
        problems.add(source, f"is read as {key}: {value!r}, but {key} is already {flat[key]!r}; set it once")
        return
    flat[key] = value
    log.warning("%s: %r read as moetune's %s: %r", source, value, key, value)


def check_lora_expert_keys(finetune: Any, method: str, problems: Problems) -> None:
    """``lora_experts`` and ``lora_expert_intermediate_size`` go together, with ``finetuning_type: lora`` (they are
    part of the adapter; every stage takes them, dpo/kto's reference pass switching them off with the adapter)."""
    count, size = finetune.lora_experts, finetune.lora_expert_intermediate_size
    if problems.has(_COUNT, _SIZE) or (count is None and size is None):
        return
    if count is None:
        problems.add(_SIZE, "is set but lora_experts is not; set lora_experts: N (N >= 1) or remove it")
    elif size is None:
        problems.add(
            _COUNT, f"is {count} but lora_expert_intermediate_size (each LoRA expert's width) is not set"
        )
    elif method != "lora":
        problems.add(
            _COUNT, f"adds LoRA experts, which need finetuning_type: lora (it is {method}); remove it"
        )
