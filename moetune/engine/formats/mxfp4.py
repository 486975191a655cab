"""MXFP4 expert weights (OCP Microscaling: 4-bit e2m1 elements, one e8m0 power-of-two scale per 32), as
gpt-oss ships its routed experts.

Each row of an expert matrix ``[O, D]`` (D = H for gate_up, I for down) is cut into blocks of 32 consecutive
inputs. Block ``j`` of row ``o`` has one scale byte ``s`` (e8m0: the power of two ``2^(s - 127)``; 255 is NaN)
and each element a 4-bit e2m1 code ``c`` (bit 3 the sign, then two exponent bits and one mantissa bit)::

    w[o, d] = FP4[c[o, d]] * 2^(s[o, d // 32] - 127)
    FP4 = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0, -0.5, -1, -1.5, -2, -3, -4, -6]      (indexed by the code)

Byte ``b`` of a row holds element ``2b`` in its low nibble and ``2b + 1`` in its high nibble: the byte order of
gpt-oss's ``*_blocks`` tensors (``[E, O, D/32, 16]`` on disk, the same bytes as a row of ``D/2`` here). Stored:
gate_up ``[E, 2I, H/2]`` (gate rows, then up rows) with scales ``[E, 2I, H/32]``, down ``[E, H, I/2]`` with
``[E, H, I/32]``, all uint8. Resident bytes per parameter: ``0.5 + 1/32 = 0.53125``.

Exactness: every value ``FP4[c] * 2^(s - 127)`` has at most two significant bits and lies in
``[2^-128, 1.5 * 2^127]``, so fp32, fp64 and bf16 (whose subnormals reach 2^-133) all hold it exactly: the
dequantized weights are the checkpoint's numbers, with no rounding in any compute dtype. Scale bytes of 255
(NaN) and blocks whose values exceed fp32's range (scale 253 with |value| >= 4, scale 254 with |value| >= 2)
are rejected by the constructor: expert weights must be finite.

Dequantization (``tile``), in fp32 or straight into bf16 (both hold every value exactly, so each equals the
fp32 value rounded, as ``tile`` requires): one gather per byte from a 65536-entry table indexed by
``scale byte * 256 + code byte``, whose word holds the byte's two values, scale applied (``_pair_table``). The
index is the codes widened plus the block's scale byte shifted, broadcast over its 16 bytes: three passes per
code byte (widen, add, gather) and none over the values. The gather is most of the time; the former separate
scale multiply (an fp32 pass, then fp32 -> bf16) cost more than the larger table does (docs/performance.md).
With bf16 compute, experts with at most ``FUSED_MAX_ROWS`` rows skip the tile: the fused kernels' ``Mxfp4Rows``
decoder (``kernels/decoders.h``) reads the nibbles and scale bytes in registers, to the same values.

Quantization (``from_dense``), the OCP MX rule: a block's scale is ``2^(floor(log2 max|w|) - 2)`` (2 = e2m1's
largest exponent), elements are ``w / scale`` rounded to the nearest e2m1 value, ties to the even code, and
saturated at +-6. Per element ``|w - q| <= max(|w|, scale) / 4``: half a step of the 1-bit mantissa relative
to the value, half the subnormal step 0.5 * scale below it, and the clipped range (6, 8) * scale loses less
than a quarter of the value.
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import Any

import torch

from moetune.engine.formats.base import FORMATS, Projection
from moetune.engine.formats.quant_common import (
    QuantizedExperts,
    check_dense,
    check_stored,
    gate_up_dims,
    row_chunks,
    scratch,
)
from moetune.errors import EngineError, NonFiniteError

BLOCK = 32  # values per shared scale (OCP MX block size)
SCALE_BIAS = 127  # e8m0: scale byte s means 2^(s - 127)
SCALE_NAN = 255  # e8m0's NaN encoding
EMAX = 2  # e2m1's largest exponent: 6 = 1.5 * 2^2
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# Rounding |w / scale| to the nearest e2m1 magnitude code (0..7, values 0, 0.5, ... 6): the code counts the
# midpoints passed. At a midpoint, ties go to the even code: past the midpoint only where the code above is
# even (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0), strictly past it otherwise (0.25 -> 0, 1.25 -> 1.0, ...).
_MIDPOINTS_STRICT = (0.25, 1.25, 2.5, 5.0)
_MIDPOINTS_INCLUSIVE = (0.75, 1.75, 3.5)

FP4_TABLE = torch.tensor(FP4_VALUES, dtype=torch.float32)  # e2m1 code -> value
_BYTE = torch.arange(256)
# scale byte -> 2^(s - 127) in fp32 (2^-127 is an fp32 subnormal, exact; 255 -> 2^128 = inf, never used)
_SCALES = torch.pow(2.0, _BYTE.to(torch.float64) - SCALE_BIAS).to(torch.float32)
# a pair table's word per compute dtype: two values of that dtype
_WORD = {torch.float32: torch.int64, torch.bfloat16: torch.int32}
_SCALE_SHIFT = torch.tensor(8, dtype=torch.int32)  # 0-dim: a Python int would be wrapped on every call


@functools.cache
def _pair_table(dtype: torch.dtype) -> torch.Tensor:
    """``[65536]`` words (``_WORD[dtype]``); entry ``s * 256 + b`` holds, in ``dtype``, the values of code byte
    ``b``'s low then high nibble times ``2^(s - 127)``: what a gather writes into two adjacent output slots.

    Computed in fp64 (exact: two significant bits times a power of two) and rounded once to ``dtype``, where
    every finite value is exact; the scales the constructor rejects (255, overflowing blocks) come out inf or
    NaN. 256 KiB (bf16) or 512 KiB (fp32), built on first use."""
    fp4 = FP4_TABLE.to(torch.float64)
    pairs = torch.stack((fp4[_BYTE & 15], fp4[_BYTE >> 4]), dim=1)  # [256 code bytes, 2]
    scales = torch.pow(2.0, _BYTE.to(torch.float64) - SCALE_BIAS)  # [256 scale bytes]
    values = (scales[:, None, None] * pairs).to(dtype)  # [256, 256, 2]
    return values.view(_WORD[dtype]).reshape(-1)


def check_block_multiple(fmt: str, hidden: int, intermediate: int) -> None:
    """EngineError unless H and I are multiples of 32 (scale blocks run along each matrix's input dimension)."""
    for symbol, size in (("H", hidden), ("I", intermediate)):
        if size % BLOCK:
            raise EngineError(
                f"{fmt}: {symbol} = {size} is not a multiple of {BLOCK} (MXFP4 blocks of {BLOCK} values run along "
                f"each matrix's input dimension: H for gate_up, I for down; H = {hidden}, I = {intermediate}); "
                "use int8, int4 or fp8_block for these sizes"
            )


def _thresholds(work: torch.dtype) -> list[float]:
    """The rounding midpoints as ``|q| > t`` tests in ``work``: an inclusive midpoint ``m`` becomes its
    predecessor in ``work`` (``|q| >= m`` iff ``|q| > prev(m)``), exact as a Python float."""
    zero = torch.zeros((), dtype=work)
    below = [torch.nextafter(torch.tensor(m, dtype=work), zero).item() for m in _MIDPOINTS_INCLUSIVE]
    return sorted((*_MIDPOINTS_STRICT, *below))


def quantize_blocks(w: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, what: str) -> None:
    """w ``[O, D]`` float -> packed ``[O, D/2]`` uint8 (two e2m1 codes per byte, low nibble first) and scale
    ``[O, D/32]`` uint8 (e8m0), written in place, by the OCP MX rule (module docstring). EngineError naming
    ``what`` if ``w`` holds NaN or Inf.

    Computed in fp32 (fp64 for fp64 input, so no input is rounded first); scaling by a power of two is exact.
    An all-zero block gets the smallest scale, 2^-127 (its codes are 0 anyway).
    """
    o, d = w.shape
    work = torch.float64 if w.dtype == torch.float64 else torch.float32
    thresholds = _thresholds(work)
    inverse = _SCALES.to(work)  # inverse[127 - x] = 2^-x
    for r0, r1 in row_chunks(0, o, d, 1):
        rows = r1 - r0
        x = w[r0:r1].to(work).contiguous().view(rows, d // BLOCK, BLOCK)
        mag = x.abs()
        amax = mag.amax(dim=2)  # [rows, D/32]; NaN propagates
        if not bool(torch.isfinite(amax).all()):
            raise EngineError(f"{what} holds NaN or Inf; weights must be finite")
        _, exp = torch.frexp(amax)  # amax = m * 2^exp with m in [0.5, 1): floor(log2 amax) = exp - 1
        shared = torch.where(amax > 0, exp - 1 - EMAX, -SCALE_BIAS).clamp_(-SCALE_BIAS, SCALE_BIAS)
        scale[r0:r1] = (shared + SCALE_BIAS).to(torch.uint8)
        mag.mul_(inverse[SCALE_BIAS - shared][:, :, None])  # |w| / 2^shared, exact, in [0, 8)
        code = torch.zeros(mag.shape, dtype=torch.uint8)
        passed = torch.empty(mag.shape, dtype=torch.bool)
        for t in thresholds:  # the magnitude code counts the midpoints passed
            code.add_(torch.gt(mag, t, out=passed))
        torch.lt(x, 0, out=passed).logical_and_(code > 0)  # negative and not rounded to zero (no -0)
        code.bitwise_or_(passed.to(torch.uint8) << 3)
        flat = code.view(rows, d)
        torch.bitwise_or(flat[:, 0::2], flat[:, 1::2] << 4, out=packed[r0:r1])


def _check_finite(fmt: str, field: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """NonFiniteError naming ``field`` and the expert if a scale byte is NaN (255) or a block's values overflow
    fp32 (``value * 2^(s - 127) >= 2^128``, possible for s >= 253 only). codes ``[E, O, D/2]``, scale
    ``[E, O, D/32]``; only the blocks with large scales are unpacked."""
    if scale.numel() == 0 or int(scale.max()) < SCALE_NAN - 2:
        return
    nan = (scale == SCALE_NAN).nonzero()
    if len(nan):
        raise NonFiniteError(
            f"{fmt}: {field}_scale[{int(nan[0, 0])}] holds the e8m0 NaN byte 255; expert weights must be finite"
        )
    hot = (scale >= SCALE_NAN - 2).nonzero()  # [n, 3]: expert, row, block
    e, o, g = hot.unbind(1)
    block_bytes = codes.view(*scale.shape, BLOCK // 2)[e, o, g].long()  # [n, 16]
    largest = torch.maximum(FP4_TABLE[block_bytes & 7], FP4_TABLE[(block_bytes >> 4) & 7]).amax(dim=1)
    limit = torch.pow(2.0, (SCALE_NAN - scale[e, o, g].double())).float()  # value * 2^(s-127) < 2^128
    over = (largest >= limit).nonzero()
    if len(over):
        x = int(over[0, 0])
        raise NonFiniteError(
            f"{fmt}: {field}[{int(e[x])}] has a block whose values overflow fp32 (scale byte {int(scale[e[x], o[x], g[x]])}, "
            f"largest |value| {float(largest[x])}); expert weights must be finite"
        )


@FORMATS.register("mxfp4")
class Mxfp4Experts(QuantizedExperts):
    """MXFP4 experts: e2m1 codes, two per byte, with one e8m0 scale byte per 32 inputs (module docstring).

    Args:
        gate_up: ``[E, 2I, H/2]`` uint8 (gate rows, then up rows). gate_up_scale: ``[E, 2I, H/32]`` uint8.
        down: ``[E, H, I/2]`` uint8. down_scale: ``[E, H, I/32]`` uint8.
    """

    name = "mxfp4"
    STATE_FIELDS = ("gate_up", "gate_up_scale", "down", "down_scale")

    def __init__(
        self,
        gate_up: torch.Tensor,
        gate_up_scale: torch.Tensor,
        down: torch.Tensor,
        down_scale: torch.Tensor,
    ) -> None:
        e, h, i = gate_up_dims(self.name, "gate_up", gate_up, "[E, 2I, H/2]", values_per_col=2)
        check_block_multiple(self.name, h, i)
        fields = {
            "gate_up": (gate_up, (e, 2 * i, h // 2), "[E, 2I, H/2]"),
            "gate_up_scale": (gate_up_scale, (e, 2 * i, h // BLOCK), "[E, 2I, H/32]"),
            "down": (down, (e, h, i // 2), "[E, H, I/2]"),
            "down_scale": (down_scale, (e, h, i // BLOCK), "[E, H, I/32]"),
        }
        stored = {
            f: check_stored(self.name, f, t, torch.uint8, shape, sym) for f, (t, shape, sym) in fields.items()
        }
        self.gate_up, self.gate_up_scale = stored["gate_up"], stored["gate_up_scale"]
        self.down, self.down_scale = stored["down"], stored["down_scale"]
        for field in ("gate_up", "down"):
            _check_finite(self.name, field, getattr(self, field), getattr(self, f"{field}_scale"))
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self._chunks = {"gate_up": row_chunks(0, 2 * i, h), "down": row_chunks(0, h, i)}

    @classmethod
    def from_dense(cls, gate_up: torch.Tensor, down: torch.Tensor) -> Mxfp4Experts:
        """Quantize dense gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` by the OCP MX rule, one expert at a time;
        H and I must be multiples of 32, and the weights finite."""
        e, h, i = check_dense(cls.name, gate_up, down)
        check_block_multiple(f"{cls.name}.from_dense", h, i)
        packed = {
            "gate_up": torch.empty(e, 2 * i, h // 2, dtype=torch.uint8),
            "down": torch.empty(e, h, i // 2, dtype=torch.uint8),
        }
        scale = {
            "gate_up": torch.empty(e, 2 * i, h // BLOCK, dtype=torch.uint8),
            "down": torch.empty(e, h, i // BLOCK, dtype=torch.uint8),
        }
        for proj, w in (("gate_up", gate_up), ("down", down)):
            for x in range(e):
                quantize_blocks(
                    w[x].detach(), packed[proj][x], scale[proj][x], f"{cls.name}.from_dense: {proj}[{x}]"
                )
        return cls(packed["gate_up"], scale["gate_up"], packed["down"], scale["down"])

    DIRECT_DTYPES = (torch.float32, torch.bfloat16)  # keys of _WORD

    def _stored(self, proj: Projection) -> tuple[torch.Tensor, torch.Tensor]:
        """``proj``'s packed codes ``[E, D_out, D_in/2]`` and scale bytes ``[E, D_out, D_in/32]``, uint8."""
        return (self.gate_up, self.gate_up_scale) if proj == "gate_up" else (self.down, self.down_scale)

    def _dequant_rows(self, proj: Projection, expert: int, r0: int, r1: int, out: torch.Tensor) -> None:
        codes, scale = self._stored(proj)
        rows, d = out.shape
        assert out.is_contiguous(), "the gather writes whole words: out must be contiguous"
        # index [rows, D/32 blocks, 16 bytes]: the code bytes plus their block's scale byte * 256
        index = scratch("mxfp4_index", (rows, d // BLOCK, BLOCK // 2), torch.int32)
        index.view(rows, d // 2).copy_(codes[expert, r0:r1])
        block_scale = scratch("mxfp4_scale_index", (rows, d // BLOCK, 1), torch.int32)
        block_scale.view(rows, d // BLOCK).copy_(scale[expert, r0:r1])
        index.add_(block_scale.bitwise_left_shift_(_SCALE_SHIFT))
        table = _pair_table(out.dtype)
        torch.index_select(table, 0, index.view(-1), out=out.view(table.dtype).view(-1))

    # per kernel variant, the fused kernel beats dequantize-then-GEMM up to here (AVX512-BF16: fused / torch
    # 1.12x at 256 rows, 0.96x at 512; docs/performance.md, "fp8_block and mxfp4: the torch path and the fused
    # decoders"). AMX-BF16: int4's value (its torch path dequantizes too), not measured on an AMX CPU yet.
    # AVX2 (fp32 compute): fused / torch CPU time mxfp4 2.13x at 8, 1.37x at 128, 1.12x at 256, 0.98x at 512 rows
    # per expert (an AVX2-only AMD EPYC, Zen 1, 1 thread, nothing else running; docs/performance.md, "AVX2 variant"):
    # `python bench/formats.py --threads 1 --reps 3 --experts 8 --top-k 4 --tokens 16 64 256 512 1024 --formats int8
    # int4-g64 fp8_block mxfp4 --compute-dtype float32 --variant AVX2 --fused-max-rows 100000`
    FUSED_MAX_ROWS = MappingProxyType({"AMX-BF16": 256, "AVX512-BF16": 256, "AVX2": 256})

    def fused_operands(self, proj: Projection, expert: int) -> tuple[str, tuple[Any, ...]]:
        codes, scale = self._stored(proj)
        return "mxfp4_gemm", (codes[expert], scale[expert])

    def fused_run_operands(self, proj: Projection) -> tuple[str, tuple[Any, ...]]:
        return "mxfp4_gemm_run", self._stored(proj)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.gate_up, self.gate_up_scale, self.down, self.down_scale))

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8  # packed 4-bit codes
