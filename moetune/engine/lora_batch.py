"""Every expert's LoRA terms of one pass at once, for experts that received few rows.

Why: a bf16 GEMM dispatched to oneDNN costs about 20-25 us however small it is (``[8, 2048] x [2048, 8]``: 21 us,
of which the arithmetic is nothing), and the per-expert LoRA path runs 4 rank-r products per expert forward and
8 backward plus 4 gradient products: at E = 128 and T = 128 (8 rows per expert) that alone was about 60 ms of a
460 ms forward + backward (``docs/performance.md``, "Small T"). Here each product runs once for all E experts as
one ``bmm`` over a padded ``[E, m, D]`` layout (about 5 us per expert: ``[128, 8, 2048] x [128, 2048, 8]`` in
0.65 ms against 3.2 ms as 128 calls), so the per-expert loop keeps only the base GEMMs.

Layout: expert e's rows (sorted order, ``Dispatch``) take slots ``e * m .. e * m + count_e`` of ``E * m``; m is a
row count from ``engine.shapes.PIECE_SIZES`` at least the largest batched expert's, so the bmm shapes stay in a small
fixed set (oneDNN builds a kernel per shape). Padding slots repeat a real row (finite values, never
uninitialised memory); they only ever reach padding slots of row-wise products, and every product that sums over
rows takes one operand through ``factor`` ``[E, m, 1]``, which is 0 on padding slots. Experts without rows get
all-padding slots: their LoRA grads come out exactly 0, as on the per-expert path.

Only for passes without LoRA dropout (its masks are drawn per expert) and while the padding stays bounded
(``LoraBatch.plan``); the per-expert ``LoraPass`` methods do everything else. Experts with more than m rows stay
per expert within a batched pass: all their slots are padding, the batch writes into their rows first and their
own terms, computed afterwards, replace them (``LoraPass`` writes its terms, it does not add them).

Same arithmetic as ``LoraPass``, in the compute dtype: the routing weight and the scaling are folded into the
``[E, m, r]`` operand of each gradient product (one rounding, as ``(g B) * w`` there) instead of scaling the fp32
gradient afterwards.
"""

from __future__ import annotations

import torch

from moetune.engine.formats.base import Projection
from moetune.engine.lora import LoraPass
from moetune.engine.routing import Dispatch
from moetune.engine.shapes import row_pieces
from moetune.engine.workspace import Workspace

# Most rows an expert may have to be batched. The per-expert LoRA products cost ~0.4 ms per expert in call
# overhead whatever n; the padded copies grow with m. Measured (E = 128, H = 2048, I = 768, r = 8, 1 thread,
# A/B in one process, bench/frozen.py --per-expert-lora): T = 128 (largest expert 14 rows) 1.16-1.18x faster
# batched; T = 512 with every expert batched (largest ~55 rows, m = 64) 0.98x, with the 71 experts of <= 32
# rows batched and the others per expert 1.05x.
MAX_BATCH_ROWS = 32
# Padded slots may be at most this many times the routed rows (E * m <= PAD_LIMIT * N): with many idle experts
# (E much larger than T * k) padding would copy mostly zeros. A slot costs a few KB of copies per wide operand,
# a batched expert saves ~0.4 ms of calls; the limit itself was not measured.
PAD_LIMIT = 8


Chunk = tuple[int, int, int, int]  # e0, e1: experts [e0, e1); r0, r1: their sorted rows


