"""compressed-tensors ``pack-quantized`` INT4 checkpoints: Kimi-K2-Thinking, Kimi-K2.5, llm-compressor's W4A16::

    quantization_config:
      quant_method: compressed-tensors
      format: pack-quantized
      quantization_status: compressed
      config_groups:
        group_0: {targets: [Linear], input_activations: null, output_activations: null,
                  weights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32,
                            actorder: null, dynamic: false, block_structure: null, observer: minmax}}
      ignore: [lm_head, "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
      kv_cache_scheme: null

Each quantized ``Linear`` ``[O, D]`` is stored as compressed-tensors' ``PackedQuantizationCompressor`` writes it::

    <name>.weight_packed  int32 [O, D/8]   signed codes q in [-8, 7] stored as u = q + 8, eight per int32
                                           along the input dimension, code i of a word in bits 4i..4i+3
    <name>.weight_scale   bf16  [O, D/g]   one scale per g consecutive inputs
    <name>.weight_shape   int32 [2]        [O, D]

with ``w[o, d] = q[o, d] * s[o, d // g]``. Its ``ignore`` modules (Kimi: attention, shared experts, dense MLPs,
lm_head) stay bf16 ``<name>.weight`` tensors and load as any float weight.

That is moetune's symmetric ``int4`` format exactly: codes ``u`` with the zero point 8 and bf16 group scales,
``w = (u - 8) * s`` (``engine/formats/int4.py``). Only the nibble order differs: read as little-endian bytes,
byte ``j`` of a row here holds codes ``2j`` and ``2j + 1``; in ``int4`` it holds codes ``j`` and ``j + D/2``
so that unpacking writes two contiguous halves. ``read_experts`` therefore re-packs the nibbles of one expert
matrix at a time (``repack``: byte operations, no codes unpacked) and ``Int4Experts.from_per_expert`` copies
them and the scales, as they are, into the stacked layout: exact, no float in between, one expert matrix as
the only temporary, and the engine holds the bytes the checkpoint ships (less the 8-byte ``weight_shape``
per matrix). Every other
quantized weight (none in Kimi's releases) is dequantized to fp32 here, ``q * s`` exactly, and loads as a
float weight.

Refused in ``from_config``, before any tensor is read, naming the field, its value and what is supported:
another ``format`` (``int-quantized``, ``float-quantized``, ``marlin-24``, ``nvfp4-pack-quantized`` ...), a
bit width other than 4, ``type: float``, asymmetric groups (zero points), activation order (``actorder``),
a group size ``int4`` does not have (32, 64, 128) or another ``strategy``, dynamic weights, quantized
activations, a sparsity or transform config (rotations), a KV-cache scheme, a status other than
``compressed``. The tensors are checked against the config in ``pair``, from the headers.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from moetune.arch.detect import ExpertsLayout, ExpertsSite
from moetune.engine.formats import Int4Experts
from moetune.engine.formats.int4 import GROUP_SIZES, SYMMETRIC_ZERO, quantize_groups
from moetune.errors import LoadError
from moetune.loading.checkpoint import Checkpoint, ShardReader, TensorInfo
from moetune.loading.options import ExpertFormatChoice
from moetune.loading.quant.base import QUANT_METHODS, ROLES, LazyTensors, QuantizedWeight, QuantMethod
from moetune.tensorfile import TORCH_DTYPES

FORMAT = "pack-quantized"
STATUS = "compressed"
CODES_PER_WORD = 8  # 4-bit codes per int32
REPACK_ROWS = 32  # rows re-packed at a time: 32 x 7168 / 4 bytes per temporary stays in L2
PACKED, SCALE, SHAPE = ".weight_packed", ".weight_scale", ".weight_shape"
ZERO_POINT, G_IDX = ".weight_zero_point", ".weight_g_idx"  # asymmetric / activation-ordered checkpoints
SCALE_DTYPES = ("BF16", "F16", "F32")  # dequantized in fp32 (routed experts: BF16 only, int4 holds bf16)
SHAPE_DTYPES = ("I32", "I64")
CODE = "I4_PACKED"  # the dtype logical weights report
SCHEME = (
    "symmetric int4 weights in groups of 32, 64 or 128 inputs, pack-quantized, no activation order, "
    "weight-only (Kimi-K2-Thinking's scheme)"
)
# weights field -> (allowed values, value when absent); num_bits and group_size are required
WEIGHT_FIELDS: dict[str, tuple[tuple[Any, ...], Any]] = {
    "num_bits": ((4,), None),
    "type": (("int",), "int"),
    "symmetric": ((True,), True),
    "strategy": (("group",), "group"),
    "group_size": (GROUP_SIZES, None),
    "actorder": ((None, False), None),
    "dynamic": ((False,), False),
    "block_structure": ((None,), None),
}
# top-level fields that must be empty: each would change what the stored tensors mean
EMPTY_FIELDS = ("sparsity_config", "transform_config", "kv_cache_scheme")


def _same(value: Any, allowed: tuple[Any, ...]) -> bool:
    """``value`` is one of ``allowed`` with the same type (so ``1`` is not ``True``)."""
    return any(value == a and type(value) is type(a) for a in allowed)


def _refuse(field: str, value: Any, allowed: Sequence[Any]) -> LoadError:
    return LoadError(
        f"{field} is {value!r}; moetune holds compressed-tensors checkpoints as shipped only with "
        f"{field.rpartition('.')[2]} {' or '.join(repr(a) for a in allowed)} ({SCHEME})"
    )


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """packed ``[O, D/8]`` int32 -> codes ``u`` ``[O, D]`` uint8 in [0, 15] (code ``i`` of each word from bits
    ``4i..4i+3``, i.e. each little-endian byte's low nibble, then its high nibble)."""
    o, words = packed.shape
    b = packed.contiguous().view(torch.uint8)  # [O, D/2]: little-endian words (checked in from_config)
    return torch.stack((b & 0x0F, b >> 4), dim=-1).view(o, words * CODES_PER_WORD)


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """codes ``u`` ``[O, D]`` uint8 in [0, 15] -> packed ``[O, D/8]`` int32 (the inverse of :func:`unpack_codes`)."""
    o, d = codes.shape
    return (codes[:, 0::2] | codes[:, 1::2] << 4).contiguous().view(torch.int32).view(o, d // CODES_PER_WORD)


def repack(packed: torch.Tensor) -> torch.Tensor:
    """packed ``[O, D/8]`` int32 -> ``[O, D/2]`` uint8 in the ``int4`` format's packing (byte ``j``: codes ``j``
    and ``j + D/2``), bit for bit the same codes.

    With ``A`` the first and ``B`` the second half of a row's bytes (``D/4`` each; byte ``k`` of ``A`` holds
    codes ``2k``, ``2k + 1``, of ``B`` codes ``D/2 + 2k``, ``D/2 + 2k + 1``), output byte ``2k`` is
    ``A[k] & 0xF | B[k] << 4`` and byte ``2k + 1`` is ``A[k] >> 4 | B[k] & 0xF0``: two byte ops per output
    byte, no unpacked codes. ``REPACK_ROWS`` rows at a time keep the temporaries in cache (measured 6 ms for
    a [2048, 7168] matrix on one core, against 28 ms unpacking to codes and packing them again).
    """
    o, words = packed.shape
    b = packed.contiguous().view(torch.uint8)  # [O, D/2]: little-endian words (checked in from_config)
    q = words * CODES_PER_WORD // 4  # D/4
    out = torch.empty(o, q, 2, dtype=torch.uint8)
    for r in range(0, o, REPACK_ROWS):
        a, b2 = b[r : r + REPACK_ROWS, :q], b[r : r + REPACK_ROWS, q:]
        torch.bitwise_or(a & 0x0F, b2 << 4, out=out[r : r + REPACK_ROWS, :, 0])
        torch.bitwise_or(a >> 4, b2 & 0xF0, out=out[r : r + REPACK_ROWS, :, 1])
    return out.view(o, 2 * q)


@QUANT_METHODS.register("compressed-tensors")
class CompressedInt4(QuantMethod):
    """A compressed-tensors ``pack-quantized`` symmetric INT4 checkpoint; routed experts held as ``int4``
    with the checkpoint's group size."""

    name = "compressed-tensors"
    label = "compressed-tensors INT4"
    code = CODE
    supported = f"compressed-tensors ({FORMAT}: {SCHEME})"
    declaration = f"quant_method: compressed-tensors and format: {FORMAT}"
    writes = True

    def __init__(self, group_size: int, ignore: tuple[str, ...]) -> None:
        self.group_size = group_size  # g
        self.ignore = ignore  # module names, or "re:<pattern>" matched from the start of the name

    @classmethod
    def from_config(cls, quant: Mapping[str, Any], where: str) -> CompressedInt4:
        if sys.byteorder != "little":
            raise LoadError(
                f"{where}: moetune reads compressed-tensors' int32 words on little-endian CPUs only"
            )
        if quant.get("format") != FORMAT:
            raise _refuse(f"{where}.format", quant.get("format"), [FORMAT])
        if quant.get("quantization_status", STATUS) != STATUS:
            raise _refuse(f"{where}.quantization_status", quant.get("quantization_status"), [STATUS])
        for name in EMPTY_FIELDS:
            if quant.get(name):
                raise _refuse(f"{where}.{name}", quant[name], [None])
        groups = quant.get("config_groups")
        if not isinstance(groups, dict) or not groups:
            raise LoadError(
                f"{where}.config_groups is {groups!r}; it must map group names to their schemes ({SCHEME})"
            )
        sizes = {name: cls._check_group(f"{where}.config_groups.{name}", g) for name, g in groups.items()}
        if len(set(sizes.values())) > 1:
            listed = ", ".join(f"{size} ({name})" for name, size in sizes.items())
            raise LoadError(
                f"{where}.config_groups have different group_size values: {listed}; moetune holds one group "
                "size per checkpoint"
            )
        ignore = quant.get("ignore") or []
        if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
            raise LoadError(
                f"{where}.ignore is {ignore!r}; it must be a list of module names or 're:' patterns"
            )
        for pattern in ignore:
            if pattern.startswith("re:"):
                try:
                    re.compile(pattern.removeprefix("re:"))
                except re.error as e:
                    raise LoadError(
                        f"{where}.ignore entry {pattern!r} is not a valid regular expression: {e}"
                    ) from e
        return cls(next(iter(sizes.values())), tuple(ignore))

    @staticmethod
    def _check_group(where: str, group: Any) -> int:
        """The group size of one ``config_groups`` entry; ``LoadError`` for anything not ``SCHEME``."""
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise LoadError(f"{where} is {group!r}; a group needs a 'weights' scheme ({SCHEME})")
        if group.get("format", FORMAT) not in (FORMAT, None):
            raise _refuse(f"{where}.format", group["format"], [FORMAT])
        for side in ("input_activations", "output_activations"):
            if group.get(side) is not None:
                raise _refuse(f"{where}.{side}", group[side], [None])
        weights = group["weights"]
        for field, (allowed, default) in WEIGHT_FIELDS.items():
            value = weights.get(field, default)
            if not _same(value, allowed):
                raise _refuse(f"{where}.weights.{field}", value, allowed)
        return int(weights["group_size"])

    @classmethod
    def undeclared(cls, checkpoint: Checkpoint) -> list[str]:
        return [
            f"{info.file}: {key} is a compressed-tensors packed weight"
            for key, info in checkpoint.tensors.items()
            if key.endswith(PACKED)
        ]

    def _ignored(self, module: str) -> str | None:
        """The ``ignore`` entry that names ``module`` (compressed-tensors' rule: exact name or ``re.match``)."""
        for pattern in self.ignore:
            hit = (
                re.match(pattern.removeprefix("re:"), module) is not None
                if pattern.startswith("re:")
                else pattern == module
            )
            if hit:
                return pattern
        return None

    def pair(self, checkpoint: Checkpoint) -> tuple[dict[str, QuantizedWeight], list[str]]:
        """Each ``weight_packed`` with its ``weight_scale`` and ``weight_shape``; the logical shape ``[O, D]``
        from the headers (``D = g x`` scale columns, which must equal 8 x packed columns)."""
        tensors = checkpoint.tensors
        problems = [
            f"{info.file}: {key} belongs to {key.removesuffix(suffix) + PACKED}, which no shard holds"
            for key, info in tensors.items()
            for suffix in (SCALE, SHAPE, ZERO_POINT, G_IDX)
            if key.endswith(suffix) and key.removesuffix(suffix) + PACKED not in tensors
        ]
        out: dict[str, QuantizedWeight] = {}
        for key, info in tensors.items():
            if key.endswith(PACKED):
                weight = self._weight(info, tensors)
                if isinstance(weight, QuantizedWeight):
                    out[weight.key] = weight
                else:
                    problems += weight
        return out, problems

    def _weight(self, packed: TensorInfo, tensors: Mapping[str, TensorInfo]) -> QuantizedWeight | list[str]:
        """The quantized weight whose ``weight_packed`` is ``packed``, or its problems."""
        name, g = packed.key.removesuffix(PACKED), self.group_size
        where = f"{packed.file}: {packed.key}"
        found = [
            f"{where}: the config says {what}, but {extra} is stored"
            for extra, what in ((name + ZERO_POINT, "symmetric: true"), (name + G_IDX, "actorder: null"))
            if extra in tensors
        ]
        if name + ".weight" in tensors:
            found.append(f"{where}: {name}.weight is stored too (a weight is either float or packed)")
        if (pattern := self._ignored(name)) is not None:
            found.append(
                f"{where}: {name} is quantized, but quantization_config.ignore lists it ({pattern!r})"
            )
        scale, shape = tensors.get(name + SCALE), tensors.get(name + SHAPE)
        if packed.dtype != "I32" or len(packed.shape) != 2:
            return [*found, f"{where} is {packed.dtype} {packed.shape}; packed weights are I32 [out, in/8]"]
        if scale is None or shape is None:
            missing = " and ".join(k for k in (name + SCALE, name + SHAPE) if k not in tensors)
            return [*found, f"{where} has no {missing} in any shard"]
        rows, d = packed.shape[0], packed.shape[1] * CODES_PER_WORD
        if scale.dtype not in SCALE_DTYPES or scale.shape != (rows, d // g) or d % g:
            found.append(
                f"{scale.file}: {scale.key} is {scale.dtype} {scale.shape}; the scales of {packed.key} "
                f"{packed.shape} (a [{rows}, {d}] weight) must be {'/'.join(SCALE_DTYPES)} "
                f"[{rows}, {d} / {g}] (one per group of {g} inputs)"
            )
        if shape.dtype not in SHAPE_DTYPES or shape.shape != (2,):
            found.append(f"{shape.file}: {shape.key} is {shape.dtype} {shape.shape}; expected I32 [2]")
        if found:
            return found
        parts = {"packed": packed, "scale": scale, "shape": shape}
        nbytes = sum(t.nbytes for t in parts.values())
        logical = TensorInfo(name + ".weight", packed.file, CODE, (rows, d), nbytes, packed.offset)
        return QuantizedWeight(logical, parts)

    @property
    def native(self) -> ExpertFormatChoice:
        return ExpertFormatChoice("int4", (("group_size", self.group_size), ("symmetric", True)))

    def expert_problem(self, weight: QuantizedWeight, role: str, site: ExpertsSite) -> str | None:
        scale = weight.parts["scale"]
        if (fused := super().expert_problem(weight, role, site)) is not None or scale.dtype == "BF16":
            return fused
        return (
            f"{scale.file}: {scale.key} is {scale.dtype}; routed experts are held as moetune's int4 format, "
            "whose group scales are bf16, so their scales must be BF16 (as Kimi-K2-Thinking's are) to load "
            "as shipped"
        )

    def _packed(self, weight: QuantizedWeight, reader: ShardReader) -> torch.Tensor:
        """``weight``'s ``weight_packed`` ``[O, D/8]`` int32, after checking its stored ``weight_shape``."""
        stored = reader.read(weight.parts["shape"]).tolist()
        if stored != list(weight.info.shape):
            shape = weight.parts["shape"]
            raise LoadError(
                f"{shape.file}: {shape.key} holds {stored}, but its packed weight and scales are of a "
                f"{list(weight.info.shape)} weight"
            )
        return reader.read(weight.parts["packed"])

    def read_experts(
        self,
        weights: Mapping[str, Sequence[QuantizedWeight]],
        layout: ExpertsLayout,
        reader: ShardReader,
        experts: range,
    ) -> Int4Experts:
        """Per expert (``weights`` holds those of ``experts`` only), its packed codes re-packed (``repack``) and
        its bf16 group scales as stored, one matrix at a time, into ``Int4Experts``' stacked tensors."""

        def codes(w: QuantizedWeight) -> torch.Tensor:
            return repack(self._packed(w, reader))

        def scale(w: QuantizedWeight) -> torch.Tensor:
            return reader.read(w.parts["scale"])

        lists: dict[str, LazyTensors[QuantizedWeight]] = {}
        for role in ROLES:
            lists[role] = LazyTensors(weights[role], codes)
            lists[f"{role}_scale"] = LazyTensors(weights[role], scale)
        return Int4Experts.from_per_expert(**lists, group_size=self.group_size)

    def dequantize(self, weight: QuantizedWeight, reader: ShardReader) -> torch.Tensor:
        """``(u - 8) * s`` in fp32 ``[O, D]``: exact for bf16 and fp16 scales (a 4-bit code times an 11-bit
        significand fits fp32's 24 bits)."""
        return self.dequantize_parts(
            weight, {"packed": self._packed(weight, reader), "scale": reader.read(weight.parts["scale"])}
        )

    def dequantize_parts(
        self, weight: QuantizedWeight, parts: Mapping[str, torch.Tensor], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        o, d = weight.info.shape
        codes = unpack_codes(parts["packed"])
        out = codes.to(torch.float32) if out is None else out.copy_(codes)
        scale = parts["scale"].to(torch.float32)  # [O, D/g]
        out.view(o, d // self.group_size, self.group_size).sub_(SYMMETRIC_ZERO).mul_(scale[:, :, None])
        return out

    def quantize(self, weight: QuantizedWeight, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Symmetric codes in groups of g (``int4.quantize_groups``: the group's max-abs / 7, rounded to bf16, each
        weight within half a step of it), packed as stored (``pack_codes``); scales in the stored dtype."""
        o, d = w.shape
        halves = torch.empty(o, d // 2, dtype=torch.uint8)  # the int4 format's packing: codes j and j + D/2
        scale = torch.empty(o, d // self.group_size, dtype=torch.bfloat16)
        quantize_groups(w, self.group_size, halves, scale, None)
        codes = torch.cat((halves & 0x0F, halves >> 4), dim=1)
        return {"packed": pack_codes(codes), "scale": scale.to(TORCH_DTYPES[weight.parts["scale"].dtype])}
