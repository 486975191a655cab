"""CPU expert compute. Imports neither transformers nor ``torch.nn.Module``.

``ExpertEngine`` runs one layer's routed experts forward and backward over any weight format
(``formats``), with expert LoRA (``lora``) and a pluggable gated activation (``activations``).
"""

from moetune.engine.activations import ACTIVATIONS, GluActivation, get_activation
from moetune.engine.experts import (
    ActivationPolicy,
    EngineOptions,
    ExpertEngine,
    ExpertGrads,
    SavedForward,
    TrainMode,
    resolve_compute_dtype,
)
from moetune.engine.formats import FORMATS, DenseExperts, ExpertFormat
from moetune.engine.lora import LORA_NAMES, ExpertLoRA, lora_scaling

__all__ = [
    "ACTIVATIONS",
    "FORMATS",
    "LORA_NAMES",
    "ActivationPolicy",
    "DenseExperts",
    "EngineOptions",
    "ExpertEngine",
    "ExpertFormat",
    "ExpertGrads",
    "ExpertLoRA",
    "GluActivation",
    "SavedForward",
    "TrainMode",
    "get_activation",
    "lora_scaling",
    "resolve_compute_dtype",
]
