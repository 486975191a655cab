"""GEMMs over an expert's rows, split into row counts from a small fixed set.

Why: torch runs bf16 (and fp16) GEMMs on the CPU through oneDNN, which builds a kernel ("primitive") for
every distinct problem shape and keeps the last 1,024 in a cache. An expert's row count n changes with every
batch, and every GEMM of an expert has n as one of its dimensions, so nearly every call missed that cache:
building the kernel took about 1 ms (``ONEDNN_VERBOSE=all``: ``create:cache_miss``) against 0.1 ms to run a
``[300, 512] x [512, 512]`` product. Measured inside a LoRA training step this made the engine's GEMMs 3-10x
slower than the same GEMMs with repeated shapes (``docs/performance.md``, "GEMM shapes"). A fixed set of row
counts keeps the set of shapes small enough to stay cached.

``row_chunks(n)`` splits n greedily into sizes from ``CHUNK_SIZES`` (multiples of 64 up to 512, then 48,
32, 16, then 1-15): at most ``n // 512 + 3`` pieces, 26 sizes per GEMM form. Row-wise products (``out = a @ b``
with n rows) are exact per row whatever the split. Products that sum over the rows (``a^T @ b``, the LoRA and
base gradients) add the pieces' products in the output's dtype (fp32 for gradients): each piece rounded to
the compute dtype once, summed in fp32.

fp32 and fp64 GEMMs run through BLAS (no per-shape kernels), so they are never split (``RowSplit.for_dtype``)
and keep their results bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# 512 rows: larger pieces gained <= 10% on the layer shapes measured (H = 512 to 2048, AMX bf16), while every
# extra size is one more cached kernel per GEMM form; 64-row steps above 64, 16-row steps below (an AMX tile is
# 16 rows), and the tail exact.
CHUNK_SIZES: tuple[int, ...] = (*range(512, 0, -64), 48, 32, 16, *range(15, 0, -1))

Chunks = tuple[tuple[int, int], ...]


@functools.lru_cache(maxsize=4096)
def row_chunks(n: int) -> Chunks:
    """``(r0, r1)`` pieces covering ``[0, n)`` in order, each of a size in ``CHUNK_SIZES`` (largest first)."""
    out: list[tuple[int, int]] = []
    r0 = 0
    while r0 < n:
        size = next(s for s in CHUNK_SIZES if s <= n - r0)
        out.append((r0, r0 + size))
        r0 += size
    return tuple(out)


@dataclass(frozen=True)
class RowSplit:
    """Whether one engine's GEMMs split their rows (``row_chunks``) or run whole; resolved once per engine."""

    enabled: bool

    @staticmethod
    def for_dtype(compute_dtype: torch.dtype) -> RowSplit:
        """Split where torch runs the GEMMs through oneDNN's per-shape kernels: bf16 and fp16."""
        return RowSplit(compute_dtype in (torch.bfloat16, torch.float16))

    def chunks(self, n: int) -> Chunks:
        """The pieces of n rows: ``row_chunks(n)``, or the whole when not splitting."""
        return row_chunks(n) if self.enabled and n > 0 else ((0, n),)

    def mm(
        self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, beta: float = 0.0, alpha: float = 1.0
    ) -> None:
        """out ``[n, D]`` = beta * out + alpha * a ``[n, K]`` @ b ``[K, D]``, piece by piece of the n rows.

        beta 0 ignores out's old contents (NaN included), as ``addmm_`` does."""
        plain = beta == 0.0 and alpha == 1.0
        for r0, r1 in self.chunks(a.shape[0]):
            if plain:
                torch.mm(a[r0:r1], b, out=out[r0:r1])
            else:
                out[r0:r1].addmm_(a[r0:r1], b, beta=beta, alpha=alpha)

    def mm_t(self, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
        """out ``[P, D]`` (any dtype, may be a transposed view) = a ``[n, P]``^T @ b ``[n, D]``: the pieces' products
        in the compute dtype, written then added into out."""
        for i, (r0, r1) in enumerate(self.chunks(a.shape[0])):
            part = a[r0:r1].t() @ b[r0:r1]
            out.copy_(part) if i == 0 else out.add_(part)
