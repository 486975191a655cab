"""INT8 expert weights: symmetric, one fp32 scale per output channel (row) of every expert matrix.

``w[e, o, :] ~= q[e, o, :] * scale[e, o]`` with q in [-127, 127] (the quantizer leaves -128 unused so the
grid is symmetric; stored codes of -128 from elsewhere are read as they are). gate_up holds ``[E, 2I, H]``
int8 codes with ``[E, 2I]`` scales, down ``[E, H, I]`` codes with ``[E, H]`` scales. Resident bytes per
parameter: ``1 + 4 (2I + H) / (3 H I)`` (1.003 at H = 2048, I = 768).
"""

from __future__ import annotations

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
)

QMAX = 127  # symmetric int8 grid [-127, 127]


def quantize_rows(w: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    """w ``[O, D]`` float -> codes ``[O, D]`` int8 and scale ``[O]`` fp32 (written in place).

    Scale = row max-abs / 127 so no code clips; an all-zero row gets scale 1 (its codes are 0 anyway).
    """
    w32 = w.to(torch.float32)
    s = w32.abs().amax(dim=1) / QMAX
    s = torch.where(s > 0, s, torch.ones_like(s))
    scale.copy_(s)
    codes.copy_(torch.round(w32 / s[:, None]).clamp_(-QMAX, QMAX))


@FORMATS.register("int8")
class Int8Experts(QuantizedExperts):
    """Per-output-channel symmetric INT8 experts.

    Args:
        gate_up: ``[E, 2I, H]`` int8 codes. gate_up_scale: ``[E, 2I]`` fp32.
        down: ``[E, H, I]`` int8 codes. down_scale: ``[E, H]`` fp32.
    """

    name = "int8"
    STATE_FIELDS = ("gate_up", "gate_up_scale", "down", "down_scale")

    def __init__(
        self,
        gate_up: torch.Tensor,
        gate_up_scale: torch.Tensor,
        down: torch.Tensor,
        down_scale: torch.Tensor,
    ) -> None:
        e, h, i = gate_up_dims(self.name, "gate_up", gate_up, "[E, 2I, H]")
        two_i = 2 * i
        self.gate_up = check_stored(self.name, "gate_up", gate_up, torch.int8, (e, two_i, h), "[E, 2I, H]")
        self.down = check_stored(self.name, "down", down, torch.int8, (e, h, i), "[E, H, I]")
        self.gate_up_scale = check_stored(
            self.name, "gate_up_scale", gate_up_scale, torch.float32, (e, two_i), "[E, 2I]"
        )
        self.down_scale = check_stored(self.name, "down_scale", down_scale, torch.float32, (e, h), "[E, H]")
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self._chunks = {"gate_up": row_chunks(0, two_i, h), "down": row_chunks(0, h, i)}

    @classmethod
    def from_dense(cls, gate_up: torch.Tensor, down: torch.Tensor) -> Int8Experts:
        """Quantize dense gate_up ``[E, 2I, H]`` and down ``[E, H, I]``, one expert at a time (bounded temporaries)."""
        e, h, i = check_dense(cls.name, gate_up, down)
        gu = torch.empty(e, 2 * i, h, dtype=torch.int8)
        dn = torch.empty(e, h, i, dtype=torch.int8)
        gu_s = torch.empty(e, 2 * i, dtype=torch.float32)
        dn_s = torch.empty(e, h, dtype=torch.float32)
        for x in range(e):
            quantize_rows(gate_up[x].detach(), gu[x], gu_s[x])
            quantize_rows(down[x].detach(), dn[x], dn_s[x])
        return cls(gu, gu_s, dn, dn_s)

    def _stored(self, proj: Projection) -> tuple[torch.Tensor, torch.Tensor]:
        """``proj``'s codes ``[E, D_out, D_in]`` int8 and row scales ``[E, D_out]`` fp32."""
        return (self.gate_up, self.gate_up_scale) if proj == "gate_up" else (self.down, self.down_scale)

    def _dequant_rows(self, proj: Projection, expert: int, r0: int, r1: int, out: torch.Tensor) -> None:
        codes, scale = self._stored(proj)
        # Two passes over cache-resident rows; a single mixed-dtype mul would first widen the codes into a
        # temporary on the CPU.
        out.copy_(codes[expert, r0:r1]).mul_(scale[expert, r0:r1, None])

    SCALED_TILE_DTYPES = (torch.bfloat16, torch.float32, torch.float64)  # hold every int8 code exactly

    def scaled_tile(
        self, proj: Projection, expert: int, dtype: torch.dtype, buf: torch.Tensor, rows: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes (|q| <= 127 needs 7 significant bits: exact in bf16) and their per-row fp32 scales."""
        assert dtype in self.SCALED_TILE_DTYPES
        codes, scale = self._stored(proj)
        return buf.copy_(codes[expert, rows]), scale[expert, rows]

    # per kernel variant, the fused kernel beats codes-then-GEMM up to here (bench/formats.py; docs/performance.md,
    # "Fused kernels")
    # AVX2 (fp32 compute): fused / torch CPU time int8 (fp32: the codes converted exactly, MKL sgemm) 1.62x at 8,
    # 1.09x at 128, 1.16x at 256, 0.96x at 512 rows per expert (an AVX2-only AMD EPYC, Zen 1, 1 thread, nothing
    # else running; docs/performance.md, "AVX2 variant"):
    # `python bench/formats.py --threads 1 --reps 3 --experts 8 --top-k 4 --tokens 16 64 256 512 1024 --formats int8
    # int4-g64 fp8_block mxfp4 --compute-dtype float32 --variant AVX2 --fused-max-rows 100000`
    FUSED_MAX_ROWS = MappingProxyType({"AMX-BF16": 128, "AVX512-BF16": 256, "AVX2": 256})

    def fused_operands(self, proj: Projection, expert: int) -> tuple[str, tuple[Any, ...]]:
        codes, scale = self._stored(proj)
        return "int8_gemm", (codes[expert], scale[expert])

    def fused_run_operands(self, proj: Projection) -> tuple[str, tuple[Any, ...]]:
        return "int8_gemm_run", self._stored(proj)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.gate_up, self.gate_up_scale, self.down, self.down_scale))

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.int8
