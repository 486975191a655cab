"""INT4 expert weights: group-wise along the input dimension, symmetric or with zero points, two per byte.

Each row of an expert matrix ``[O, D]`` (D = H for gate_up, I for down) is cut into groups of ``g``
consecutive inputs (``g`` = 32, 64 or 128). Group ``j`` of row ``o`` has a bf16 scale ``s`` and a zero point
``z``; codes ``u`` are 4-bit unsigned::

    w[o, d] ~= (u[o, d] - z[o, d // g]) * s[o, d // g],   u in [0, 15]

* symmetric: ``z = 8`` for every group (not stored), ``s = max|w| / 7``, so codes use [1, 15] = -7..7 and
  the largest weight is on the grid (nothing clips). Code 0 (-8) is never produced here but is part of the
  format: pre-quantized checkpoints (compressed-tensors' signed int4, stored as ``q + 8``) use it, and
  ``from_per_expert`` takes their codes as they are, re-packed into this format's nibble order.
* asymmetric: the group's range widened to include 0, ``[min(w, 0), max(w, 0)]``, spans 15 steps; ``z`` is
  the uint8 code of 0 (so zeros stay exact), in [0, 15].

Scales are bf16: fp32's exponent range (no weight magnitude overflows or flushes, unlike fp16) at 2 bytes,
and their 2^-9 relative rounding is ~40x below the 4-bit step error; codes are computed against the
rounded scale. Packing: byte ``j`` of a row holds ``u[j]`` in its low nibble and ``u[j + D/2]`` in its high
nibble, so unpacking writes two contiguous halves (interleaved nibbles make the writes strided, measured
~40x slower with two threads). Resident bytes per parameter: ``0.5 + 2/g`` (+ ``1/g`` with zero points):
0.531 (g = 64, symmetric), 0.547 (g = 64, asymmetric).
"""

from __future__ import annotations

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
from moetune.errors import EngineError

GROUP_SIZES = (32, 64, 128)
QMAX = 15  # 4-bit unsigned codes
SYMMETRIC_ZERO = 8  # symmetric codes u - 8 cover -7..7 (u = 0, i.e. -8, is never produced)
SYMMETRIC_MAX = 7  # max|w| maps to 7 steps: the symmetric grid's largest magnitude


def check_group_size(fmt: str, group_size: object, hidden: int, intermediate: int) -> int:
    """``group_size`` if it is allowed and divides both H and I; else an EngineError saying what would."""
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise EngineError(f"{fmt}: group_size must be one of {list(GROUP_SIZES)}; got {group_size!r}")
    for symbol, size in (("H", hidden), ("I", intermediate)):
        if size % group_size:
            fits = [g for g in GROUP_SIZES if hidden % g == 0 and intermediate % g == 0]
            hint = (
                f"group sizes that divide both: {fits}"
                if fits
                else "none of them does: use int8 or fp8_block"
            )
            raise EngineError(
                f"{fmt}: {symbol} = {size} is not a multiple of group_size {group_size} (groups run along each "
                f"matrix's input dimension: H for gate_up, I for down; H = {hidden}, I = {intermediate}); {hint}"
            )
    return group_size