class LoraBatch:
    """The LoRA terms and gradients of one pass for all E experts, one ``bmm`` per product (module docstring).

    Every method works on one chunk of consecutive experts (``chunks``), so that with several threads the
    engine's expert pool runs the chunks side by side, each on one thread, as it runs experts: an OpenMP team
    over the whole bmm measured slower on this shared 2-core machine (0.90x of the per-expert path at E = 128,
    T = 128, 2 threads, load average ~5).

    Args:
        lora_pass: the pass's LoRA (A and B in the compute dtype, scaling; no dropout).
        disp: the pass's routing.
        rows: m, the padded rows per expert (``plan``).
        ws: where the padded operands, terms and gradient products go (the calling thread's workspace; default a
            new one): ``[E, m, D]`` buffers reused from pass to pass, each chunk writing only its experts' part.
            Fresh tensors of these sizes (7 MiB each at E = 128, m = 14, H = 2048) cost page faults on every pass
            (measured 1.025x at T = 128 and 1.048x at T = 512 for a LoRA step, E = 128, 1 thread). Names are per
            projection and role wherever two chunks could use one name with different shapes at once.
    """

    def __init__(self, lora_pass: LoraPass, disp: Dispatch, rows: int, ws: Workspace | None = None) -> None:
        assert lora_pass.seed is None, "dropout masks are per expert: the per-expert path takes them"
        self.lp, self.m = lora_pass, rows
        self.ws = ws if ws is not None else Workspace()
        e, m = len(disp.counts), rows
        # experts with more than m rows are left to the per-expert path: all their slots are padding
        self.large = [c > m for c in disp.counts]  # [E]
        counts = torch.tensor(disp.counts, dtype=torch.int64)  # [E]
        starts = torch.cumsum(counts, 0) - counts  # [E] first sorted row of each expert
        j = torch.arange(m, dtype=torch.int64)  # [m]
        real = (j < counts.unsqueeze(1)) & ~torch.tensor(self.large).unsqueeze(1)  # [E, m] bool
        n = int(counts.sum())
        # slot (e, j) reads sorted row starts[e] + j; a padding slot reads some real row (any finite values)
        self.gather = (
            torch.where(real, starts.unsqueeze(1) + j, 0).clamp_(max=max(n - 1, 0)).reshape(-1)
        )  # [E*m]
        # [N]: slot of each sorted row; a large expert's rows take any of its slots (the per-expert terms written
        # afterwards replace what unpad puts there)
        within = (torch.arange(n, dtype=torch.int64) - starts.repeat_interleave(counts)).clamp_(max=m - 1)
        self.scatter = (torch.arange(e, dtype=torch.int64) * m).repeat_interleave(counts) + within
        self.real = real.unsqueeze(2)  # [E, m, 1]
        self.num_experts = e
        self._row_starts = [*starts.tolist(), n]  # [E + 1]
        self._held: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}  # backward_input's results

    @staticmethod
    def plan(lora_pass: LoraPass | None, disp: Dispatch) -> int | None:
        """m for a batched pass (experts with more rows stay per expert), or None when the per-expert path should
        run for all: no LoRA, dropout, no expert with 1 to ``MAX_BATCH_ROWS`` rows, or more than ``PAD_LIMIT``
        padded slots per routed row."""
        if lora_pass is None or lora_pass.seed is not None or not lora_pass.split.enabled:
            return None
        few = [c for c in disp.counts if 0 < c <= MAX_BATCH_ROWS]
        if not few:
            return None
        m = row_pieces(max(few))[0][2]
        return m if len(disp.counts) * m <= PAD_LIMIT * sum(disp.counts) else None

    def chunks(self, parts: int) -> list[Chunk]:
        """The E experts cut into ``parts`` runs of consecutive experts (as equal as E allows)."""
        e, parts = self.num_experts, max(1, min(parts, self.num_experts))
        bounds = [e * p // parts for p in range(parts + 1)]
        return [(a, b, self._row_starts[a], self._row_starts[b]) for a, b in zip(bounds, bounds[1:])]

    def slots(self, name: str, chunk: Chunk, inner: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
        """The chunk's part ``[e1 - e0, *inner]`` of the workspace's ``[E, *inner]`` buffer ``name``: chunks run on
        the expert pool side by side, each in its own experts' part of one buffer."""
        e0, e1, _, _ = chunk
        return self.ws.get(f"lora_batch_{name}", (self.num_experts, *inner), dtype)[e0:e1]

    def pad(self, t: torch.Tensor, chunk: Chunk, name: str | None = None) -> torch.Tensor:
        """``[N, D]`` sorted rows -> the chunk's ``[e1 - e0, m, D]`` slots: into the workspace buffer ``name``
        (valid until the next pass asks for it), or a fresh tensor."""
        e0, e1, _, _ = chunk
        index = self.gather[e0 * self.m : e1 * self.m]
        if name is None:
            return t.index_select(0, index).view(e1 - e0, self.m, t.shape[1])
        out = self.slots(name, chunk, (self.m, t.shape[1]), t.dtype)
        torch.index_select(t, 0, index, out=out.view(-1, t.shape[1]))
        return out

    def unpad(self, slots: torch.Tensor, out: torch.Tensor, chunk: Chunk) -> None:
        """The chunk's ``[e1 - e0, m, D]`` slots -> their real rows, written into rows r0:r1 of out ``[N, D]``."""
        e0, _, r0, r1 = chunk
        index = self.scatter[r0:r1] - e0 * self.m
        torch.index_select(slots.reshape(-1, slots.shape[2]), 0, index, out=out[r0:r1])

    def _ab(self, proj: Projection, chunk: Chunk) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = self.lp._ab[proj]  # A [E, r, D_in], B [E, D_out, r], compute dtype
        return a[chunk[0] : chunk[1]], b[chunk[0] : chunk[1]]

    def forward(
        self, chunk: Chunk, proj: Projection, inp: torch.Tensor, out: torch.Tensor, a_out: torch.Tensor | None
    ) -> None:
        """out ``[N, D_out]`` = s (inp A_e^T) B_e^T for the chunk's sorted rows of inp ``[N, D_in]`` (written, not
        added: the base GEMMs then accumulate into it); the A-projection ``[N, r]`` into ``a_out`` when given."""
        a, b = self._ab(proj, chunk)
        xa = torch.bmm(self.pad(inp, chunk, f"{proj}_in"), a.transpose(1, 2))  # [e, m, r]
        term = self.slots("term", chunk, (self.m, b.shape[1]), out.dtype)  # [e, m, D_out]
        torch.baddbmm(term, xa, b.transpose(1, 2), beta=0.0, alpha=self.lp.lora.scaling, out=term)
        self.unpad(term, out, chunk)
        if a_out is not None:
            self.unpad(xa, a_out, chunk)

    def backward_input(self, chunk: Chunk, proj: Projection, g_out: torch.Tensor, g_in: torch.Tensor) -> None:
        """The LoRA term of the gradient at the projection's input, s (g_out B_e) A_e, written into the chunk's
        rows of g_in ``[N, D_in]`` (the base GEMMs then accumulate into it) for g_out ``[N, D_out]``. Holds what
        :meth:`backward_weights` takes (g_out's slots and g_out B_e ``[e, m, r]``)."""
        a, b = self._ab(proj, chunk)
        g_pad = self.pad(
            g_out, chunk, f"{proj}_out"
        )  # held: no other call writes this buffer before it is used
        gb = torch.bmm(g_pad, b)  # [e, m, r]
        term = self.slots("term", chunk, (self.m, a.shape[2]), g_in.dtype)  # [e, m, D_in]
        torch.baddbmm(term, gb, a, beta=0.0, alpha=self.lp.lora.scaling, out=term)
        self.unpad(term, g_in, chunk)
        self._held[(proj, chunk[0])] = (g_pad, gb)

    def backward_weights(
        self,
        chunk: Chunk,
        proj: Projection,
        inp: torch.Tensor,
        a_proj: torch.Tensor | None,
        w: torch.Tensor | None,
        grads: dict[str, torch.Tensor],
    ) -> None:
        """The chunk's experts' A and B grads written into ``grads`` (fp32, from ``LoraPass.new_grads``; its large
        experts' left to their per-expert terms), after
        :meth:`backward_input` on the same chunk, from the projection's input inp ``[N, D_in]``. The gradient at the
        output is unweighted for down (w ``[N, 1]`` the routing weights, applied here) and already weighted for
        gate_up (w None); a_proj ``[N, r]`` is inp's A-projection as forward computed it, or None to recompute it."""
        e0, e1, _, _ = chunk
        a, _ = self._ab(proj, chunk)
        s = self.lp.lora.scaling
        g_pad, gb = self._held.pop((proj, e0))
        x_pad = self.pad(inp, chunk, f"{proj}_in")  # [e, m, D_in]
        xa = torch.bmm(x_pad, a.transpose(1, 2)) if a_proj is None else self.pad(a_proj, chunk)  # [e, m, r]
        # 0 on padding slots, s (times the routing weight for down) on real ones: [e, m, 1]
        real = self.real[e0:e1]
        factor = real.to(gb.dtype) * s if w is None else self.pad(w, chunk) * real * s
        r, d_in, d_out = gb.shape[2], x_pad.shape[2], g_pad.shape[2]
        grad_a = self.slots(f"{proj}_grad_a", chunk, (r, d_in), gb.dtype)  # [e, r, D_in]
        torch.bmm((gb * factor).transpose(1, 2), x_pad, out=grad_a)
        # B's grad in B's own layout [e, D_out, r], so that adding it reads and writes both contiguously: the
        # [e, r, D_out] product added through a transposed view cost 1.8 ms against 0.5 (E = 128, D_out = 1536-2048,
        # r = 8, m = 14, one thread; the bmm itself 0.9-1.15x either way)
        grad_b = self.slots(f"{proj}_grad_b", chunk, (d_out, r), gb.dtype)  # [e, D_out, r]
        torch.bmm(g_pad.transpose(1, 2), xa * factor, out=grad_b)
        # written (converted to the grads' fp32), every expert but the large ones, whose per-expert grads come
        # before (down) or after (gate_up): new_grads leaves a batched pass's grads uninitialised. (Added to zeros
        # instead, the mixed-dtype add_ converted each product into a fresh fp32 temporary first: a zero fill and
        # a copy of 25 MB per step at E = 128, H = 2048, r = 8, most of it page faults.)
        for lo, hi in self._batched_within(e0, e1):
            grads[f"{proj}_A"][lo:hi].copy_(grad_a[lo - e0 : hi - e0])
            grads[f"{proj}_B"][lo:hi].copy_(grad_b[lo - e0 : hi - e0])

    def _batched_within(self, e0: int, e1: int) -> list[tuple[int, int]]:
        """The runs ``[a, b)`` of consecutive experts in ``[e0, e1)`` that are not large (the batch's own)."""
        runs: list[tuple[int, int]] = []
        for e in range(e0, e1):
            if self.large[e]:
                continue
            if runs and runs[-1][1] == e:
                runs[-1] = (runs[-1][0], e + 1)
            else:
                runs.append((e, e + 1))
        return runs
