"""Quantized checkpoints: what ``quantization_config`` says, which tensor scales which, and FP8 dequantization.

Supported: FP8 block-scaled checkpoints in DeepSeek-V3's convention (also Qwen3-FP8, GLM-4.5-FP8)::

    quantization_config: {quant_method: fp8, weight_block_size: [128, 128],
                          fmt: e4m3, activation_scheme: dynamic}

Every quantized ``Linear`` stores ``<name>.weight`` as float8 e4m3fn ``[O, D]`` and ``<name>.weight_scale_inv``
as fp32 (or bf16/fp16) ``[ceil(O/128), ceil(D/128)]``: ``w[o, d] = fp8[o, d] * scale_inv[o // 128, d // 128]`` (edge blocks
partial). ``fp8_scales`` pairs them from the safetensors headers and reports every missing, orphaned or
misshapen scale before any tensor is read. Routed experts keep their FP8 bytes in the engine
(``Fp8BlockExperts``); every other FP8 weight is dequantized here (``Fp8Dequantized``) and handed to
transformers' loader as a plain float tensor.

Why not transformers' own FP8 dequantization (``FineGrainedFP8Config(dequantize=True)``, which 5.24 turns on
by itself without a GPU): its ``Fp8Dequantize`` infers the block size from the scale grid (rows // grid rows),
which is only right when every dimension is a multiple of 128 or below it. A partial edge block raises
(``[320, 256]`` with a ``[3, 2]`` grid) or, worse, silently uses blocks of the wrong size (``[192, 256]``
with a ``[2, 2]`` grid: blocks of 96 rows; measured logits off by 2.5 on a tiny model). Real checkpoints have
such shapes (DeepSeek-V3's ``kv_a_proj_with_mqa`` is ``[576, 7168]``). Here the block is 128 by definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moetune.engine.formats.fp8_block import BLOCK, grid
from moetune.errors import LoadError
from moetune.loading.checkpoint import Checkpoint, TensorInfo
from moetune.loading.mxfp4 import METHOD as MXFP4_METHOD

FP8_DTYPE = "F8_E4M3"  # safetensors' code for float8 e4m3fn
SCALE_SUFFIX = "_scale_inv"  # <name>.weight -> <name>.weight_scale_inv
SCALE_DTYPES = ("F32", "BF16", "F16")  # widened to fp32 exactly (DeepSeek-V3 stores F32)
SUPPORTED_METHODS = ("fp8",)
MAX_LISTED = 12  # problems listed in one error


@dataclass(frozen=True)
class Fp8Quantization:
    """An FP8 checkpoint's ``quantization_config``, validated: 128 x 128 block scales, e4m3, dynamic
    activation scales."""

    block: tuple[int, int] = (BLOCK, BLOCK)


def checkpoint_quantization(checkpoint: Checkpoint) -> Fp8Quantization | None:
    """The checkpoint's quantization (None for a float checkpoint); ``LoadError`` naming any field moetune
    cannot load: another ``quant_method``, block size or FP8 encoding, static activation scales."""
    quant = checkpoint.config.get("quantization_config")
    if not quant:
        return None
    where = f"{checkpoint.path}/config.json quantization_config"
    if not isinstance(quant, dict):
        raise LoadError(f"{where} must be a mapping; got {quant!r}")
    method = quant.get("quant_method")
    if method == MXFP4_METHOD:  # gpt-oss's experts: read by loading.mxfp4
        return None
    if method not in SUPPORTED_METHODS:
        raise LoadError(
            f"{where}.quant_method is {method!r}; moetune loads quantized checkpoints of quant_method "
            f"{', '.join(SUPPORTED_METHODS)} (DeepSeek-V3-style FP8 with 128 x 128 block scales), "
            f"{MXFP4_METHOD} (gpt-oss's MXFP4 experts) and float (bf16/fp16/fp32) checkpoints. Use the model's "
            "bf16 release, or convert it to one of those."
        )
    checks: dict[str, tuple[Any, tuple[Any, ...]]] = {
        "weight_block_size": (quant.get("weight_block_size"), ([BLOCK, BLOCK], (BLOCK, BLOCK))),
        "fmt": (quant.get("fmt", "e4m3"), ("e4m3", "float8_e4m3fn")),
        "activation_scheme": (quant.get("activation_scheme", "dynamic"), ("dynamic",)),
    }
    for name, (value, allowed) in checks.items():
        if value not in allowed:
            raise LoadError(
                f"{where}.{name} is {value!r}; moetune's FP8 loader reads {name} {allowed[0]!r} only "
                "(DeepSeek-V3's convention: e4m3 weights, 128 x 128 weight_scale_inv, dynamic activations)"
            )
    return Fp8Quantization()


def fp8_scales(checkpoint: Checkpoint, quantization: Fp8Quantization | None) -> dict[str, TensorInfo]:
    """Each FP8 weight key -> its ``weight_scale_inv`` tensor, checked from the headers.

    ``LoadError`` listing every problem with file and key: an FP8 tensor without its scale, in a checkpoint
    without an FP8 ``quantization_config``, or not 2-D; a scale without its weight, not F32/BF16/F16, or not
    of shape ``[ceil(O/128), ceil(D/128)]``.
    """
    tensors = checkpoint.tensors
    problems: list[str] = []
    pairs: dict[str, TensorInfo] = {}
    for key, info in tensors.items():
        if key.endswith(SCALE_SUFFIX):
            weight = tensors.get(key.removesuffix(SCALE_SUFFIX))
            if weight is None:
                problems.append(
                    f"{info.file}: {key} scales {key.removesuffix(SCALE_SUFFIX)}, which no shard holds"
                )
            elif weight.dtype != FP8_DTYPE:
                problems.append(
                    f"{info.file}: {key} scales {weight.key}, which is {weight.dtype}, not {FP8_DTYPE}"
                )
            continue
        if info.dtype != FP8_DTYPE:
            continue
        if quantization is None:
            problems.append(
                f"{info.file}: {key} is {FP8_DTYPE}, but config.json has no quantization_config "
                "(FP8 checkpoints declare quant_method: fp8 and weight_block_size: [128, 128])"
            )
            continue
        scale = tensors.get(key + SCALE_SUFFIX)
        if len(info.shape) != 2:
            problems.append(
                f"{info.file}: {key} is a {len(info.shape)}-D FP8 tensor; block scales need [out, in]"
            )
        elif scale is None:
            problems.append(
                f"{info.file}: FP8 weight {key} has no {key + SCALE_SUFFIX} in any shard "
                "(every FP8 weight needs its fp32 block scales)"
            )
        elif scale.dtype not in SCALE_DTYPES or scale.shape != grid(*info.shape):
            problems.append(
                f"{scale.file}: {scale.key} is {scale.dtype} {scale.shape}; the scales of {key} {info.shape} "
                f"must be {'/'.join(SCALE_DTYPES)} {grid(*info.shape)} (one per 128 x 128 block, "
                "ceil(out/128) x ceil(in/128))"
            )
        else:
            pairs[key] = scale
    if problems:
        shown = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise LoadError(
            f"checkpoint {checkpoint.path}: {len(problems)} problem(s) with FP8 weights or their scales:\n  "
            f"{shown}{more}"
        )
    return pairs


def dequantize_fp8(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """weight ``[O, D]`` float8_e4m3fn, scale_inv ``[ceil(O/128), ceil(D/128)]`` fp32 -> ``[O, D]`` fp32.

    fp32 holds every e4m3 value exactly, so each weight is rounded once, by the product with its block's scale.
    """
    out = weight.to(torch.float32)
    cols = scale_inv.to(torch.float32).repeat_interleave(BLOCK, dim=1)[:, : out.shape[1]]  # [ceil(O/128), D]
    for a in range(cols.shape[0]):  # one 128-row block at a time: no [O, D] scale temporary
        out[a * BLOCK : (a + 1) * BLOCK].mul_(cols[a])
    return out


class Fp8Dequantized:
    """Stands in for a lazy safetensors slice of an FP8 weight: indexing reads the weight and its block scales
    and returns the dequantized fp32 tensor, which transformers' loader then casts to the load dtype."""

    def __init__(self, weight: Any, scale_inv: Any) -> None:
        self.weight, self.scale_inv = weight, scale_inv  # safetensors slices, read on demand

    def __getitem__(self, index: Any) -> torch.Tensor:
        return dequantize_fp8(self.weight[...], self.scale_inv[...])[index]
