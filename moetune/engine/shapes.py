"""GEMMs over an expert's rows, split into row counts from a small fixed set.

Why: torch runs bf16 (and fp16) GEMMs on the CPU through oneDNN, which builds a kernel ("primitive") for
every distinct problem shape and keeps the last 1,024 in a cache. An expert's row count n changes with every
batch, and every GEMM of an expert has n as one of its dimensions, so nearly every call missed that cache:
building the kernel took about 1 ms (``ONEDNN_VERBOSE=all``: ``create:cache_miss``) against 0.1 ms to run a
``[300, 512] x [512, 512]`` product. Measured inside a LoRA training step this made the engine's GEMMs 3-10x
slower than the same GEMMs with repeated shapes (``docs/performance.md``, "GEMM shapes"). A fixed set of row
counts keeps the set of shapes small enough to stay cached.

``row_pieces(n)`` cuts n into ``ceil(n / 512)`` pieces whose GEMMs run on sizes from ``PIECE_SIZES`` (1-16,
32, 48, 64, then multiples of 32 up to 512: 33 sizes per GEMM form): pieces of 512 rows, then the tail, which
runs padded to the next size (its rows copied into zero-padded scratch, the result's real rows copied back):
at most 15 rows of padding for a tail of 17-64 rows, 31 for a longer one. Padding costs less than cutting
the tail into exact pieces, each of which reads the expert's weights again (a GEMM with tens of rows is bound
by reading its weights): measured with ``bench/gemm_shapes.py`` (E = 32, lora, fresh routing), pieces of
64-row multiples + 16-row multiples + the rest ran at 0.82x (T = 128) and 0.93x (T = 512) of whole-row GEMMs,
one padded tail at 1.09x and 1.31x. Row-wise products (``out = a @ b``) are exact per row whatever the pieces,
and zero rows add nothing to products that sum over the rows (``a^T @ b``, the LoRA and base gradients), which
add their pieces' products in the output's dtype (fp32 for gradients): each piece rounded to the compute
dtype once, summed in fp32.

fp32 and fp64 GEMMs run through BLAS (no per-shape kernels), so they are never split (``RowSplit.for_dtype``)
and keep their results bit for bit.

Where the compiled kernels load (``moetune.engine.kernels``), ``RowSplit.native`` runs each of these sequences,
and the LoRA and few-row GEMM sequences built on them, as one compiled call (``kernels/ops.h``) that releases the
GIL once instead of once per op: the same ops in the same order, so the same bits. The Python code here stays the
reference and the fallback (``MOETUNE_KERNELS=off``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch

from moetune.engine.kernels import fused_kernels, load_fused
from moetune.engine.workspace import thread_workspace

# 512 rows: larger pieces gained <= 10% on the layer shapes measured (H = 512 to 2048, AMX bf16), while every
# extra size is one more cached kernel per GEMM form; 32-row steps above 64, 16-row steps up to 64 (an AMX
# tile is 16 rows), exact below 16.
PIECE_SIZES: tuple[int, ...] = (*range(512, 64, -32), 64, 48, 32, *range(16, 0, -1))

Piece = tuple[int, int, int]  # r0, r1, rows the GEMM runs on (> r1 - r0: padded with zero rows)
Pieces = tuple[Piece, ...]


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step


@functools.lru_cache(maxsize=4096)
def row_pieces(n: int) -> Pieces:
    """``(r0, r1, rows)`` pieces covering ``[0, n)`` in order, ``rows`` in ``PIECE_SIZES`` (see the module
    docstring)."""
    out: list[Piece] = []
    r0 = 0
    while n - r0 >= 512:
        out.append((r0, r0 + 512, 512))
        r0 += 512
    if n > r0:
        tail = n - r0
        out.append((r0, n, tail if tail <= 16 else _round_up(tail, 16 if tail <= 64 else 32)))
    return tuple(out)


def padded_rows(t: torch.Tensor, piece: Piece, name: str) -> torch.Tensor:
    """Rows ``r0:r1`` of ``t [n, D]``: a view, or (padded piece) a copy in the calling thread's scratch ``name``
    ``[rows, D]`` whose extra rows are zero."""
    r0, r1, rows = piece
    if rows == r1 - r0:
        return t[r0:r1]
    buf = thread_workspace().get(name, (rows, t.shape[1]), t.dtype)
    buf[: r1 - r0].copy_(t[r0:r1])
    buf[r1 - r0 :].zero_()
    return buf


def native_ops_available() -> bool:
    """Whether the compiled op sequences (``kernels/ops.h``) run here: the kernels load and ``MOETUNE_KERNELS``
    does not turn them off (builds them on first use)."""
    return fused_kernels() is not None


@functools.cache
def native_ops() -> ModuleType:
    """The module with the compiled op sequences (any variant has them); only after ``native_ops_available``."""
    module = load_fused()
    assert module is not None, "native_ops() before native_ops_available()"
    return module


@dataclass(frozen=True)
class RowSplit:
    """Whether one engine's GEMMs split their rows (``row_pieces``) or run whole, and whether the op sequences run
    compiled (``native``, see the module docstring); resolved once per engine."""

    enabled: bool
    native: bool = False

    @staticmethod
    def for_dtype(compute_dtype: torch.dtype, native: bool | None = None) -> RowSplit:
        """Split where torch runs the GEMMs through oneDNN's per-shape kernels: bf16 and fp16. ``native``: None
        runs the sequences compiled wherever they load (``native_ops_available``)."""
        split = compute_dtype in (torch.bfloat16, torch.float16)
        return RowSplit(split, native_ops_available() if native is None else native)

    def pieces(self, n: int) -> Pieces:
        """The pieces of n rows: ``row_pieces(n)``, or the whole when not splitting."""
        return row_pieces(n) if self.enabled and n > 0 else ((0, n, n),)

    def mm(
        self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, beta: float = 0.0, alpha: float = 1.0
    ) -> None:
        """out ``[n, D]`` = beta * out + alpha * a ``[n, K]`` @ b ``[K, D]``, piece by piece of the n rows.

        beta 0 ignores out's old contents (NaN included), as ``addmm_`` does. A padded piece runs on scratch
        rows (out's rows copied in first when beta is not 0, so the sum is still formed inside the GEMM)."""
        if self.native:
            native_ops().split_mm(a, b, out, beta, alpha, self.enabled)
            return
        plain = beta == 0.0 and alpha == 1.0
        for piece in self.pieces(a.shape[0]):
            r0, r1, rows = piece
            a_p = padded_rows(a, piece, "split_a")
            if rows == r1 - r0:
                o = out[r0:r1]
            else:
                o = thread_workspace().get("split_out", (rows, out.shape[1]), out.dtype)
                if beta != 0.0:
                    o[: r1 - r0].copy_(out[r0:r1])  # the padding rows' old contents only reach padding rows
            if plain:
                torch.mm(a_p, b, out=o)
            else:
                o.addmm_(a_p, b, beta=beta, alpha=alpha)
            if rows != r1 - r0:
                out[r0:r1].copy_(o[: r1 - r0])

    def mm_t(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """out ``[P, D]`` (any dtype, may be a transposed view) = a ``[n, P]``^T @ b ``[n, D]``: the pieces' products
        in the compute dtype (padding rows are zero in both), written then added into out."""
        if self.native:
            native_ops().split_mm_t(a, b, out, self.enabled)
            return
        for i, piece in enumerate(self.pieces(a.shape[0])):
            part = padded_rows(a, piece, "split_a").t() @ padded_rows(b, piece, "split_b")
            out.copy_(part) if i == 0 else out.add_(part)
