"""PEFT-layout save/load of attention and expert LoRA.

``peft_layout`` converts one layer's expert LoRA between the engine layout and stock PEFT's
``target_parameters`` layout (tensor layout, key names, config facts in its docstring).
"""

from moetune.adapters.peft_layout import (
    PEFT_MODEL_PREFIX,
    ExpertParamNames,
    expert_lora_from_peft_state,
    expert_lora_to_peft_state,
    lora_from_peft,
    lora_to_peft,
)

__all__ = [
    "PEFT_MODEL_PREFIX",
    "ExpertParamNames",
    "expert_lora_from_peft_state",
    "expert_lora_to_peft_state",
    "lora_from_peft",
    "lora_to_peft",
]
