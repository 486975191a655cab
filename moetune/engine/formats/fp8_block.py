"""FP8 (e4m3fn) expert weights with 128 x 128 block scales, DeepSeek-V3's convention; FP8 bytes stay FP8.

Each expert matrix ``[O, D]`` is cut into 128 x 128 blocks (the last row and column of blocks are partial
when O or D is not a multiple of 128), and block ``(a, b)`` has one fp32 ``weight_scale_inv``::

    w[o, d] ~= fp8[o, d] * scale_inv[o // 128, d // 128]        grid [ceil(O/128), ceil(D/128)]

The name is the checkpoints': it is the inverse of the scale that brought the weights into fp8's range,
i.e. the dequantization multiplier. The quantizer sets it to block max-abs / 448 (e4m3fn's largest
finite value), so no code saturates.

FP8 checkpoints store gate and up as separate ``[I, H]`` matrices with a grid each; gate_up keeps both
grids stacked, ``[E, 2 ceil(I/128), ceil(H/128)]`` (gate's block rows, then up's). That equals one fused
``[2I, H]`` grid when I is a multiple of 128, as in every released FP8 MoE checkpoint we know of; a fused
grid over ``2I`` rows with ``I % 128 != 0`` has the same shape for some I but other blocks and must not be
passed here.

Dequantization: torch's e4m3fn -> fp32 conversion is scalar on the CPU (measured ~10x slower than
bf16 -> fp32 here). Instead each byte's sign and exponent/mantissa bits are moved into an fp16 bit
pattern with integer ops: e4m3's exponent bias 7 vs fp16's 15 makes that fp16 number exactly
``value * 2^-8`` for every finite code, subnormals included. fp16 -> fp32 is vectorized, and the block
multiplier ``scale_inv * 2^8`` (formed once, at construction) restores the value (exactly: power-of-two
factors), so each weight is ``fp8 * scale_inv`` rounded once to fp32. The two NaN codes (0x7F, 0xFF) would
come out finite, so constructors reject them. Five passes over a row block (widen, shift, mask, to fp32,
scale; ``tile`` adds the rounding to bf16), each a single torch call on the whole block: per-call overhead,
not arithmetic, was a third of a 128-row tile's time (docs/performance.md, "fp8_block and mxfp4: the torch
path and the fused decoders"). With bf16 compute, experts with at most ``FUSED_MAX_ROWS`` rows skip the
tile: the fused kernels' ``Fp8BlockRows`` decoder (``kernels/decoders.h``) does the same arithmetic in
registers. Resident bytes per parameter: ``1 + 4 / 128^2`` for whole blocks (1.0002).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

import torch

from moetune.engine.formats.base import FORMATS, Projection
from moetune.engine.formats.quant_common import (
    QuantizedExperts,
    check_dense,
    check_stored,
    copy_per_expert,
    gate_up_dims,
    per_expert_lists,
    row_chunks,
    scratch,
)
from moetune.errors import NonFiniteError
from moetune.finite import all_finite, first_non_finite

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
BLOCK = 128  # DeepSeek-V3's weight_block_size [128, 128]
# 0-dim int16 operands: an in-place op given a Python int wraps it into a tensor on every call (~2.5 us).
# The mask is 0xBF80: the sign bit and the 7 exponent+mantissa bits once shifted.
_FP16_BITS_MASK = torch.tensor(-16512, dtype=torch.int16)
_FP16_SHIFT = torch.tensor(7, dtype=torch.int16)  # e4m3's 3 mantissa bits land at the top of fp16's 10
FP16_UNBIAS = 2.0**8  # 2^(fp16 bias 15 - e4m3 bias 7)


def grid(rows: int, cols: int) -> tuple[int, int]:
    """Block-scale grid of an ``[rows, cols]`` matrix: ``(ceil(rows/128), ceil(cols/128))``."""
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def quantize_blocks(w: torch.Tensor, codes: torch.Tensor, scale_inv: torch.Tensor) -> None:
    """w ``[O, D]`` float -> codes ``[O, D]`` e4m3fn and scale_inv ``grid(O, D)`` (fp32, or bf16 / fp16 as some
    checkpoints store it), written in place.

    scale_inv = block max-abs / 448; an all-zero block gets 1 (its codes are 0 anyway). A bf16 / fp16 scale_inv
    is that rounded up (never below it, so no code passes 448), and the codes are taken against the stored scale.
    fp32 -> e4m3fn rounds to nearest even.
    """
    o, d = w.shape
    r, c = grid(o, d)
    padded = torch.zeros(r * BLOCK, c * BLOCK, dtype=torch.float32)  # zero padding never raises a max
    padded[:o, :d] = w
    blocks = padded.view(r, BLOCK, c, BLOCK)
    s = blocks.abs().amax(dim=(1, 3)) / FP8_MAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    if scale_inv.dtype != torch.float32:
        # rounding to nearest moves it by < 2^-8 of itself, so 2^-7 up stays above; and at least the dtype's
        # smallest normal (fp16 would flush a tiny block's scale to zero)
        tiny = torch.finfo(scale_inv.dtype).tiny
        s = (s * (1 + 2.0**-7)).clamp(min=tiny).to(scale_inv.dtype).float()
    scale_inv.copy_(s)
    q = blocks.div_(s[:, None, :, None]).clamp_(-FP8_MAX, FP8_MAX).view(r * BLOCK, c * BLOCK)
    codes.copy_(q[:o, :d])


def _spans(n: int) -> list[tuple[int, int, int]]:
    """``n`` indices as (start, blocks, block length): the whole 128-blocks, then the partial one if any."""
    whole, part = divmod(n, BLOCK)
    return [(0, whole, BLOCK)] * (whole > 0) + [(whole * BLOCK, 1, part)] * (part > 0)


def scale_blocks(out: torch.Tensor, scale: torch.Tensor) -> None:
    """out ``[R, D]`` fp32 times its 128 x 128 block's factor, in place; scale ``grid(R, D)`` fp32.

    One broadcast multiply per rectangle of equal-sized blocks, the factors read in place: no column-expanded
    copy of the scales. Whole blocks only (the usual case) take one multiply on views: the general loop's
    slicing measured ~13 us more per call, a tenth of a 128-row tile.
    """
    rows, d = out.shape
    if rows % BLOCK == 0 and d % BLOCK == 0:
        nr, nc = scale.shape
        out.view(nr, BLOCK, nc, BLOCK).mul_(scale.view(nr, 1, nc, 1))
        return
    for r0, nr, hr in _spans(rows):
        for c0, nc, hc in _spans(d):
            part = out[r0 : r0 + nr * hr, c0 : c0 + nc * hc].unflatten(1, (nc, hc)).unflatten(0, (nr, hr))
            part.mul_(scale[r0 // BLOCK : r0 // BLOCK + nr, None, c0 // BLOCK : c0 // BLOCK + nc, None])


def decode_rows(codes: torch.Tensor, multipliers: torch.Tensor, out: torch.Tensor) -> None:
    """out ``[R, D]`` fp32 = the e4m3fn codes ``[R, D]`` (read as int8) times their block's multiplier
    (``scale_inv * 2^8``, ``grid(R, D)`` fp32): the module docstring's fp16 bit pattern, one scratch buffer per
    thread. The rows start on a block boundary; NaN codes come out finite (callers exclude them)."""
    half = scratch("fp8_half", tuple(out.shape), torch.int16)
    half.copy_(codes)  # sign-extends: bit 15 = the sign
    half.bitwise_left_shift_(_FP16_SHIFT).bitwise_and_(_FP16_BITS_MASK)
    out.copy_(half.view(torch.float16))
    scale_blocks(out, multipliers)


def multipliers(scale_inv: torch.Tensor) -> torch.Tensor:
    """``scale_inv * 2^8`` in fp32 (exact: a power of two), :func:`decode_rows`' multipliers."""
    return scale_inv.to(torch.float32) * FP16_UNBIAS


