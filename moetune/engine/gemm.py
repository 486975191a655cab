"""One expert's base-weight GEMMs over any weight format, block by block of the weight's rows.

Every format hands out its per-expert matrices ``W_e`` (gate_up ``[2I, H]``, down ``[H, I]``) in the compute
dtype. How, is one :class:`GemmPath`, resolved once per engine from the format, the compute dtype and the
CPU (``resolve_gemm_path``; ``moetune doctor`` prints it per format):

* ``view``: dense weights stored in the compute dtype, multiplied in place (no copy).
* ``scaled codes``: formats whose matrix is ``diag(row_scale) @ codes`` (int8), for experts with at most
  ``SMALL_ROWS`` rows, convert only the codes, in one exact pass, and apply the fp32 per-row scale to the GEMM's
  small side: forward scales its ``[n, D_out]`` output, backward its ``[n, D_out]`` input gradient.
  Dequantizing (convert, multiply, round) takes three passes over every weight; this is one. With more rows,
  scaling ``[n, D_out]`` in mixed bf16/fp32 costs more than it saves (measured 3.9 ms per [1024, 1536] vs
  0.04 ms at n = 64), so those experts take dequantized tiles.
* ``dequantized tiles``: the others (``ExpertFormat.tile``) write the effective weight in the compute dtype.

Before any of these, when the kernel variant that loads here computes in the compute dtype
(``KernelVariant.compute``: AMX-BF16 and AVX512-BF16 in bf16, AVX2 in fp32): experts with at most ``fused_rows``
rows (the format's ``FUSED_MAX_ROWS`` for that variant) go to the compiled kernels (``moetune.engine.kernels``:
int8, int4, fp8_block and mxfp4, which read the codes and dequantize them in registers: no converted tile is
written at all; and dense bf16 weights on AVX512-BF16, which the kernel reads once per product where oneDNN
re-lays them out on every call). Above that, and wherever the kernels are missing or turned off
(``MOETUNE_KERNELS=off``), the torch path above runs; it is the kernels' reference.

Converted weights come whole or in row blocks: on CPUs with AMX-BF16 a bf16 GEMM on a whole converted matrix
measured faster than on 128/256-row blocks, conversion included (int8, 16 experts of [1536, 2048], n = 64:
22 vs 43 ms); elsewhere row blocks small enough to stay in cache measured faster (an AVX512 EPYC, n = 16: 2.2x).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from types import ModuleType

import torch

from moetune.engine.formats import DenseExperts, ExpertFormat
from moetune.engine.formats.base import Projection
from moetune.engine.kernels import (
    KERNELS_ENV,
    VARIANTS,
    KernelVariant,
    a8_kernel,
    fused_kernels,
    int8_rows_formats,
    kernels_disabled,
    load_fused,
    load_variant,
    variant_named,
)
from moetune.engine.routing import Segment, flat_segments
from moetune.engine.shapes import RowSplit, native_ops, padded_rows
from moetune.engine.workspace import thread_workspace
from moetune.errors import EngineError
from moetune.sysinfo import CpuInfo, cpu_info

# Up to this many rows per expert, forward GEMMs take the weight block as their left operand (matmul_wt);
# backward keeps grad @ W, which measured faster at every n.
SMALL_ROWS = 128

Block = tuple[int, int, torch.Tensor, torch.Tensor | None]  # r0, r1, W-or-codes [r1 - r0, D_in], row scale


class Conversion(str, Enum):
    """How an engine's weights become GEMM operands (see the module docstring)."""

    VIEW = "view"
    SCALED_CODES = "scaled codes"
    DEQUANTIZED = "dequantized tiles"


