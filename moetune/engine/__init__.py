"""CPU expert compute. Imports neither transformers nor ``torch.nn.Module``.

``ExpertEngine`` (``experts``) runs one layer's routed experts forward and backward over any weight format
(``formats``, multiplied block by block in ``gemm``), with expert LoRA (``lora``) and a pluggable gated
activation (``activations``); tokens are sorted by expert in ``routing``. ``plan`` holds the settings and the
per-mode plan resolved from them; ``threads`` sizes the (process-wide) CPU thread count the GEMMs run on
and holds the pool that computes experts in parallel.
"""

from moetune.engine.activations import ACTIVATIONS, GluActivation, get_activation
from moetune.engine.experts import ExpertEngine
from moetune.engine.formats import FORMATS, DenseExperts, ExpertFormat
from moetune.engine.lora import LORA_NAMES, ExpertLoRA, lora_scaling
from moetune.engine.plan import ActivationPolicy, EngineOptions, TrainMode, resolve_compute_dtype
from moetune.engine.saved import ExpertGrads, SavedForward

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