@FORMATS.register("fp8_block")
class Fp8BlockExperts(QuantizedExperts):
    """FP8 e4m3fn experts with fp32 128 x 128 block ``weight_scale_inv``.

    Args:
        gate_up: ``[E, 2I, H]`` float8_e4m3fn (gate rows, then up rows).
        gate_up_scale_inv: ``[E, 2 ceil(I/128), ceil(H/128)]`` fp32: gate's grid, then up's.
        down: ``[E, H, I]`` float8_e4m3fn. down_scale_inv: ``[E, ceil(H/128), ceil(I/128)]`` fp32.
    """

    name = "fp8_block"
    STATE_FIELDS = ("gate_up", "gate_up_scale_inv", "down", "down_scale_inv")

    def __init__(
        self,
        gate_up: torch.Tensor,
        gate_up_scale_inv: torch.Tensor,
        down: torch.Tensor,
        down_scale_inv: torch.Tensor,
    ) -> None:
        e, h, i = gate_up_dims(self.name, "gate_up", gate_up, "[E, 2I, H]")
        gi, gh = grid(i, h)
        self.gate_up = check_stored(self.name, "gate_up", gate_up, FP8, (e, 2 * i, h), "[E, 2I, H]")
        self.down = check_stored(self.name, "down", down, FP8, (e, h, i), "[E, H, I]")
        self.gate_up_scale_inv = check_stored(
            self.name,
            "gate_up_scale_inv",
            gate_up_scale_inv,
            torch.float32,
            (e, 2 * gi, gh),
            "[E, 2 ceil(I/128), ceil(H/128)]",
        )
        self.down_scale_inv = check_stored(
            self.name,
            "down_scale_inv",
            down_scale_inv,
            torch.float32,
            (e, *grid(h, i)),
            "[E, ceil(H/128), ceil(I/128)]",
        )
        for field in ("gate_up", "down"):
            codes = getattr(self, field)
            bad = first_non_finite(codes)  # NaN codes (0x7F, 0xFF): named by the first expert holding one
            if bad is not None:
                raise NonFiniteError(
                    f"{self.name}: {field}[{bad}] holds NaN codes (0x7F or 0xFF); expert weights must be finite"
                )
            scale = getattr(self, f"{field}_scale_inv")
            if not all_finite(scale):
                raise NonFiniteError(
                    f"{self.name}: {field}_scale_inv holds non-finite values; they must be finite"
                )
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        # gate_up: gate's rows [0, I) use grid rows from 0, up's rows [I, 2I) from ceil(I/128); chunks stay
        # inside one of them and start on a block boundary.
        self._segments = {"gate_up": ((0, 0), (i, gi)), "down": ((0, 0),)}
        self._chunks = {
            "gate_up": row_chunks(0, i, h, BLOCK) + row_chunks(i, 2 * i, h, BLOCK),
            "down": row_chunks(0, h, i, BLOCK),
        }
        # what _dequant_rows reads: the codes as int8 (their widening sign-extends), and the block multipliers
        # scale_inv * 2^8 in fp32 (4 bytes more per 128^2 weights)
        self._decode = {
            proj: (codes.view(torch.int8), multipliers(scale_inv))
            for proj in ("gate_up", "down")
            for codes, scale_inv in [self._stored(proj)]
        }

    @classmethod
    def from_dense(cls, gate_up: torch.Tensor, down: torch.Tensor) -> Fp8BlockExperts:
        """Quantize dense gate_up ``[E, 2I, H]`` and down ``[E, H, I]``: gate, up and down as separate matrices,
        as FP8 checkpoints do, one expert at a time."""
        e, h, i = check_dense(cls.name, gate_up, down)
        gu = torch.empty(e, 2 * i, h, dtype=FP8)
        dn = torch.empty(e, h, i, dtype=FP8)
        gi, gh = grid(i, h)
        gu_s = torch.empty(e, 2 * gi, gh, dtype=torch.float32)
        dn_s = torch.empty(e, *grid(h, i), dtype=torch.float32)
        for x in range(e):
            w = gate_up[x].detach()
            quantize_blocks(w[:i], gu[x, :i], gu_s[x, :gi])
            quantize_blocks(w[i:], gu[x, i:], gu_s[x, gi:])
            quantize_blocks(down[x].detach(), dn[x], dn_s[x])
        return cls(gu, gu_s, dn, dn_s)

    @classmethod
    def from_per_expert(
        cls,
        gate: Sequence[torch.Tensor],
        gate_scale_inv: Sequence[torch.Tensor],
        up: Sequence[torch.Tensor],
        up_scale_inv: Sequence[torch.Tensor],
        down: Sequence[torch.Tensor],
        down_scale_inv: Sequence[torch.Tensor],
    ) -> Fp8BlockExperts:
        """Build from per-expert tensors as FP8 checkpoints store them (``experts.{e}.gate_proj.weight`` and its
        ``weight_scale_inv``, ...): gate[e], up[e] ``[I, H]`` e4m3fn with ``[ceil(I/128), ceil(H/128)]`` fp32
        scales; down[e] ``[H, I]`` with ``[ceil(H/128), ceil(I/128)]``. Copied once into stacked tensors."""
        lists = {
            "gate": gate,
            "gate_scale_inv": gate_scale_inv,
            "up": up,
            "up_scale_inv": up_scale_inv,
            "down": down,
            "down_scale_inv": down_scale_inv,
        }
        e, i, h = per_expert_lists(cls.name, lists, "[I, H]")
        gi, gh = grid(i, h)
        gu = torch.empty(e, 2 * i, h, dtype=FP8)
        dn = torch.empty(e, h, i, dtype=FP8)
        gu_s = torch.empty(e, 2 * gi, gh, dtype=torch.float32)
        dn_s = torch.empty(e, *grid(h, i), dtype=torch.float32)
        targets = {
            "gate": (lambda x: gu[x, :i], "[I, H]"),
            "up": (lambda x: gu[x, i:], "[I, H]"),
            "down": (lambda x: dn[x], "[H, I]"),
            "gate_scale_inv": (lambda x: gu_s[x, :gi], "[ceil(I/128), ceil(H/128)]"),
            "up_scale_inv": (lambda x: gu_s[x, gi:], "[ceil(I/128), ceil(H/128)]"),
            "down_scale_inv": (lambda x: dn_s[x], "[ceil(H/128), ceil(I/128)]"),
        }
        copy_per_expert(cls.name, lists, targets)
        return cls(gu, gu_s, dn, dn_s)

    def row_align(self, proj: Projection) -> int:
        """Whole 128-row scale blocks; the whole matrix when a segment (up, after gate) starts mid-block."""
        if all(start % BLOCK == 0 for start, _ in self._segments[proj]):
            return BLOCK
        return self.shape(proj)[0]

    def _stored(self, proj: Projection) -> tuple[torch.Tensor, torch.Tensor]:
        """``proj``'s codes ``[E, D_out, D_in]`` e4m3fn and block scales ``[E, grid rows, ceil(D_in/128)]`` fp32."""
        if proj == "gate_up":
            return self.gate_up, self.gate_up_scale_inv
        return self.down, self.down_scale_inv

    def _dequant_rows(self, proj: Projection, expert: int, r0: int, r1: int, out: torch.Tensor) -> None:
        codes, mults = self._decode[proj]
        rows = out.shape[0]
        seg_start, grid_start = max(s for s in self._segments[proj] if s[0] <= r0)
        b0 = grid_start + (r0 - seg_start) // BLOCK  # chunks start on block boundaries of their segment
        decode_rows(codes[expert, r0:r1], mults[expert, b0 : b0 + -(-rows // BLOCK)], out)

    # per kernel variant, the fused kernel beats dequantize-then-GEMM up to here (AVX512-BF16: fused / torch
    # 1.06x at 256 rows, 0.94x at 512; docs/performance.md, "fp8_block and mxfp4: the torch path and the fused
    # decoders"). AMX-BF16: int4's value (its torch path dequantizes too), not measured on an AMX CPU yet.
    # AVX2 (fp32 compute): fused / torch CPU time fp8_block 2.40x at 8, 1.32x at 128, 1.18x at 256, 1.05x at 512 rows
    # per expert (an AVX2-only AMD EPYC, Zen 1, 1 thread, nothing else running; docs/performance.md, "AVX2 variant"):
    # `python bench/formats.py --threads 1 --reps 3 --experts 8 --top-k 4 --tokens 16 64 256 512 1024 --formats int8
    # int4-g64 fp8_block mxfp4 --compute-dtype float32 --variant AVX2 --fused-max-rows 100000`
    FUSED_MAX_ROWS = MappingProxyType({"AMX-BF16": 256, "AVX512-BF16": 256, "AVX2": 256})

    def fused_operands(self, proj: Projection, expert: int) -> tuple[str, tuple[Any, ...]]:
        codes, scale_inv = self._stored(proj)
        seg, seg_grid = self._segments[proj][-1]  # where up's rows and grid rows start (down: 0, 0)
        return "fp8_block_gemm", (codes[expert], scale_inv[expert], seg, seg_grid)

    def fused_run_operands(self, proj: Projection) -> tuple[str, tuple[Any, ...]]:
        codes, scale_inv = self._stored(proj)
        seg, seg_grid = self._segments[proj][-1]
        return "fp8_block_gemm_run", (codes, scale_inv, seg, seg_grid)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.gate_up, self.gate_up_scale_inv, self.down, self.down_scale_inv))

    @property
    def storage_dtype(self) -> torch.dtype:
        return FP8
