"""Checkpoints -> a transformers model whose routed experts stream into CPU engines.

``load_model`` (in ``load``) orchestrates; ``checkpoint`` reads safetensors headers, ``quant`` reads
quantized checkpoints (one file per ``quant_method``), ``model_types`` maps checkpoint model types
transformers lacks (``kimi_k2``) onto its own, ``expert_plan`` decides which tensors feed which experts
module, ``stream`` fills the engines, ``hf`` is the seam with transformers' own loader, ``options`` parses
the call's keyword arguments. ``convert`` plans a checkpoint the same way and writes its routed experts as a
pre-quantized store; the store itself (files, manifest, memory-mapped reading, engines over it in RAM or
paged from disk) is ``moetune.store``, which this package imports and which never imports it.
"""

from moetune.loading.load import load_model
from moetune.loading.options import LoadOptions

__all__ = ["LoadOptions", "load_model"]
