"""Dense expert weights (bf16, fp16, fp32 or fp64): stored as given, laid out once, never copied per step."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch

from moetune.engine.formats.base import FORMATS, ExpertFormat, Projection
from moetune.errors import EngineError

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# Weights stored in bf16, per kernel variant: experts with at most this many rows take the kernels' bf16_gemm
# (kernels/few_rows.h on AVX512-BF16: each weight read once per product, weights prefetched into L2). Per product
# 2-3.9x oneDNN's speed up to 24 rows, 1.2-1.35x at 32, 1.05-1.2x at 48, level at 64 (`python
# bench/bf16_products.py`); in the engine step, where a run of experts is one call and nothing is padded, fused /
# torch path (E = 128, `python bench/formats.py --experts 128 --tokens 512 1024 2048 --formats bf16
# --fused-max-rows N`): 48: 1.32x / 0.99x at T = 512 / 1024; 64: 1.36x / 1.07x; 96: 1.23x at T = 1024; 128: 1.19x /
# 1.02x at T = 1024 / 2048; 256: 1.26x / 1.04x (docs/performance.md, "Prefetching into L2"). Not measured against
# AMX's oneDNN GEMMs yet: no AMX-BF16 entry. AVX2 (fp32 compute; the weights widened to fp32 in registers, against
# the torch path's fp32 tiles and MKL's sgemm): fused / torch CPU time 1.32x at 8, 1.35x at 32, 1.15x at 128, 1.06x at
# 256, 0.99x at 512 rows per expert (an AVX2-only AMD EPYC, Zen 1, 1 thread; docs/performance.md, "AVX2 variant");
# on a Zen 3, with the forward on the backward's loops from 112 rows: 1.31x at 64, 1.06x at 128, 1.01x at 192, 0.89x
# at 256 (`python bench/formats.py --experts 32 --top-k 4 --tokens 512 1024 1536 2048 --fused-max-rows 100000`;
# docs/performance.md, "AVX2: the forward from 112 rows on the backward's loops"), so 192 for AVX2.
BF16_FUSED_MAX_ROWS = MappingProxyType({"AVX512-BF16": 256, "AVX2": 192})

# bf16 weight rows whose bytes are a multiple of ALIAS_BYTES are stored PAD_BYTES further apart (``row_stride``): the
# kernels' backward reads 64 rows at the same columns, and rows 4 KiB apart all fall in one L1 set (8 ways), so
# every block of 8 rows of g re-reads them from L2. [1536, 2048] per product, padded against contiguous: backward
# 1.06-1.18x at 1-128 rows, forward 0.81-0.99x (it prefers rows end to end); the engine step (E = 128, lora and
# frozen, T = 128-2048) 1.02-1.06x; rows of 2, 3, 14 KiB gain nothing, so they stay contiguous (AMD EPYC Zen 4;
# `python bench/row_padding.py`, docs/performance.md "Weight rows 4 KiB apart"). 1.6% more memory for those
# weights; the kernels and torch's GEMMs take the row stride.
ALIAS_BYTES = 4096
PAD_BYTES = 64


def row_stride(cols: int, dtype: torch.dtype) -> int:
    """Elements from one row of a ``[.., cols]`` weight in ``dtype`` to the next in ``DenseExperts.empty``'s layout:
    ``cols``, or ``cols`` and ``PAD_BYTES`` for bf16 rows whose bytes are a multiple of ``ALIAS_BYTES``."""
    if dtype != torch.bfloat16 or (cols * dtype.itemsize) % ALIAS_BYTES:
        return cols
    return cols + PAD_BYTES // dtype.itemsize


def _with_padding(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``[E, O, K]``, or, where it is a view of the first K columns of a contiguous ``[E, O, row_stride(K)]``
    tensor (``DenseExperts.empty``'s layout), that tensor."""
    e, o, k = t.shape
    ld = row_stride(k, t.dtype)
    if ld == k or t.stride() != (o * ld, ld, 1):
        return t
    end = (t.storage_offset() + e * o * ld) * t.element_size()
    if end > t.untyped_storage().nbytes():  # a view of a tensor that ends with its last row's K-th value
        return t
    return t.as_strided((e, o, ld), (o * ld, ld, 1))


def _rows_apart(t: torch.Tensor) -> bool:
    """``t`` ``[E, O, K]`` has contiguous rows, each expert's rows after the previous expert's (a row stride of at
    least K): contiguous, or ``DenseExperts.empty``'s padded layout."""
    e, o, k = t.shape
    return t.stride(2) == 1 and t.stride(1) >= k and t.stride(0) >= o * t.stride(1)


