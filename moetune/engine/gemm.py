"""One expert's base-weight GEMMs over any weight format, block by block of the weight's rows.

Every format hands out its per-expert matrices ``W_e`` (gate_up ``[2I, H]``, down ``[H, I]``) as tiles in the
compute dtype (``ExpertFormat.tile``). Dense weights stored in the compute dtype come as views; the others are
converted into a reused buffer a block of rows at a time, so the block stays in cache while its GEMM runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moetune.engine.formats import ExpertFormat
from moetune.engine.formats.base import Projection
from moetune.engine.workspace import thread_workspace

# Up to this many rows per expert, forward GEMMs take the weight block as their left operand (matmul_wt);
# backward keeps grad @ W, which measured faster at every n.
SMALL_ROWS = 128


class BlockedGemm:
    """``x @ W_e^T`` and ``g @ W_e`` for one layer's experts, in ``compute_dtype``.

    Args:
        weights: the layer's expert weights in any registered format.
        compute_dtype: the dtype the GEMMs run in (``resolve_compute_dtype``).

    Tile buffers and the transposed small-n result are the calling thread's scratch (``thread_workspace``), so
    experts may be multiplied in parallel threads.
    """

    def __init__(self, weights: ExpertFormat, compute_dtype: torch.dtype) -> None:
        self.weights = weights
        self.compute_dtype = compute_dtype
        # fp32/fp64 partial sums lose nothing, so backward may sum block by block (see matmul_w)
        self.exact_sums = compute_dtype in (torch.float32, torch.float64)

    def row_blocks(
        self, proj: Projection, e: int, n: int, whole: bool = False
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Expert e's ``proj`` matrix ``[D_out, D_in]`` as ``(r0, r1, W[r0:r1])`` blocks in the compute dtype.

        Stored in the compute dtype: one block, a view. Otherwise each block is converted into a reused buffer
        small enough to stay in cache while its GEMM with the expert's ``n`` rows runs: converting whole tiles
        wrote and re-read a full fp32 copy per expert, which at n = 16 made the GEMMs 2.2x slower (measured).
        Few rows are memory bound (small blocks); many rows want wider GEMMs (larger blocks). ``whole`` asks
        for one block (the whole matrix).
        """
        cd = self.compute_dtype
        d_out, d_in = self.weights.shape(proj)
        if not self.weights.needs_buffer(cd):
            yield 0, d_out, self.weights.tile(proj, e, cd, None)
            return
        align = self.weights.row_align(proj)
        step = d_out if whole else min(d_out, -(-(128 if n < 256 else 256) // align) * align)  # whole blocks
        buf = thread_workspace().get(f"tile_{proj}", (step, d_in), cd)
        for r0 in range(0, d_out, step):
            r1 = min(r0 + step, d_out)
            yield r0, r1, self.weights.tile(proj, e, cd, buf[: r1 - r0], rows=slice(r0, r1))

    def matmul_wt(
        self, proj: Projection, e: int, inp: torch.Tensor, out: torch.Tensor, accumulate: bool = False
    ) -> None:
        """out ``[n, D_out]`` = inp ``[n, D_in]`` @ W_e^T (``accumulate``: out +=), both in the compute dtype,
        block by block of W's rows (= out's columns).

        Few rows: computed as ``W_blk @ inp^T`` (``[R, n]``) then written transposed. MKL runs the weight as
        the left operand 1.3-3x faster for n <= 128 (measured: n = 16, 1.95 vs 3.84 ms per [1536, 2048] tile).
        ``accumulate`` lets a term already in ``out`` (the LoRA term) be added inside the GEMM (beta = 1)
        instead of in a separate pass over ``out``.
        """
        n = inp.shape[0]
        for r0, r1, w in self.row_blocks(proj, e, n):
            dst = out[:, r0:r1]
            if n <= SMALL_ROWS:
                tmp = thread_workspace().get("wt_tmp", (r1 - r0, n), inp.dtype)
                torch.mm(w, inp.t(), out=tmp)
                dst.add_(tmp.t()) if accumulate else dst.copy_(tmp.t())
            elif accumulate:
                dst.addmm_(inp, w.t())
            else:
                torch.mm(inp, w.t(), out=dst)

    def matmul_w(
        self, proj: Projection, e: int, grad: torch.Tensor, out: torch.Tensor, accumulate: bool = False
    ) -> None:
        """out ``[n, D_in]`` = grad ``[n, D_out]`` @ W_e (``accumulate``: out +=), both in the compute dtype,
        summed over blocks of W's rows.

        Partial sums land in ``out``'s dtype: blocks only where that is fp32/fp64; a bf16 compute dtype would
        round every partial sum to 8 bits, so it takes the whole matrix in one GEMM (fp32 accumulation inside).
        """
        # no weight-left form here: W^T @ grad^T measured 1.3-12x slower than grad @ W for n <= 24
        for r0, r1, w in self.row_blocks(proj, e, grad.shape[0], whole=not self.exact_sums):
            if r0 == 0 and not accumulate:
                torch.mm(grad[:, r0:r1], w, out=out)
            else:
                out.addmm_(grad[:, r0:r1], w)
