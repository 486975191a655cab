"""MXFP4 checkpoints (gpt-oss's release): routed experts stored fused, as e2m1 blocks with e8m0 scales.

openai/gpt-oss-20b and -120b declare ``quantization_config: {quant_method: mxfp4, modules_to_not_convert:
[model.layers.*.self_attn, model.layers.*.mlp.router, model.embed_tokens, lm_head]}`` and store, per layer::

    mlp.experts.gate_up_proj_blocks  U8  [E, 2I, H/32, 16]   gate_up_proj_scales  U8  [E, 2I, H/32]
    mlp.experts.down_proj_blocks     U8  [E, H, I/32, 16]    down_proj_scales     U8  [E, H, I/32]
    mlp.experts.gate_up_proj_bias    BF16 [E, 2I]             down_proj_bias       BF16 [E, H]

and every other tensor in bf16. transformers 5.24 dequantizes them on a CPU with ``convert_moe_packed_tensors``:
``value = FP4[nibble] * 2^(scale - 127)``, the low nibble of byte ``j`` being element ``2j``, then
``[E, O, D/32, 16] -> [E, O, D] -> transpose -> [E, D, O]``, i.e. the blocks hold each matrix as ``[out, in]``
(the engine's orientation) and the run-time ``GptOssExperts`` tensors are their transposes. gate_up's 2I rows
keep the run-time interleaving (gate at even rows, up at odd), as its bias does.

``pair`` matches each ``<stem>_blocks`` with its ``<stem>_scales`` from the headers and shows the pair to the
plan as the fused float tensor ``<stem>`` (``experts.gate_up_proj`` / ``experts.down_proj``) of the shape
transformers' dequantization gives, ``[E, D, O]``: the run-time one. The biases are float tensors and load
as such. ``expert_problem`` checks the blocks against the experts module; ``read_experts`` copies blocks and
scale bytes, one expert slice at a time (only the experts asked for: a rank's share under
``expert_parallel: sharded``), into ``Mxfp4Experts`` (gate_up's rows moved into gate rows, then up rows), never
dequantizing: peak beyond the engine, one expert's blocks. transformers reads MXFP4 for gpt-oss's routed
experts only, and so does moetune (``model_types``, ``experts_only``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moetune.arch.detect import DOWN, GATE_UP, ExpertsLayout, ExpertsSite
from moetune.engine.formats import Mxfp4Experts
from moetune.engine.formats.mxfp4 import BLOCK, FP4_TABLE, SCALE_BIAS, quantize_blocks
from moetune.errors import LoadError
from moetune.loading.checkpoint import Checkpoint, ShardReader, TensorInfo
from moetune.loading.options import ExpertFormatChoice
from moetune.loading.quant.base import QUANT_METHODS, QuantizedWeight, QuantMethod

CONFIG_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")  # Mxfp4Config's fields
PACKED_DTYPE = "U8"  # safetensors' code for uint8: blocks and scales
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK_BYTES = BLOCK // 2  # 32 e2m1 codes per block, two per byte
CODE = "MXFP4"  # the dtype logical weights report
FUSED = (GATE_UP, DOWN)  # the expert tensors MXFP4 checkpoints quantize


@QUANT_METHODS.register("mxfp4")
class Mxfp4Method(QuantMethod):
    """An MXFP4 checkpoint's ``quantization_config``, validated; routed experts held as ``mxfp4``.

    ``modules_to_not_convert`` is what the config says; which tensors are MXFP4 is read off the tensors
    themselves (their ``_blocks`` name).
    """

    name = "mxfp4"
    label = "MXFP4"
    code = CODE
    supported = "mxfp4 (gpt-oss's routed experts: e2m1 with an e8m0 scale per 32 inputs)"
    declaration = "quant_method: mxfp4"
    model_types = ("gpt_oss",)  # transformers 5.24 reads MXFP4 into GptOssExperts only
    experts_only = True
    writes = True

    def __init__(self, modules_to_not_convert: tuple[str, ...]) -> None:
        self.modules_to_not_convert = modules_to_not_convert

    @classmethod
    def from_config(cls, quant: Mapping[str, Any], where: str) -> Mxfp4Method:
        """``LoadError`` for fields other than Mxfp4Config's and a ``modules_to_not_convert`` that is not a list
        of names. ``dequantize`` (a transformers loading switch) is accepted and changes nothing: the engine's
        dequantized numbers are the checkpoint's exactly (``expert_format="bf16"`` asks for dense experts)."""
        unknown = sorted(set(quant) - set(CONFIG_FIELDS))
        if unknown:
            raise LoadError(
                f"{where} has field(s) {unknown} ({', '.join(f'{k}={quant[k]!r}' for k in unknown)}); an MXFP4 "
                f"config has {', '.join(CONFIG_FIELDS)} only, and moetune cannot tell how the others change the "
                "stored weights. Remove them if they do not."
            )
        skip = quant.get("modules_to_not_convert") or []
        if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
            raise LoadError(f"{where}.modules_to_not_convert is {skip!r}; it must be a list of module names")
        if not isinstance(quant.get("dequantize", False), bool):
            raise LoadError(f"{where}.dequantize is {quant['dequantize']!r}; it must be true or false")
        return cls(tuple(skip))

    @classmethod
    def undeclared(cls, checkpoint: Checkpoint) -> list[str]:
        return [
            f"{info.file}: {key} is an MXFP4 blocks tensor"
            for key, info in checkpoint.tensors.items()
            if key.endswith(BLOCKS) and info.dtype == PACKED_DTYPE
        ]

    def pair(self, checkpoint: Checkpoint) -> tuple[dict[str, QuantizedWeight], list[str]]:
        """Each ``<stem>_blocks`` (uint8 ``[E, O, D/32, 16]``) with its ``<stem>_scales`` (uint8
        ``[E, O, D/32]``) as the logical ``<stem>`` ``[E, D, O]``. Problems: scales without blocks; blocks of
        anything but a fused expert tensor, not uint8 ``[E, O, G, 16]``, without scales, or beside a float
        ``<stem>``; scales not uint8 of the blocks' shape less its last dimension."""
        tensors = checkpoint.tensors
        problems = [
            f"{info.file}: {key} scales {key.removesuffix(SCALES) + BLOCKS}, which no shard holds"
            for key, info in tensors.items()
            if key.endswith(SCALES)
            and info.dtype == PACKED_DTYPE
            and key.removesuffix(SCALES) + BLOCKS not in tensors
        ]
        weights: dict[str, QuantizedWeight] = {}
        for key, info in tensors.items():
            if not key.endswith(BLOCKS):
                continue
            stem = key.removesuffix(BLOCKS)
            scale = tensors.get(stem + SCALES)
            if stem.rpartition(".")[2] not in FUSED:
                problems.append(
                    f"{info.file}: {key} is MXFP4 but not part of a routed-experts module's "
                    f"{' or '.join(FUSED)}; moetune (like transformers) reads MXFP4 for routed experts only"
                )
            elif info.dtype != PACKED_DTYPE or len(info.shape) != 4 or info.shape[-1] != BLOCK_BYTES:
                problems.append(
                    f"{info.file}: {key} is {info.dtype} {info.shape}; MXFP4 blocks are {PACKED_DTYPE} [E, out, "
                    f"in/{BLOCK}, {BLOCK_BYTES}] ({BLOCK} e2m1 codes, two per byte, per block)"
                )
            elif scale is None:
                problems.append(f"{info.file}: MXFP4 blocks {key} have no {stem + SCALES} in any shard")
            elif scale.dtype != PACKED_DTYPE or scale.shape != info.shape[:-1]:
                problems.append(
                    f"{scale.file}: {scale.key} is {scale.dtype} {scale.shape}; the scales of {key} {info.shape} "
                    f"must be {PACKED_DTYPE} {info.shape[:-1]} (one e8m0 byte per block)"
                )
            elif stem in tensors:
                problems.append(
                    f"{info.file}: {key}: {stem} is stored too (an expert tensor is either float or MXFP4 blocks)"
                )
            else:
                e, o, g, _ = info.shape
                logical = TensorInfo(
                    stem, info.file, CODE, (e, g * BLOCK, o), info.nbytes + scale.nbytes, info.offset
                )
                weights[stem] = QuantizedWeight(logical, {"blocks": info, "scales": scale})
        return weights, problems

    @property
    def native(self) -> ExpertFormatChoice:
        return ExpertFormatChoice("mxfp4")

    def expert_problem(self, weight: QuantizedWeight, role: str, site: ExpertsSite) -> str | None:
        """The blocks must be ``[E, 2I, H/32, 16]`` (gate_up) or ``[E, H, I/32, 16]`` (down) of experts that
        compute ``x @ W``, whose run-time tensors are the blocks' transposes."""
        blocks, lay = weight.main, site.layout
        where = f"{blocks.file}: unexpected expert tensor {blocks.key} for {site.path}"
        e, h, i = lay.num_experts, lay.hidden_size, lay.intermediate_size
        if role not in FUSED or not lay.transposed:
            return (
                f"{where}: MXFP4 blocks hold the transposes of the fused {' and '.join(FUSED)} of x @ W experts "
                "(gpt-oss's); these experts are not such, and no MXFP4 checkpoint transformers reads has them"
            )
        out, inp = (2 * i, h) if role == GATE_UP else (h, i)
        if inp % BLOCK:
            return f"{where}: its input size {inp} is not a multiple of {BLOCK} (H = {h}, I = {i})"
        want = (e, out, inp // BLOCK, BLOCK_BYTES)
        if blocks.shape != want:
            return (
                f"{where} of shape {blocks.shape}, expected {want} (MXFP4 blocks [E, out, in/{BLOCK}, "
                f"{BLOCK_BYTES}]: each expert's [out, in] matrix, {BLOCK} inputs per block)"
            )
        return None

    def read_experts(
        self,
        weights: Mapping[str, Sequence[QuantizedWeight]],
        layout: ExpertsLayout,
        reader: ShardReader,
        experts: range,
    ) -> Mxfp4Experts:
        """The blocks and scale bytes as shipped, one slice of ``experts`` at a time (the fused tensors' other
        slices are never read), into ``Mxfp4Experts`` of ``e = len(experts)`` experts: gate_up ``[e, 2I, H/2]`` /
        ``[e, 2I, H/32]`` (interleaved rows moved to gate rows, then up rows), down ``[e, H, I/2]`` /
        ``[e, H, I/32]``."""
        e, h, i = len(experts), layout.hidden_size, layout.intermediate_size
        dest = {
            GATE_UP: (
                torch.empty(e, 2 * i, h // 2, dtype=torch.uint8),
                torch.empty(e, 2 * i, h // BLOCK, dtype=torch.uint8),
            ),
            DOWN: (
                torch.empty(e, h, i // 2, dtype=torch.uint8),
                torch.empty(e, h, i // BLOCK, dtype=torch.uint8),
            ),
        }
        for name, targets in dest.items():
            (weight,) = weights[name]
            # expert by expert, its blocks then its scales: reading all blocks first left 1.031x the shipped
            # bytes resident after the load (tests/slow/test_mxfp4_memory.py), this order 1.008x
            for x, expert in enumerate(experts):
                for part, target in zip((weight.parts["blocks"], weight.parts["scales"]), targets):
                    t = reader.read(part, expert).view(target.shape[1:])  # [O, D/2] bytes or [O, D/32] scales
                    if name == GATE_UP and layout.interleaved:
                        target[x, :i], target[x, i:] = t[0::2], t[1::2]
                    else:
                        target[x].copy_(t)
        return Mxfp4Experts(*dest[GATE_UP], *dest[DOWN])

    def dequantize(self, weight: QuantizedWeight, reader: ShardReader) -> torch.Tensor:
        """The fused expert tensor ``[E, D, O]`` in fp32 (a merge's: loading holds the codes as shipped)."""
        return self.dequantize_parts(weight, {role: reader.read(info) for role, info in weight.parts.items()})

    def dequantize_parts(
        self, weight: QuantizedWeight, parts: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """blocks ``[..., O, D/32, 16]`` and scales ``[..., O, D/32]`` (every expert, or one expert's slice) ->
        ``[..., D, O]`` fp32, as transformers dequantizes them: ``FP4[nibble] * 2^(scale - 127)``, the low nibble of
        byte ``j`` element ``2j``, then the last two dimensions swapped (exact: two significant bits times a power
        of two)."""
        blocks, scales = parts["blocks"], parts["scales"]
        values = torch.stack(
            (FP4_TABLE[(blocks & 15).long()], FP4_TABLE[(blocks >> 4).long()]), dim=-1
        )  # [..., O, G, 16, 2]
        values = values.flatten(-3)  # [..., O, D]
        factor = torch.pow(2.0, scales.to(torch.float32) - SCALE_BIAS).repeat_interleave(BLOCK, dim=-1)
        result = (values * factor).transpose(-1, -2)
        return result if out is None else out.copy_(result)

    def quantize(self, weight: QuantizedWeight, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """``w`` ``[..., D, O]`` (every expert, or one expert's slice) as blocks and scales by the OCP MX rule
        (``mxfp4.quantize_blocks``: each block's scale the power of two that brings its largest value under 6,
        values rounded to the nearest e2m1)."""
        lead, (d, o) = w.shape[:-2], w.shape[-2:]
        matrices = w.reshape(-1, d, o)
        blocks = torch.empty(matrices.shape[0], o, d // BLOCK, BLOCK_BYTES, dtype=torch.uint8)
        scales = torch.empty(matrices.shape[0], o, d // BLOCK, dtype=torch.uint8)
        for x, matrix in enumerate(matrices):  # [D, O] -> the stored [O, D]
            quantize_blocks(matrix.t(), blocks[x].view(o, d // 2), scales[x], weight.key)
        return {
            "blocks": blocks.view(*lead, *blocks.shape[1:]),
            "scales": scales.view(*lead, *scales.shape[1:]),
        }
