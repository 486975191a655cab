"""FP8 block-scaled checkpoints in DeepSeek-V3's convention (also Kimi-K2-Instruct, Qwen3-FP8, GLM-4.5-FP8)::

    quantization_config: {quant_method: fp8, weight_block_size: [128, 128],
                          fmt: e4m3, activation_scheme: dynamic}

Every quantized ``Linear`` stores ``<name>.weight`` as float8 e4m3fn ``[O, D]`` and ``<name>.weight_scale_inv``
as fp32 (or bf16/fp16) ``[ceil(O/128), ceil(D/128)]``: ``w[o, d] = fp8[o, d] * scale_inv[o // 128, d // 128]``
(edge blocks partial). ``pair`` matches them from the safetensors headers and reports every missing,
orphaned or misshapen scale before any tensor is read. Routed experts keep their FP8 bytes in the engine
(``Fp8BlockExperts``); every other FP8 weight is dequantized here and handed to transformers' loader as a
plain float tensor.

Why not transformers' own FP8 dequantization (``FineGrainedFP8Config(dequantize=True)``, which 5.24 turns on
by itself without a GPU): its ``Fp8Dequantize`` infers the block size from the scale grid (rows // grid rows),
which is only right when every dimension is a multiple of 128 or below it. A partial edge block raises
(``[320, 256]`` with a ``[3, 2]`` grid) or, worse, silently uses blocks of the wrong size (``[192, 256]``
with a ``[2, 2]`` grid: blocks of 96 rows; measured logits off by 2.5 on a tiny model). Real checkpoints have
such shapes (DeepSeek-V3's ``kv_a_proj_with_mqa`` is ``[576, 7168]``). Here the block is 128 by definition.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moetune.arch.detect import ExpertsLayout
from moetune.engine.formats import Fp8BlockExperts
from moetune.engine.formats.fp8_block import (
    BLOCK,
    decode_rows,
    grid,
    multipliers,
    quantize_blocks,
    scale_blocks,
)
from moetune.engine.formats.quant_common import row_chunks
from moetune.errors import LoadError
from moetune.finite import all_finite
from moetune.loading.checkpoint import Checkpoint, ShardReader
from moetune.loading.options import ExpertFormatChoice
from moetune.loading.quant.base import QUANT_METHODS, ROLES, LazyTensors, QuantizedWeight, QuantMethod
from moetune.tensorfile import TORCH_DTYPES

FP8_DTYPE = "F8_E4M3"  # safetensors' code for float8 e4m3fn
SCALE_SUFFIX = "_scale_inv"  # <name>.weight -> <name>.weight_scale_inv
SCALE_DTYPES = ("F32", "BF16", "F16")  # widened to fp32 exactly (DeepSeek-V3 stores F32)


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """weight ``[O, D]`` float8_e4m3fn, scale_inv ``[ceil(O/128), ceil(D/128)]`` (fp32, bf16 or fp16) -> ``[O, D]``
    fp32 (into ``out`` when given: contiguous fp32 ``[O, D]``).

    fp32 holds every e4m3 value exactly, so each weight is rounded once, by the product with its block's scale.
    By the engine's decoding (``fp8_block.decode_rows``: integer ops and fp16 -> fp32, the same products, the same
    bits) in row blocks instead of torch's scalar e4m3 -> fp32 conversion: ``python bench/fp8_dequant.py`` on one
    Zen 4 thread, 2.3x on ``[2048, 7168]`` (there mostly the page faults of the new output) and 6.7x on
    ``[576, 7168]``. NaN codes, which that decoding would make finite, and multipliers that overflow go through
    torch's conversion, so NaN stays NaN.
    """
    out = torch.empty(weight.shape, dtype=torch.float32) if out is None else out
    assert out.shape == weight.shape and out.dtype == torch.float32 and out.is_contiguous()
    mults = multipliers(scale_inv)
    if not (all_finite(weight) and all_finite(mults)):
        out.copy_(weight)
        scale_blocks(out, scale_inv.to(torch.float32))
        return out
    codes = weight.view(torch.int8)
    for r0, r1 in row_chunks(0, out.shape[0], out.shape[1], BLOCK):
        decode_rows(codes[r0:r1], mults[r0 // BLOCK : -(-r1 // BLOCK)], out[r0:r1])
    return out


@QUANT_METHODS.register("fp8")
class Fp8Method(QuantMethod):
    """An FP8 checkpoint's ``quantization_config``, validated: 128 x 128 block scales, e4m3, dynamic
    activation scales. Routed experts are held as ``fp8_block``."""

    name = "fp8"
    label = "FP8"
    code = FP8_DTYPE
    supported = "fp8 (DeepSeek-V3-style e4m3 with 128 x 128 block scales)"
    declaration = "quant_method: fp8 and weight_block_size: [128, 128]"
    writes = True

    @classmethod
    def from_config(cls, quant: Mapping[str, Any], where: str) -> Fp8Method:
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
        return cls()

    @classmethod
    def undeclared(cls, checkpoint: Checkpoint) -> list[str]:
        return [
            f"{info.file}: {key} is {FP8_DTYPE}"
            for key, info in checkpoint.tensors.items()
            if info.dtype == FP8_DTYPE
        ]

    def pair(self, checkpoint: Checkpoint) -> tuple[dict[str, QuantizedWeight], list[str]]:
        """Each FP8 weight with its ``weight_scale_inv``. Problems: an FP8 tensor without its scale or not
        2-D; a scale without its weight, not F32/BF16/F16, or not of shape ``[ceil(O/128), ceil(D/128)]``."""
        tensors = checkpoint.tensors
        problems: list[str] = []
        pairs: dict[str, QuantizedWeight] = {}
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
                pairs[key] = QuantizedWeight(info, {"weight": info, "scale_inv": scale})
        return pairs, problems

    @property
    def native(self) -> ExpertFormatChoice:
        return ExpertFormatChoice("fp8_block")

    def read_experts(
        self,
        weights: Mapping[str, Sequence[QuantizedWeight]],
        layout: ExpertsLayout,
        reader: ShardReader,
        experts: range,
    ) -> Fp8BlockExperts:
        """gate/up/down ``[out, in]`` e4m3fn per expert (``weights`` holds those of ``experts`` only) with their
        block scales, copied one matrix at a time into ``Fp8BlockExperts``' stacked tensors (bf16/fp16 scales
        widened to fp32: exact)."""

        def codes(w: QuantizedWeight) -> torch.Tensor:
            return reader.read(w.parts["weight"])

        def scale_inv(w: QuantizedWeight) -> torch.Tensor:
            return reader.read(w.parts["scale_inv"]).to(torch.float32)

        lists: dict[str, LazyTensors[QuantizedWeight]] = {}
        for role in ROLES:
            lists[role] = LazyTensors(weights[role], codes)
            lists[f"{role}_scale_inv"] = LazyTensors(weights[role], scale_inv)
        return Fp8BlockExperts.from_per_expert(**lists)

    def dequantize(self, weight: QuantizedWeight, reader: ShardReader) -> torch.Tensor:
        return self.dequantize_parts(weight, {role: reader.read(info) for role, info in weight.parts.items()})

    def dequantize_parts(
        self, weight: QuantizedWeight, parts: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        return dequantize_fp8(parts["weight"], parts["scale_inv"], out)

    def quantize(self, weight: QuantizedWeight, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """e4m3fn codes and 128 x 128 block scales (block max-abs / 448, in the stored scale dtype): each weight
        within half a step of e4m3 of its value, i.e. 2^-4 of it, or 2^-10 of its block's scale_inv below
        e4m3's normal range."""
        codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
        scale_inv = torch.empty(grid(*w.shape), dtype=TORCH_DTYPES[weight.parts["scale_inv"].dtype])
        quantize_blocks(w, codes, scale_inv)
        return {"weight": codes, "scale_inv": scale_inv}