@dataclass(frozen=True)
class GemmPath:
    """How one engine's GEMMs get their weights (see the module docstring).

    Attributes:
        conversion: views, scaled codes or dequantized tiles.
        whole_tiles: converted weights come one whole matrix at a time (else in cache-sized row blocks).
    """

    conversion: Conversion
    whole_tiles: bool
    # experts with at most this many rows take the fused kernels (0: none); the others take ``conversion``
    fused_rows: int = 0
    # the kernel variant they run on (``kernels.loader.VARIANTS``' name; "" when fused_rows is 0)
    fused_variant: str = ""
    # the weights are stored as floats (dense experts): the kernels widen them, there are no codes to dequantize
    dense: bool = False
    # the kernels multiply the codes with the activations as 16-bit integer rows (the variant's ``int16_rows``)
    int16_rows: bool = False
    # ... as 8-bit integer rows instead (the opt-in int8 activations: the variant's ``int8_rows``, its kernels
    # ``<kernel>_a8``)
    int8_rows: bool = False

    def kernel(self, name: str) -> str:
        """The name of the kernel this path calls for a format's kernel ``name`` (``fused_operands``' or its run
        form's): ``kernels.a8_kernel(name)`` with ``int8_rows``."""
        return a8_kernel(name) if self.int8_rows else name

    def describe(self) -> str:
        """One line for ``moetune doctor`` and the benchmarks."""
        if self.conversion is Conversion.VIEW:
            stored = "GEMMs on the stored weights (no conversion)"
            if not self.fused_rows:
                return stored
            return (
                f"experts with <= {self.fused_rows} rows: bf16 kernel ({self.fused_variant}, each weight read once "
                f"per product); more rows: {stored}"
            )
        size = "whole matrices" if self.whole_tiles else "cache-sized row blocks"
        what = (
            f"experts with <= {SMALL_ROWS} rows: codes converted exactly, per-row scale applied to the GEMM's "
            "output / input gradient; more rows: weights dequantized"
            if self.conversion is Conversion.SCALED_CODES
            else "weights dequantized"
        )
        if not self.fused_rows:
            return f"{what}, in {size}"
        if self.fused_rows >= SMALL_ROWS:  # scaled codes only served experts the kernels now take
            what = "weights dequantized"
        how = (
            "weights widened to fp32 in registers"
            if self.dense
            else "codes times the activations rounded to 8-bit integer rows (int8_activations), exact int32 sums"
            if self.int8_rows
            else "codes times the activations as 16-bit integer rows, exact int32 sums"
            if self.int16_rows
            else "codes dequantized in registers"
        )
        return (
            f"experts with <= {self.fused_rows} rows: fused kernel ({self.fused_variant}, {how}); "
            f"more rows: {what}, in {size}"
        )


def resolve_gemm_path(
    weights: ExpertFormat,
    compute_dtype: torch.dtype,
    cpu: CpuInfo | None = None,
    fused: bool = True,
    int8_rows: bool = False,
    exact: bool = False,
) -> GemmPath:
    """The GEMM path for ``weights`` computed in ``compute_dtype`` on ``cpu`` (default: this machine's).

    ``fused``: route few-row experts to the compiled kernels when the variant that loads here (building it on
    first use; ``kernels.fused_kernels``) computes in ``compute_dtype``, the format has a threshold for it and
    ``cpu`` has its ISA; False resolves the torch path alone. ``whole_tiles`` (the torch path's) depends on ``cpu`` alone.
    ``int8_rows`` (the int8 and int4 formats' ``int8_activations``): the few-row experts' products with the
    activations rounded to 8-bit integer rows, on the first variant that offers them for the format, runs here and
    computes in ``compute_dtype`` (AVX512-BF16, on AMX CPUs too; int4 in fp32: AVX2); ``EngineError`` saying why
    where none does.
    ``exact``: ``compute_dtype`` was asked for (a float32 / float64 load, ``EngineOptions.compute_dtype``), not
    resolved for the CPU: a format whose kernels here take the activations as 16-bit integer rows (the variant's
    ``int16_rows``: the AVX2 variant's int8, which computes in fp32 because the CPU has no bf16) keeps the torch
    path, which multiplies them unrounded in that dtype.
    """
    isa = (cpu or cpu_info()).isa
    kernels: ModuleType | None
    if int8_rows:
        kernels = int8_rows_kernels(weights, compute_dtype, isa, fused)
    else:
        kernels = fused_kernels() if fused and weights.FUSED_MAX_ROWS else None
    variant = str(kernels.variant) if kernels is not None else ""
    spec = variant_named(variant)
    fits = spec is not None and spec.compute == compute_dtype and spec.isa in isa
    rounds = spec is not None and weights.name in spec.int16_rows and not int8_rows
    limit = (int8_rows and weights.INT8_ROWS_MAX_ROWS.get(variant)) or weights.FUSED_MAX_ROWS.get(variant, 0)
    rows = limit if fits and not (exact and rounds) else 0
    variant = variant if rows else ""
    if not weights.needs_buffer(compute_dtype):
        return GemmPath(Conversion.VIEW, whole_tiles=True, fused_rows=rows, fused_variant=variant)
    scaled = compute_dtype in weights.SCALED_TILE_DTYPES
    conversion = Conversion.SCALED_CODES if scaled else Conversion.DEQUANTIZED
    bf16 = compute_dtype == torch.bfloat16
    dense = isinstance(weights, DenseExperts)
    int16 = bool(rows) and rounds
    return GemmPath(
        conversion,
        whole_tiles="AMX-BF16" in isa and bf16,
        fused_rows=rows,
        fused_variant=variant,
        dense=dense,
        int16_rows=int16,
        int8_rows=int8_rows,
    )


