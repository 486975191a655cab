"""moetune: fine-tune very large Mixture-of-Experts models on one workstation.

The data flow, and the package folders that follow it::

    config/   YAML (LLaMA-Factory keys) -> typed, validated options
       |
    arch/     model type / module shapes -> ArchSpec (routing family, expert layout)
       |
    engine/   CPU routed-expert forward/backward over any weight format, expert LoRA (no torch.nn)
       |
    layer/    autograd Function + CpuExperts module that takes an MoE block's experts' place
       |
    store/    pre-quantized expert stores (moetune convert's output), RAM or disk residency
       |
    loading/  checkpoints (float, FP8, compressed INT4, MXFP4) -> a transformers model whose experts stream
       |      into engines
    adapters/ PEFT on linears + expert LoRA as a PEFT layer; ``moetune.load_model(..., adapter=)``
       |
    train/    the ``moetune train`` recipe;  export/  adapters in the layout serving engines load
       |
    cli/      the ``moetune`` command

Importing moetune is cheap: it initialises no CUDA and compiles nothing; ``load_model`` and
``LoadOptions`` import torch and transformers on first use. docs/architecture.md names each package's job.
"""

from typing import Any

from moetune.errors import MoetuneError

__version__ = "0.1.0"
__all__ = [
    "LoadOptions",
    "MoetuneError",
    "__version__",
    "attach_lora",
    "export_serving_adapter",
    "load_adapter",
    "load_model",
    "save_adapter",
]

_LAZY = {
    "load_model": "moetune.adapters.load",  # loading, plus an adapter when asked
    "LoadOptions": "moetune.loading",
    "attach_lora": "moetune.adapters",
    "export_serving_adapter": "moetune.export",
    "load_adapter": "moetune.adapters",
    "save_adapter": "moetune.adapters",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moetune' has no attribute {name!r}")