@FORMATS.register("dense")
class DenseExperts(ExpertFormat):
    """gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` held as they are (made contiguous once)."""

    name = "dense"
    STATE_FIELDS = ("gate_up", "down")

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        if gate_up.dim() != 3 or down.dim() != 3:
            raise EngineError(
                f"expert weights must be 3-D: gate_up [E, 2I, H] and down [E, H, I]; got "
                f"gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)}"
            )
        e, two_i, h = gate_up.shape
        if two_i % 2:
            raise EngineError(
                f"expert weights: gate_up {tuple(gate_up.shape)} is [E, 2I, H] (gate rows, then up rows), so its "
                f"second dimension must be even; got {two_i}"
            )
        if tuple(down.shape) != (e, h, two_i // 2):
            raise EngineError(
                f"expert weight shapes disagree: gate_up {tuple(gate_up.shape)} is [E, 2I, H], so down must be "
                f"[E, H, I] = {(e, h, two_i // 2)}; got {tuple(down.shape)}"
            )
        if gate_up.dtype not in _FLOAT_DTYPES or down.dtype != gate_up.dtype:
            raise EngineError(
                f"dense expert weights must share one float dtype of {[str(d) for d in _FLOAT_DTYPES]}; "
                f"got gate_up {gate_up.dtype}, down {down.dtype}"
            )
        if gate_up.device.type != "cpu" or down.device.type != "cpu":
            raise EngineError(f"expert weights must live in host memory; got device {gate_up.device}")
        # Laid out once: per-expert slices are views with contiguous rows (``empty``'s padded rows kept as they are).
        self.gate_up = gate_up if _rows_apart(gate_up) else gate_up.contiguous()
        self.down = down if _rows_apart(down) else down.contiguous()
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, two_i // 2
        # the kernels' bf16_gemm reads bf16 weights only (in the AVX2 variant: widened to fp32, fp32 compute)
        bf16 = self.gate_up.dtype == torch.bfloat16
        self.FUSED_MAX_ROWS = dict(BF16_FUSED_MAX_ROWS) if bf16 else {}  # (a dict: copy.deepcopy takes it)

    @staticmethod
    def empty(
        num_experts: int, intermediate_size: int, hidden_size: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Uninitialized gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` in ``dtype``, their rows ``row_stride`` apart
        (views of padded tensors where that differs from the row's length, the padding zeros): where a loader
        that fills weights for this format writes them."""

        def rows(o: int, k: int) -> torch.Tensor:
            full = torch.empty(num_experts, o, row_stride(k, dtype), dtype=dtype)
            full[:, :, k:].zero_()  # what a store writes between the rows (``state_tensors``)
            return full[:, :, :k]

        return rows(2 * intermediate_size, hidden_size), rows(hidden_size, intermediate_size)

    @classmethod
    def from_dense(cls, gate_up: torch.Tensor, down: torch.Tensor) -> DenseExperts:
        """The weights as given (the contract's common constructor; same as ``DenseExperts(gate_up, down)``)."""
        return cls(gate_up, down)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """gate_up and down as held: rows ``row_stride`` apart (``empty``'s layout) are given as the whole padded
        tensors ``[E, O, row_stride(K)]`` whose views they are (no copy), so a store keeps the layout and its
        mapping is used as it is; anything else as it is (a store then holds contiguous rows)."""
        return {name: _with_padding(t) for name, t in (("gate_up", self.gate_up), ("down", self.down))}

    @classmethod
    def from_state_tensors(cls, tensors: Mapping[str, torch.Tensor], **params: Any) -> ExpertFormat:
        """As every format's, and padded rows (``state_tensors``) taken as views of their first K columns: K =
        H for gate_up, I for down, read from the other tensor's shape. Each row's length must be K to K plus one
        ``PAD_BYTES`` line, whatever ``row_stride`` pads today (a store written under another rule still loads)."""
        views = dict(tensors)
        gate_up, down = views.get("gate_up"), views.get("down")
        if gate_up is not None and down is not None and gate_up.dim() == down.dim() == 3:
            for name, t, k in (("gate_up", gate_up, down.shape[1]), ("down", down, gate_up.shape[1] // 2)):
                most = k + PAD_BYTES // t.element_size()
                if not k <= t.shape[2] <= most:
                    raise EngineError(
                        f"{cls.name}.from_state_tensors: {name} {tuple(t.shape)} has rows of {t.shape[2]} values; "
                        f"with gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} they hold {k}, stored "
                        f"{k} to {most} apart"
                    )
                views[name] = t[:, :, :k]
        return super().from_state_tensors(views, **params)

    def _stored(self, proj: Projection) -> torch.Tensor:
        return self.gate_up if proj == "gate_up" else self.down

    def tile(
        self,
        proj: Projection,
        expert: int,
        dtype: torch.dtype,
        buf: torch.Tensor | None,
        rows: slice | None = None,
    ) -> torch.Tensor:
        w = self._stored(proj)[expert]
        if rows is not None:
            w = w[rows]
        if w.dtype == dtype:
            return w
        assert buf is not None, "caller must pass a buffer when a conversion is needed"
        return buf.copy_(w)

    def stored_in(self, proj: Projection, dtype: torch.dtype) -> torch.Tensor | None:
        w = self._stored(proj)
        return w if w.dtype == dtype else None

    def needs_buffer(self, dtype: torch.dtype) -> bool:
        return self.gate_up.dtype != dtype

    def fused_operands(self, proj: Projection, expert: int) -> tuple[str, tuple[Any, ...]]:
        return "bf16_gemm", (self._stored(proj)[expert],)

    def fused_run_operands(self, proj: Projection) -> tuple[str, tuple[Any, ...]]:
        return "bf16_gemm_run", (self._stored(proj),)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if out is None:
            return self.gate_up.to(dtype), self.down.to(dtype)
        return super().dequantize(dtype, out)

    @property
    def nbytes(self) -> int:  # padding included (``empty``)
        return sum(t.shape[0] * t.stride(0) * t.element_size() for t in (self.gate_up, self.down))

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.gate_up.dtype