def _int8_rows_variants(name: str, compute_dtype: torch.dtype, isa: tuple[str, ...]) -> list[KernelVariant]:
    """The variants that compute ``name``'s products with 8-bit activation rows, run on ``isa`` and compute in
    ``compute_dtype``, best first."""
    return [v for v in VARIANTS if name in v.int8_rows and v.isa in isa and v.compute == compute_dtype]


def int8_rows_problem(name: str, compute_dtype: torch.dtype, isa: tuple[str, ...], fused: bool = True) -> str:
    """Why experts of format ``name`` cannot take 8-bit activation rows (``int8_activations``) computing in
    ``compute_dtype`` on a CPU with ``isa``, or "" when they can; builds nothing (the load's preflight asks it
    before any weight is read, ``resolve_gemm_path`` again when it builds an engine)."""
    offering = [v for v in VARIANTS if name in v.int8_rows]
    if not offering:
        return (
            f"int8_activations: no kernel variant computes {name!r} experts with 8-bit activations; "
            f"allowed: expert_format {', '.join(sorted(int8_rows_formats()))}"
        )
    off = "resolved without them" if not fused else kernels_disabled()
    if off:
        return (
            f"int8_activations needs the fused kernels, which are off ({off}); turn them on ({KERNELS_ENV}) or "
            "remove int8_activations"
        )
    if not _int8_rows_variants(name, compute_dtype, isa):
        return (
            "int8_activations needs the "
            + " or ".join(
                f"{v.name} kernels (a CPU with {v.isa}, computing in {v.compute})" for v in offering
            )
            + f"; this CPU has {', '.join(sorted(isa)) or 'none of them'} and computes in {compute_dtype}. "
            "Remove int8_activations"
            + (" (or load in bfloat16)" if compute_dtype != torch.bfloat16 and "AVX512-BF16" in isa else "")
        )
    return ""


def int8_rows_kernels(
    weights: ExpertFormat, compute_dtype: torch.dtype, isa: tuple[str, ...], fused: bool
) -> ModuleType:
    """The built variant that computes ``weights``' products with 8-bit integer rows here (resolve_gemm_path's
    ``int8_rows``), or ``EngineError`` naming what is missing."""
    why = int8_rows_problem(weights.name, compute_dtype, isa, fused)
    if why:
        raise EngineError(why)
    # EngineError saying why, where it does not build
    return load_variant(_int8_rows_variants(weights.name, compute_dtype, isa)[0].name)


