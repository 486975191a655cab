"""MXFP4 checkpoints (gpt-oss's release): what ``quantization_config`` says, which tensor scales which, and
reading a layer's experts as shipped into ``Mxfp4Experts``.

openai/gpt-oss-20b and -120b declare ``quantization_config: {quant_method: mxfp4, modules_to_not_convert:
[model.layers.*.self_attn, model.layers.*.mlp.router, model.embed_tokens, lm_head]}`` and store, per layer::

    mlp.experts.gate_up_proj_blocks  U8  [E, 2I, H/32, 16]   gate_up_proj_scales  U8  [E, 2I, H/32]
    mlp.experts.down_proj_blocks     U8  [E, H, I/32, 16]    down_proj_scales     U8  [E, H, I/32]
    mlp.experts.gate_up_proj_bias    BF16 [E, 2I]             down_proj_bias       BF16 [E, H]

and every other tensor in bf16. transformers 5.24 dequantizes them on a CPU with ``convert_moe_packed_tensors``:
``value = FP4[nibble] * 2^(scale - 127)``, the low nibble of byte ``j`` being element ``2j``, then
``[E, O, D/32, 16] -> [E, O, D] -> transpose -> [E, D, O]``, i.e. the blocks hold each matrix as ``[out, in]``
(the engine's orientation) and the run-time ``GptOssExperts`` tensors are their transposes. gate_up's 2I rows
keep the run-time interleaving (gate at even rows, up at odd), as its bias does; ``loading.stream.read_mxfp4`` moves the
rows (bytes and scales alike) into the engine's gate-rows-first order, and nothing is dequantized.

A blocks tensor pairs with the ``_scales`` tensor of the same stem (``mxfp4_scales``, from the headers);
``expert_plan`` then places each pair in its experts module and checks the shapes (``blocks_shape``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moetune.arch.detect import DOWN, GATE_UP, ExpertsLayout
from moetune.engine.formats.mxfp4 import BLOCK
from moetune.errors import LoadError
from moetune.loading.checkpoint import Checkpoint, TensorInfo

METHOD = "mxfp4"
MODEL_TYPES = (
    "gpt_oss",
)  # transformers 5.24 reads MXFP4 into GptOssExperts only (replace_with_mxfp4_linear)
CONFIG_FIELDS = ("quant_method", "modules_to_not_convert", "dequantize")  # Mxfp4Config's fields
PACKED_DTYPE = "U8"  # safetensors' code for uint8: blocks and scales
BLOCKS, SCALES = "_blocks", "_scales"
BLOCK_BYTES = BLOCK // 2  # 32 e2m1 codes per block, two per byte
MAX_LISTED = 12


@dataclass(frozen=True)
class Mxfp4Quantization:
    """An MXFP4 checkpoint's ``quantization_config``, validated. ``modules_to_not_convert`` is what the config
    says; which experts are MXFP4 is read off the tensors themselves (their dtype and ``_blocks`` name)."""

    modules_to_not_convert: tuple[str, ...] = ()


def mxfp4_quantization(checkpoint: Checkpoint) -> Mxfp4Quantization | None:
    """The checkpoint's MXFP4 quantization, or None unless ``quant_method`` is ``mxfp4``.

    ``LoadError`` naming the field, its value and what is supported, before any weight is read, for MXFP4
    configs moetune cannot hold as shipped: a model type whose experts transformers does not read as MXFP4,
    fields other than Mxfp4Config's, a ``modules_to_not_convert`` that is not a list of names. ``dequantize``
    (a transformers loading switch) is accepted and changes nothing: the engine's dequantized numbers are
    the checkpoint's exactly (``expert_format="bf16"`` asks for dense experts).
    """
    quant = checkpoint.config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != METHOD:
        return None
    where = f"{checkpoint.path}/config.json quantization_config"
    if checkpoint.model_type not in MODEL_TYPES:
        raise LoadError(
            f"{where}.quant_method is {METHOD!r} but model_type is {checkpoint.model_type!r}; moetune (like "
            f"transformers) reads MXFP4 experts for model_type {', '.join(MODEL_TYPES)} only"
        )
    unknown = sorted(set(quant) - set(CONFIG_FIELDS))
    if unknown:
        raise LoadError(
            f"{where} has field(s) {unknown} ({', '.join(f'{k}={quant[k]!r}' for k in unknown)}); an MXFP4 config "
            f"has {', '.join(CONFIG_FIELDS)} only, and moetune cannot tell how the others change the stored "
            "weights. Remove them if they do not."
        )
    skip = quant.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise LoadError(f"{where}.modules_to_not_convert is {skip!r}; it must be a list of module names")
    if not isinstance(quant.get("dequantize", False), bool):
        raise LoadError(f"{where}.dequantize is {quant['dequantize']!r}; it must be true or false")
    return Mxfp4Quantization(tuple(skip))


def mxfp4_scales(checkpoint: Checkpoint, quantization: Mxfp4Quantization | None) -> dict[str, TensorInfo]:
    """Each MXFP4 blocks key (``<stem>_blocks``, uint8 ``[..., G, 16]``) -> its ``<stem>_scales`` (uint8
    ``[..., G]``), checked from the headers.

    ``LoadError`` listing every problem with file and key: blocks without scales or the other way round,
    either not uint8, shapes that do not pair, or MXFP4 tensors in a checkpoint whose config does not
    declare ``quant_method: mxfp4``.
    """
    tensors = checkpoint.tensors
    problems: list[str] = []
    pairs: dict[str, TensorInfo] = {}
    for key, info in tensors.items():
        if key.endswith(SCALES) and info.dtype == PACKED_DTYPE:
            if key.removesuffix(SCALES) + BLOCKS not in tensors:
                problems.append(
                    f"{info.file}: {key} scales {key.removesuffix(SCALES) + BLOCKS}, which no shard holds"
                )
            continue
        if not key.endswith(BLOCKS) or (info.dtype != PACKED_DTYPE and quantization is None):
            continue
        scale = tensors.get(key.removesuffix(BLOCKS) + SCALES)
        if quantization is None:
            problems.append(
                f"{info.file}: {key} is an MXFP4 blocks tensor, but config.json has no quantization_config "
                f"(MXFP4 checkpoints declare quant_method: {METHOD})"
            )
        elif info.dtype != PACKED_DTYPE or len(info.shape) < 2 or info.shape[-1] != BLOCK_BYTES:
            problems.append(
                f"{info.file}: {key} is {info.dtype} {info.shape}; MXFP4 blocks are {PACKED_DTYPE} [..., G, "
                f"{BLOCK_BYTES}] ({BLOCK} e2m1 codes, two per byte, per block)"
            )
        elif scale is None:
            problems.append(
                f"{info.file}: MXFP4 blocks {key} have no {key.removesuffix(BLOCKS) + SCALES} in any shard"
            )
        elif scale.dtype != PACKED_DTYPE or scale.shape != info.shape[:-1]:
            problems.append(
                f"{scale.file}: {scale.key} is {scale.dtype} {scale.shape}; the scales of {key} {info.shape} must "
                f"be {PACKED_DTYPE} {info.shape[:-1]} (one e8m0 byte per block)"
            )
        else:
            pairs[key] = scale
    if problems:
        shown = "\n  ".join(problems[:MAX_LISTED])
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise LoadError(
            f"checkpoint {checkpoint.path}: {len(problems)} problem(s) with MXFP4 blocks or their scales:\n  "
            f"{shown}{more}"
        )
    return pairs


def blocks_shape(layout: ExpertsLayout, name: str) -> tuple[int, ...] | str:
    """The blocks shape of fused tensor ``name`` (``gate_up_proj`` or ``down_proj``) for experts of
    ``layout``: ``[E, 2I, H/32, 16]`` / ``[E, H, I/32, 16]``; or why such experts cannot hold MXFP4 blocks."""
    e, h, i = layout.num_experts, layout.hidden_size, layout.intermediate_size
    if not layout.transposed:
        return (
            "MXFP4 blocks are the transpose of the run-time tensor (gpt-oss's x @ W experts); these experts "
            "are stored W x, which no MXFP4 checkpoint transformers reads has"
        )
    out, inp = (2 * i, h) if name == GATE_UP else (h, i)
    if inp % BLOCK:
        return f"its input size {inp} is not a multiple of {BLOCK} (H = {h}, I = {i})"
    return (e, out, inp // BLOCK, BLOCK_BYTES)


def is_blocks(info: TensorInfo, scales: dict[str, TensorInfo]) -> bool:
    """``info`` is an MXFP4 blocks tensor paired with its scales by ``mxfp4_scales``."""
    return info.dtype == PACKED_DTYPE and info.key in scales


def fused_name(renamed: str, attr: str) -> str | None:
    """``gate_up_proj`` / ``down_proj`` for a blocks key ending ``<attr>.<name>_blocks``, else None."""
    m = re.search(rf"(?:^|\.){re.escape(attr)}\.(\w+){BLOCKS}$", renamed)
    return m.group(1) if m is not None and m.group(1) in (GATE_UP, DOWN) else None