def quantize_groups(
    w: torch.Tensor,
    group_size: int,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor | None,
) -> None:
    """w ``[O, D]`` float -> packed ``[O, D/2]`` uint8, scale ``[O, D/g]`` bf16 and, when asymmetric (``zero``
    given), zero ``[O, D/g]`` uint8 — all written in place."""
    o, d = w.shape
    w32 = w.to(torch.float32).view(o, d // group_size, group_size)
    if zero is None:
        s = w32.abs().amax(dim=2) / SYMMETRIC_MAX
    else:
        lo, hi = w32.amin(dim=2).clamp(max=0), w32.amax(dim=2).clamp(min=0)
        s = (hi - lo) / QMAX
    s = s.to(torch.bfloat16).float()  # quantize against the scale that is stored
    s = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero group: any scale, its codes sit on z
    if zero is None:
        z = torch.full_like(s, SYMMETRIC_ZERO)
    else:
        z = torch.round(-lo / s).clamp_(0, QMAX)
        zero.copy_(z)
    scale.copy_(s)
    u = (torch.round(w32 / s[..., None]) + z[..., None]).clamp_(0, QMAX).to(torch.uint8).view(o, d)
    pack_codes(u, packed)


def pack_codes(codes: torch.Tensor, packed: torch.Tensor) -> None:
    """codes ``[O, D]`` uint8 in [0, 15] -> packed ``[O, D/2]`` uint8 in place: byte ``j`` of a row holds
    ``codes[j]`` (low nibble) and ``codes[j + D/2]`` (high nibble)."""
    d = codes.shape[1]
    torch.bitwise_or(codes[:, : d // 2], codes[:, d // 2 :] << 4, out=packed)


@FORMATS.register("int4")
class Int4Experts(QuantizedExperts):
    """Group-wise INT4 experts, symmetric (no zero points) or asymmetric (uint8 zero points).

    Args:
        gate_up: ``[E, 2I, H/2]`` uint8, two codes per byte. gate_up_scale: ``[E, 2I, H/g]`` bf16.
        down: ``[E, H, I/2]`` uint8. down_scale: ``[E, H, I/g]`` bf16.
        group_size: g, one of 32, 64, 128; must divide H and I.
        gate_up_zero, down_zero: ``[E, 2I, H/g]`` / ``[E, H, I/g]`` uint8 in [0, 15], both or neither
            (neither: symmetric, z = 8).
    """

    name = "int4"
    # bf16 directly: code and scale are exact in bf16, their product is formed in fp32 and rounded once, as
    # the fp32 path then a cast would (measured 1.32 vs 1.82 ms per [1536, 2048] matrix)
    DIRECT_DTYPES = (torch.float32, torch.bfloat16)
    STATE_FIELDS = ("gate_up", "gate_up_scale", "down", "down_scale", "gate_up_zero", "down_zero")

    def __init__(
        self,
        gate_up: torch.Tensor,
        gate_up_scale: torch.Tensor,
        down: torch.Tensor,
        down_scale: torch.Tensor,
        *,
        group_size: int,
        gate_up_zero: torch.Tensor | None = None,
        down_zero: torch.Tensor | None = None,
    ) -> None:
        e, h, i = gate_up_dims(self.name, "gate_up", gate_up, "[E, 2I, H/2]", values_per_col=2)
        g = check_group_size(self.name, group_size, h, i)
        fields = {
            "gate_up": (gate_up, torch.uint8, (e, 2 * i, h // 2), "[E, 2I, H/2]"),
            "gate_up_scale": (gate_up_scale, torch.bfloat16, (e, 2 * i, h // g), "[E, 2I, H/group_size]"),
            "down": (down, torch.uint8, (e, h, i // 2), "[E, H, I/2]"),
            "down_scale": (down_scale, torch.bfloat16, (e, h, i // g), "[E, H, I/group_size]"),
        }
        if (gate_up_zero is None) != (down_zero is None):
            raise EngineError(
                f"{self.name}: gate_up_zero and down_zero come together (asymmetric) or not at all (symmetric); "
                f"got gate_up_zero {'None' if gate_up_zero is None else 'set'}, "
                f"down_zero {'None' if down_zero is None else 'set'}"
            )
        if gate_up_zero is not None and down_zero is not None:
            fields["gate_up_zero"] = (gate_up_zero, torch.uint8, (e, 2 * i, h // g), "[E, 2I, H/group_size]")
            fields["down_zero"] = (down_zero, torch.uint8, (e, h, i // g), "[E, H, I/group_size]")
        stored = {f: check_stored(self.name, f, *spec) for f, spec in fields.items()}
        for f in ("gate_up_zero", "down_zero"):
            if f in stored and stored[f].numel() and int(stored[f].max()) > QMAX:
                raise EngineError(
                    f"{self.name}: {f} values must be in [0, {QMAX}]; got {int(stored[f].max())}"
                )
        self.gate_up, self.gate_up_scale = stored["gate_up"], stored["gate_up_scale"]
        self.down, self.down_scale = stored["down"], stored["down_scale"]
        self.gate_up_zero, self.down_zero = stored.get("gate_up_zero"), stored.get("down_zero")
        self.group_size = g
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self._chunks = {"gate_up": row_chunks(0, 2 * i, h), "down": row_chunks(0, h, i)}

    @classmethod
    def from_dense(
        cls, gate_up: torch.Tensor, down: torch.Tensor, *, group_size: int = 64, symmetric: bool = True
    ) -> Int4Experts:
        """Quantize dense gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` one expert at a time.

        ``group_size`` 64 by default: 0.53 bytes/parameter at ~10% weight error on Gaussian weights (32
        costs 0.56 for ~9%, 128 costs 0.52 for ~11%).
        """
        e, h, i = check_dense(cls.name, gate_up, down)
        g = check_group_size(cls.name, group_size, h, i)
        shapes = {"gate_up": (e, 2 * i, h), "down": (e, h, i)}
        packed = {p: torch.empty(e, o, d // 2, dtype=torch.uint8) for p, (_, o, d) in shapes.items()}
        scale = {p: torch.empty(e, o, d // g, dtype=torch.bfloat16) for p, (_, o, d) in shapes.items()}
        zero = {
            p: None if symmetric else torch.empty(e, o, d // g, dtype=torch.uint8)
            for p, (_, o, d) in shapes.items()
        }
        for p, w in (("gate_up", gate_up), ("down", down)):
            z = zero[p]
            for x in range(e):
                quantize_groups(w[x].detach(), g, packed[p][x], scale[p][x], None if z is None else z[x])
        return cls(
            packed["gate_up"],
            scale["gate_up"],
            packed["down"],
            scale["down"],
            group_size=g,
            gate_up_zero=zero["gate_up"],
            down_zero=zero["down"],
        )

    @classmethod
    def from_per_expert(
        cls,
        gate: Sequence[torch.Tensor],
        gate_scale: Sequence[torch.Tensor],
        up: Sequence[torch.Tensor],
        up_scale: Sequence[torch.Tensor],
        down: Sequence[torch.Tensor],
        down_scale: Sequence[torch.Tensor],
        *,
        group_size: int,
    ) -> Int4Experts:
        """Symmetric experts (z = 8) from per-expert matrices as a pre-quantized checkpoint's loader produces
        them, already in this format's packing: gate[e], up[e] ``[I, H/2]`` uint8 (byte ``j`` of a row holds
        codes ``j`` and ``j + H/2``) with ``[I, H/g]`` bf16 scales; down[e] ``[H, I/2]`` with ``[H, I/g]``. Each
        tensor is checked and copied once into the stacked layout, so a caller producing them one at a time
        holds one expert matrix beyond the result.
        """
        lists = {
            "gate": gate,
            "gate_scale": gate_scale,
            "up": up,
            "up_scale": up_scale,
            "down": down,
            "down_scale": down_scale,
        }
        e, i, half_h = per_expert_lists(cls.name, lists, "[I, H/2]")
        h = 2 * half_h
        g = check_group_size(cls.name, group_size, h, i)
        gu = torch.empty(e, 2 * i, h // 2, dtype=torch.uint8)
        dn = torch.empty(e, h, i // 2, dtype=torch.uint8)
        gu_s = torch.empty(e, 2 * i, h // g, dtype=torch.bfloat16)
        dn_s = torch.empty(e, h, i // g, dtype=torch.bfloat16)
        targets = {  # field -> (its destination in expert x, the symbols of its shape)
            "gate": (lambda x: gu[x, :i], "[I, H/2]"),
            "up": (lambda x: gu[x, i:], "[I, H/2]"),
            "down": (lambda x: dn[x], "[H, I/2]"),
            "gate_scale": (lambda x: gu_s[x, :i], "[I, H/g]"),
            "up_scale": (lambda x: gu_s[x, i:], "[I, H/g]"),
            "down_scale": (lambda x: dn_s[x], "[H, I/g]"),
        }
        copy_per_expert(cls.name, lists, targets)
        return cls(gu, gu_s, dn, dn_s, group_size=g)

    @property
    def symmetric(self) -> bool:
        """True when there are no zero points (z = 8 for every group)."""
        return self.gate_up_zero is None

    def params(self) -> dict[str, Any]:
        return {"group_size": self.group_size, "symmetric": self.symmetric}

    def _stored(self, proj: Projection) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``proj``'s packed codes ``[E, D_out, D_in / 2]``, scales ``[E, D_out, D_in / g]`` and zero points (None:
        symmetric)."""
        if proj == "gate_up":
            return self.gate_up, self.gate_up_scale, self.gate_up_zero
        return self.down, self.down_scale, self.down_zero

    def _dequant_rows(self, proj: Projection, expert: int, r0: int, r1: int, out: torch.Tensor) -> None:
        packed, scale, zero = self._stored(proj)
        rows, d = out.shape
        g = self.group_size
        p = packed[expert, r0:r1]  # [rows, D/2]
        codes = scratch("int4_codes", (rows, d), torch.uint8)
        torch.bitwise_and(p, 0x0F, out=codes[:, : d // 2])
        torch.bitwise_right_shift(p, 4, out=codes[:, d // 2 :])
        centred = codes.view(torch.int8).view(rows, d // g, g)  # u - z fits int8: both are in [0, 15]
        if zero is None:
            centred.sub_(SYMMETRIC_ZERO)
        else:
            centred.sub_(zero[expert, r0:r1].view(torch.int8)[:, :, None])
        s = scale[expert, r0:r1]  # [rows, D/g] bf16
        if out.dtype != torch.bfloat16:  # a same-dtype multiply: mixed ones run slower
            s = scratch("int4_scale", (rows, d // g), out.dtype).copy_(s)
        out.copy_(codes.view(torch.int8)).view(rows, d // g, g).mul_(s[:, :, None])

    # per kernel variant, the fused kernel beats dequantize-then-GEMM up to here (bench/formats.py;
    # docs/performance.md, "Fused kernels")
    # AVX2 (fp32 compute): fused / torch CPU time int4-g64 2.15x at 8, 1.42x at 128, 1.07x at 256, 1.00x at 512 rows
    # per expert (an AVX2-only AMD EPYC, Zen 1, 1 thread, nothing else running; docs/performance.md, "AVX2 variant"):
    # `python bench/formats.py --threads 1 --reps 3 --experts 8 --top-k 4 --tokens 16 64 256 512 1024 --formats int8
    # int4-g64 fp8_block mxfp4 --compute-dtype float32 --variant AVX2 --fused-max-rows 100000`
    FUSED_MAX_ROWS = MappingProxyType({"AMX-BF16": 256, "AVX512-BF16": 256, "AVX2": 256})
    # AVX2 with 8-bit activation rows (kernels/avx2_int8.h): against fp32 GEMMs on the weights already dequantized,
    # forward / backward 1.58x / 1.49x at 128 rows, 1.33x / 1.25x at 512, 1.33x / 1.02x at 1024 (Zen 3, 1 thread;
    # docs/performance.md, "AVX2: int4 against 8-bit activation rows"): the step at T = 4096, E = 128 (256 rows per
    # expert on average, half the experts past 256) was 1.07x bf16 with 256 here
    INT8_ROWS_MAX_ROWS = MappingProxyType({"AVX2": 512})

    def fused_operands(self, proj: Projection, expert: int) -> tuple[str, tuple[Any, ...]]:
        packed, scale, zero = self._stored(proj)
        z = None if zero is None else zero[expert]
        return "int4_gemm", (packed[expert], scale[expert], z, self.group_size)

    def fused_run_operands(self, proj: Projection) -> tuple[str, tuple[Any, ...]]:
        packed, scale, zero = self._stored(proj)
        return "int4_gemm_run", (packed, scale, zero, self.group_size)

    @property
    def nbytes(self) -> int:
        stored = (
            self.gate_up,
            self.gate_up_scale,
            self.gate_up_zero,
            self.down,
            self.down_scale,
            self.down_zero,
        )
        return sum(t.nbytes for t in stored if t is not None)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8  # packed 4-bit codes