class BlockedGemm:
    """``x @ W_e^T`` and ``g @ W_e`` for one layer's experts, in ``compute_dtype``.

    Args:
        weights: the layer's expert weights in any registered format.
        compute_dtype: the dtype the GEMMs run in (``resolve_compute_dtype``).
        path: how weights reach the GEMMs (default: ``resolve_gemm_path`` on this machine).
        split: whether GEMMs split their rows into fixed sizes (default: ``RowSplit.for_dtype``).
        int8_rows: the default path's kernels round the activations to 8-bit integer rows (``resolve_gemm_path``).
        exact: ``compute_dtype`` was asked for, not resolved for the CPU (``resolve_gemm_path``).

    Tile buffers and the transposed small-n result are the calling thread's scratch (``thread_workspace``), so
    experts may be multiplied in parallel threads.
    """

    def __init__(
        self,
        weights: ExpertFormat,
        compute_dtype: torch.dtype,
        path: GemmPath | None = None,
        split: RowSplit | None = None,
        int8_rows: bool = False,
        exact: bool = False,
    ) -> None:
        self.weights = weights
        self.compute_dtype = compute_dtype
        self.path = path or resolve_gemm_path(weights, compute_dtype, int8_rows=int8_rows, exact=exact)
        self._kernels: tuple[GemmPath, ModuleType] | None = None  # _kernels_for's cache
        # fp32/fp64 partial sums lose nothing, so backward may sum block by block (see matmul_w)
        self.exact_sums = compute_dtype in (torch.float32, torch.float64)
        # row counts from a fixed set (``engine.shapes``); default: where the compute dtype needs it
        self.split = split if split is not None else RowSplit.for_dtype(compute_dtype)
        # runs of experts take one compiled call (``run``): weights stored in the compute dtype, op sequences compiled
        self._native_runs = self.split.native and self.path.conversion is Conversion.VIEW

    def row_blocks(self, proj: Projection, e: int, n: int, whole: bool = False) -> Iterator[Block]:
        """Expert e's ``proj`` matrix ``[D_out, D_in]`` as ``(r0, r1, W, scale)`` blocks in the compute dtype:
        ``W[r0:r1]`` itself (scale None) or, on the scaled-codes path, its codes and fp32 row scales ``[R]``.

        Stored in the compute dtype: one block, a view. Scaled codes: for ``n <= SMALL_ROWS`` only. Otherwise
        each block is converted into a reused buffer: whole matrices on the ``whole_tiles`` path or when
        ``whole`` asks for one block; else blocks small enough to stay in cache while their GEMM with the
        expert's ``n`` rows runs (few rows are memory bound: small blocks; many rows want wider GEMMs: larger
        blocks).
        """
        cd = self.compute_dtype
        d_out, d_in = self.weights.shape(proj)
        if self.path.conversion is Conversion.VIEW:
            yield 0, d_out, self.weights.tile(proj, e, cd, None), None
            return
        align = self.weights.row_align(proj)
        if whole or self.path.whole_tiles:
            step = d_out
        else:  # whole blocks of the format's scales
            step = min(d_out, -(-(128 if n < 256 else 256) // align) * align)
        buf = thread_workspace().get(f"tile_{proj}", (step, d_in), cd)
        scaled = self.path.conversion is Conversion.SCALED_CODES and n <= SMALL_ROWS
        for r0 in range(0, d_out, step):
            r1 = min(r0 + step, d_out)
            rows = slice(r0, r1)
            if scaled:
                codes, scale = self.weights.scaled_tile(proj, e, cd, buf[: r1 - r0], rows)
                yield r0, r1, codes, scale
            else:
                yield r0, r1, self.weights.tile(proj, e, cd, buf[: r1 - r0], rows=rows), None

    def matmul_wt(
        self, proj: Projection, e: int, inp: torch.Tensor, out: torch.Tensor, accumulate: bool = False
    ) -> None:
        """out ``[n, D_out]`` = inp ``[n, D_in]`` @ W_e^T (``accumulate``: out +=), both in the compute dtype,
        block by block of W's rows (= out's columns).

        Few rows: computed as ``W_blk @ inp^T`` (``[R, n]``) then written transposed. MKL runs the weight as
        the left operand 1.3-3x faster for n <= 128 (measured: n = 16, 1.95 vs 3.84 ms per [1536, 2048] tile).
        ``accumulate`` lets a term already in ``out`` (the LoRA term) be added inside the GEMM (beta = 1)
        instead of in a separate pass over ``out``. Scaled codes: the GEMM's result times the fp32 row scale,
        rounded once into ``out`` (added to it when accumulating).
        """
        n = inp.shape[0]
        if 0 < n <= self.path.fused_rows:  # (no rows: nothing for a kernel to do, whatever the path)
            self._fused(True, proj, e, inp, out, accumulate)
            return
        for r0, r1, w, scale in self.row_blocks(proj, e, n):
            dst = out[:, r0:r1]
            if n > SMALL_ROWS:  # weights themselves (scaled codes only come with few rows)
                assert scale is None
                self.split.mm(inp, w.t(), dst, beta=1.0 if accumulate else 0.0)
                continue
            if self.split.native:  # the loop below as one compiled call (engine.shapes)
                native_ops().mm_wt(w, inp, dst, scale, accumulate, self.split.enabled)
                continue
            for piece in self.split.pieces(n):
                c0, c1, rows = piece
                tmp = thread_workspace().get("wt_tmp", (r1 - r0, rows), inp.dtype)
                torch.mm(w, padded_rows(inp, piece, "split_a").t(), out=tmp)
                res, d = tmp[:, : c1 - c0].t(), dst[c0:c1]  # [c, R]: the piece's real rows
                if scale is None:
                    d.add_(res) if accumulate else d.copy_(res)
                elif accumulate:
                    d.addcmul_(res, scale)
                else:
                    torch.mul(res, scale, out=d)

    def matmul_w(
        self, proj: Projection, e: int, grad: torch.Tensor, out: torch.Tensor, accumulate: bool = False
    ) -> None:
        """out ``[n, D_in]`` = grad ``[n, D_out]`` @ W_e (``accumulate``: out +=), both in the compute dtype,
        summed over blocks of W's rows.

        Partial sums land in ``out``'s dtype: blocks only where that is fp32/fp64; a bf16 compute dtype would
        round every partial sum to 8 bits, so it takes the whole matrix in one GEMM (fp32 accumulation inside).
        Scaled codes: ``(grad * row_scale) @ codes``, the scaled gradient rounded once to the compute dtype.
        """
        # no weight-left form here: W^T @ grad^T measured 1.3-12x slower than grad @ W for n <= 24
        n = grad.shape[0]
        if 0 < n <= self.path.fused_rows:  # (no rows: nothing for a kernel to do, whatever the path)
            self._fused(False, proj, e, grad, out, accumulate)
            return
        for r0, r1, w, scale in self.row_blocks(proj, e, n, whole=not self.exact_sums):
            g = grad[:, r0:r1]
            if scale is not None:
                g = torch.mul(g, scale, out=thread_workspace().get("w_scaled_grad", (n, r1 - r0), grad.dtype))
            self.split.mm(g, w, out, beta=0.0 if r0 == 0 and not accumulate else 1.0)

    def run(
        self,
        forward: bool,
        proj: Projection,
        segments: Sequence[Segment],
        inp: torch.Tensor,
        out: torch.Tensor,
        accumulate: bool,
        inp_offset: int = 0,
    ) -> None:
        """``matmul_wt`` (``forward``) or ``matmul_w`` of every expert of a run: for each ``(e, s0, s1)`` of
        ``segments``, rows s0:s1 of out ``[N, D]`` from rows ``s0 - inp_offset : s1 - inp_offset`` of inp. Weights
        stored in the compute dtype take one compiled call for the whole run (``kernels/ops.h``'s ``dense_run``: the
        same ops as the per-expert calls, one GIL hand-off), and so do the experts of a run that go to the fused
        kernels (``entry.h``'s ``<kernel>_run``); the others one call per expert."""
        fused = self.path.fused_rows
        if fused and self.split.native:  # the fused experts of the run: one call (entry.h's <kernel>_run)
            few = flat_segments(seg for seg in segments if seg[2] - seg[1] <= fused)
            if few:
                kernel, operands = self.weights.fused_run_operands(proj)
                run = getattr(self._kernels_for(self.path), self.path.kernel(kernel))
                run(forward, inp, inp_offset, out, few, *operands, accumulate)
            segments = [seg for seg in segments if seg[2] - seg[1] > fused]
        # asked on every call, never kept: a module may swap the tensors (full mode's nn.Parameters)
        stored = self.weights.stored_in(proj, self.compute_dtype) if self._native_runs else None
        if stored is not None:
            if segments:
                native_ops().dense_run(
                    forward,
                    stored,
                    inp,
                    inp_offset,
                    out,
                    flat_segments(segments),
                    accumulate,
                    SMALL_ROWS,
                    self.split.enabled,
                )
            return
        one = self.matmul_wt if forward else self.matmul_w
        for e, s0, s1 in segments:
            one(proj, e, inp[s0 - inp_offset : s1 - inp_offset], out[s0:s1], accumulate)

    def __getstate__(self) -> dict[str, object]:
        # a copy (copy.deepcopy of a model) resolves its kernels again: a module object cannot be copied
        return {**self.__dict__, "_kernels": None}

    def _kernels_for(self, path: GemmPath) -> ModuleType:
        """The built kernels of ``path.fused_variant``, resolved once per path (not on every GEMM: the loader
        takes a lock); ``EngineError`` when that variant does not compute in the compute dtype."""
        cached = self._kernels
        if cached is not None and cached[0] is path:
            return cached[1]
        variant = path.fused_variant
        spec = variant_named(variant)
        if spec is None or spec.compute != self.compute_dtype:  # a path pinned by hand (tests, benchmarks)
            raise EngineError(
                f"GemmPath.fused_rows = {path.fused_rows} needs a kernel variant computing in "
                f"{self.compute_dtype}; got variant {variant!r}"
                + (f" (computes in {spec.compute})" if spec is not None else "")
            )
        kernels = load_fused()
        if (
            kernels is None or kernels.variant != variant
        ):  # another variant than the default: build it by name
            kernels = load_variant(variant)
        self._kernels = (path, kernels)
        return kernels

    def _fused(
        self, forward: bool, proj: Projection, e: int, a: torch.Tensor, out: torch.Tensor, accumulate: bool
    ) -> None:
        """matmul_wt (``forward``) or matmul_w on the fused kernels of ``path.fused_variant``: a ``[n, D_in]`` or
        ``[n, D_out]``, out the other, in the compute dtype with contiguous rows (``a`` is made so; ``out`` is
        written in place, so it must be)."""
        kernels = self._kernels_for(self.path)
        assert out.stride(-1) == 1, "the fused kernels write rows of out in place"
        a = a if a.stride(-1) == 1 else a.contiguous()
        self.weights.fused_gemm(kernels, forward, proj, e, a, out, accumulate, int8_rows=self.path.int8_rows)
