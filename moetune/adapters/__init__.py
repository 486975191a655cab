"""PEFT-layout save/load of attention and expert LoRA.

``peft_layout`` converts one layer's expert LoRA between the engine layout and stock PEFT's
``target_parameters`` layout (tensor layout, key names, config facts in its docstring); ``expert_layer`` is
the PEFT LoRA layer that holds routed-expert LoRA in that layout around a ``CpuExperts`` (imported on use: it
imports PEFT); ``apply`` attaches LoRA to a loaded model through ``peft.get_peft_model``; ``save`` writes and
reads the whole adapter as one stock PEFT adapter; ``check`` checks a saved adapter folder before any model
weight is read (``check_adapter_folder``); ``swap`` replaces an adapter's config and weights together and
recovers what a killed save left; ``lora_experts`` adds KTransformers-style LoRA experts (dense SwiGLU experts on
the device beside each MoE block) and saves them beside the adapter.
"""

from moetune.adapters.apply import LoraSettings, attach_lora, resolve_targets, to_stock_config
from moetune.adapters.check import check_adapter_folder
from moetune.adapters.lora_experts import attach_lora_experts
from moetune.adapters.peft_layout import (
    PEFT_MODEL_PREFIX,
    ExpertParamNames,
    expert_lora_from_peft_state,
    expert_lora_to_peft_state,
    lora_from_peft,
    lora_to_peft,
)
from moetune.adapters.save import load_adapter, load_adapter_weights, save_adapter

__all__ = [
    "LoraSettings",
    "attach_lora",
    "attach_lora_experts",
    "check_adapter_folder",
    "load_adapter",
    "load_adapter_weights",
    "resolve_targets",
    "save_adapter",
    "to_stock_config",
    "PEFT_MODEL_PREFIX",
    "ExpertParamNames",
    "expert_lora_from_peft_state",
    "expert_lora_to_peft_state",
    "lora_from_peft",
    "lora_to_peft",
]
