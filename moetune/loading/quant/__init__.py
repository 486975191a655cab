"""Quantized checkpoints: one method per ``quantization_config.quant_method``, each in its own file behind
``QUANT_METHODS`` (the contract is ``base.QuantMethod``)::

    fp8                  fp8.py                 DeepSeek-V3-style e4m3 with 128 x 128 block scales
                                                (DeepSeek-V3, Kimi-K2-Instruct, Qwen3-FP8, GLM-4.5-FP8)
    compressed-tensors   compressed_tensors.py  pack-quantized symmetric INT4 (Kimi-K2-Thinking, K2.5)
    mxfp4                mxfp4.py               e2m1 with e8m0 scales per 32, routed experts fused (gpt-oss)

``checkpoint_quantization`` picks the method and validates its config; ``quantized_weights`` gathers every
quantized weight's stored tensors from the headers. Both run before any tensor is read. Adding a method: a
``QuantMethod`` subclass registered under its ``quant_method`` value in a new file here, imported below.
"""

from __future__ import annotations

from moetune.errors import LoadError
from moetune.loading.checkpoint import Checkpoint
from moetune.loading.quant import compressed_tensors, fp8, mxfp4  # noqa: F401  (each registers its method)
from moetune.loading.quant.base import (
    QUANT_METHODS,
    ROLES,
    Dequantized,
    QuantizedWeight,
    QuantMethod,
    logical_tensors,
    raise_problems,
)

__all__ = [
    "QUANT_METHODS",
    "ROLES",
    "Dequantized",
    "QuantMethod",
    "QuantizedWeight",
    "checkpoint_quantization",
    "logical_tensors",
    "quantized_weights",
]


def supported_methods() -> str:
    """Every registered method and what of it moetune loads, for messages."""
    return "; ".join(QUANT_METHODS.get(name).supported for name in QUANT_METHODS)


def checkpoint_quantization(checkpoint: Checkpoint) -> QuantMethod | None:
    """The checkpoint's quantization method, its config validated (None for a float checkpoint), from config.json's
    ``quantization_config`` or, for a composite model, its ``text_config``'s.

    ``LoadError`` for a ``quant_method`` no method handles (listing the supported ones), on a model type the
    method does not read, and for any field the method cannot hold as shipped: nothing is ever loaded in a
    silently different precision.
    """
    quant, field = checkpoint.config.get("quantization_config"), "quantization_config"
    text = checkpoint.config.get("text_config")
    if not quant and isinstance(text, dict) and text.get("quantization_config"):
        # a composite config (Kimi-K2.5: kimi_k25) declares its language model's quantization there
        quant, field = text["quantization_config"], "text_config.quantization_config"
    if not quant:
        return None
    where = f"{checkpoint.path}/config.json {field}"
    if not isinstance(quant, dict):
        raise LoadError(f"{where} must be a mapping; got {quant!r}")
    method = quant.get("quant_method")
    if not isinstance(method, str) or method not in QUANT_METHODS:
        raise LoadError(
            f"{where}.quant_method is {method!r}; moetune loads quantized checkpoints of quant_method "
            f"{', '.join(QUANT_METHODS.names())} ({supported_methods()}) and float (bf16/fp16/fp32) "
            "checkpoints. Use the model's bf16 release, or convert it to one of those."
        )
    found = QUANT_METHODS.get(method)
    if found.model_types and checkpoint.model_type not in found.model_types:
        raise LoadError(
            f"{where}.quant_method is {method!r} but model_type is {checkpoint.model_type!r}; moetune (like "
            f"transformers) reads {found.label} checkpoints for model_type {', '.join(found.model_types)} only"
        )
    return found.from_config(quant, where)


def quantized_weights(checkpoint: Checkpoint, method: QuantMethod | None) -> dict[str, QuantizedWeight]:
    """Logical key (``<name>.weight``) -> the stored tensors of that quantized weight, from the headers.

    One ``LoadError`` listing every problem: the method's own (missing, orphaned, misshapen parts) and
    tensors of another method than the one config.json declares (or of any, when it declares none).
    """
    said = (
        "config.json has no quantization_config"
        if method is None
        else f"config.json declares quant_method {method.name!r}"
    )
    problems: list[str] = []
    for name in QUANT_METHODS:
        other = QUANT_METHODS.get(name)
        if method is None or name != method.name:
            problems += [
                f"{found}, but {said} ({other.label} checkpoints declare {other.declaration})"
                for found in other.undeclared(checkpoint)
            ]
    weights: dict[str, QuantizedWeight] = {}
    if method is not None:
        weights, own = method.pair(checkpoint)
        problems += own
    raise_problems(checkpoint, "quantized" if method is None else method.label, problems)
    return weights
