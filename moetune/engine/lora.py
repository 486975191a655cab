"""Expert LoRA: per-expert low-rank updates of gate_up and down, in PEFT's ``target_parameters`` layout.

For expert ``e``: ``gate_up_e(x) = W1_e x + s * B1_e (A1_e drop(x))`` with A1 ``[E, r, H]``, B1 ``[E, 2I, r]``;
``down_e(h) = W2_e h + s * B2_e (A2_e drop(h))`` with A2 ``[E, r, I]``, B2 ``[E, H, r]``. ``s = alpha / r``
(rsLoRA: ``alpha / sqrt(r)``). The dense delta ``B @ A`` is never formed: the engine computes ``(x A^T) B^T``.
PEFT stores the same numbers as ``lora_A.weight = A.reshape(E * r, in)`` and
``lora_B.weight[o, j * E + e] = B[e, o, j]`` (see ``moetune.adapters.peft_layout``).

``ExpertLoRA`` holds the tensors; ``LoraPass`` is their forward and backward terms inside one engine pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moetune.engine.formats.base import Projection
from moetune.engine.routing import Segment, flat_segments
from moetune.engine.shapes import RowSplit, native_ops
from moetune.engine.workspace import Workspace
from moetune.errors import ConfigError, EngineError

LORA_NAMES = ("gate_up_A", "gate_up_B", "down_A", "down_B")


def lora_scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    if rank <= 0:
        raise ConfigError(f"lora_rank must be a positive integer; got {rank}")
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass
class ExpertLoRA:
    """The four LoRA tensors of one layer's experts (fp32 master weights; any float dtype is accepted).

    The tensors may be ``nn.Parameter`` objects owned by a module, or views of other parameters (PEFT's
    ``lora_A`` / ``lora_B``); the engine only reads them and returns gradients of the same shapes and layout.
    ``gate_up_rows`` (``[2I]`` int64) says which row of ``gate_up_B`` each of the engine's gate_up outputs
    (gate rows, then up rows) uses, for a module that orders its outputs otherwise; None: the same order. A
    permutation for gpt-oss (it interleaves gate and up); a tie for non-gated experts run on tied gate and up
    rows (``[0, I)`` twice, ``gate_up_B`` ``[E, I, r]``: the module's up projection, whose gradient is the sum over
    both uses). It lets ``gate_up_B`` stay a view of such a module's parameter.
    """

    gate_up_A: torch.Tensor  # [E, r, H]
    gate_up_B: torch.Tensor  # [E, 2I, r], or [E, R, r] with gate_up_rows [2I] indexing its R rows
    down_A: torch.Tensor  # [E, r, I]
    down_B: torch.Tensor  # [E, H, r]
    scaling: float
    dropout: float = 0.0
    gate_up_rows: torch.Tensor | None = None  # [2I] int64, a permutation

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora_dropout must be in [0, 1); got {self.dropout}")
        e, r, h = self.gate_up_A.shape
        b_rows = self.gate_up_B.shape[1]
        rows = self.gate_up_rows
        two_i = b_rows if rows is None else rows.shape[0]
        if rows is not None and (
            rows.dtype != torch.int64
            or rows.dim() != 1
            or two_i % 2
            or (two_i and not 0 <= int(rows.min()) <= int(rows.max()) < b_rows)
        ):
            raise EngineError(
                f"gate_up_rows must be [2I] int64 indices of gate_up_B's {b_rows} rows; got {tuple(rows.shape)} "
                f"{rows.dtype}"
            )
        want = {
            "gate_up_A": (e, r, h),
            "gate_up_B": (e, b_rows, r),
            "down_A": (e, r, two_i // 2),
            "down_B": (e, h, r),
        }
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise EngineError(
                    f"expert LoRA {name} must be {shape} (from gate_up_A {(e, r, h)}); got {got}"
                )

    @property
    def rank(self) -> int:
        return self.gate_up_A.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The four tensors in ``LORA_NAMES`` order."""
        return tuple(getattr(self, n) for n in LORA_NAMES)

    def astype(self, dtype: torch.dtype) -> ExpertLoRA:
        """A copy with the four tensors in ``dtype`` (same scaling and dropout)."""
        a1, b1, a2, b2 = (t.detach().to(dtype) for t in self.tensors())
        return ExpertLoRA(a1, b1, a2, b2, self.scaling, self.dropout, self.gate_up_rows)

    def check_shape(self, num_experts: int, hidden: int, intermediate: int) -> None:
        e, r, h = self.gate_up_A.shape
        i = self.down_A.shape[2]
        if (e, h, i) != (num_experts, hidden, intermediate):
            raise EngineError(
                f"expert LoRA is for E={e}, H={h}, I={i} but the expert weights are "
                f"E={num_experts}, H={hidden}, I={intermediate}"
            )

    @staticmethod
    def init(
        num_experts: int,
        hidden: int,
        intermediate: int,
        rank: int,
        alpha: float,
        *,
        dropout: float = 0.0,
        use_rslora: bool = False,
        dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ) -> ExpertLoRA:
        """PEFT's default initialisation: A kaiming-uniform (a = sqrt(5), fan_in = in), B zero.

        A is drawn as PEFT draws its ``[E * r, in]`` ``lora_A`` weight (bound ``1 / sqrt(in)``), so seeded runs
        give the same numbers PEFT would.
        """
        scaling = lora_scaling(rank, alpha, use_rslora)

        def kaiming(rows: int, fan_in: int) -> torch.Tensor:
            # kaiming_uniform_(a=sqrt(5)) has bound gain * sqrt(3 / fan_in) with gain = sqrt(2 / 6): 1/sqrt(fan_in)
            bound = 1.0 / math.sqrt(fan_in)
            return torch.empty(rows, fan_in, dtype=dtype).uniform_(-bound, bound, generator=generator)

        return ExpertLoRA(
            gate_up_A=kaiming(num_experts * rank, hidden).view(num_experts, rank, hidden),
            gate_up_B=torch.zeros(num_experts, 2 * intermediate, rank, dtype=dtype),
            down_A=kaiming(num_experts * rank, intermediate).view(num_experts, rank, intermediate),
            down_B=torch.zeros(num_experts, hidden, rank, dtype=dtype),
            scaling=scaling,
            dropout=dropout,
        )


def dropout_mask(
    seed: int, expert: int, proj: int, shape: tuple[int, ...], p: float, dtype: torch.dtype
) -> torch.Tensor:
    """The scaled keep-mask (``bernoulli(1 - p) / (1 - p)``) for one expert's rows, reproducible from ``seed``.

    Drawn from a generator seeded by (forward seed, expert, projection), so backward and recompute regenerate
    exactly the mask forward used without storing it.
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + expert * 2 + proj) % (2**63))
    mask = torch.empty(shape, dtype=dtype).bernoulli_(1.0 - p, generator=gen)
    return mask.div_(1.0 - p)


def dropout_seed(lora: ExpertLoRA, training: bool) -> int | None:
    """A fresh seed for one forward's dropout masks, or None when no dropout applies (eval, or p = 0).

    Drawn from the global RNG, so ``torch.manual_seed`` governs it.
    """
    if not training or lora.dropout == 0:
        return None
    return int(torch.randint(0, 2**62, (1,)).item())


class LoraPass:
    """The LoRA terms of one forward or backward (or backward's recompute), for any expert e.

    Holds A and B in the compute dtype (copied once per pass: the fp32 masters may change between passes; into
    ``ws`` when given, the calling thread's workspace, so they are valid only until the thread's next pass),
    the scaling ``s`` and the forward's dropout ``seed`` (None: no dropout). gate_up's B is held in the
    engine's row order (gate rows, then up rows: ``ExpertLoRA.gate_up_rows`` applied); the grads it forms are
    in that order too until :meth:`in_call_order`. Row counts below are the expert's n rows; ``D_in``/``D_out``
    are the projection's (gate_up: H -> 2I, down: I -> H).
    """

    def __init__(
        self,
        lora: ExpertLoRA,
        compute_dtype: torch.dtype,
        seed: int | None,
        split: RowSplit | None = None,
        ws: Workspace | None = None,
    ) -> None:
        self.lora = lora
        self.rank = lora.rank
        self.seed = seed
        # row counts from a fixed set (``engine.shapes``); default: where the compute dtype needs it
        self.split = split if split is not None else RowSplit.for_dtype(compute_dtype)
        a1, b1, a2, b2 = (t.detach() for t in lora.tensors())
        if lora.gate_up_rows is not None:  # into the engine's gate-rows-first order
            b1 = b1.index_select(1, lora.gate_up_rows)

        def operand(name: str, t: torch.Tensor) -> torch.Tensor:
            # contiguous: a call may pass strided views (PEFT's rank-major lora_B seen as [E, out, r]); every
            # expert's GEMMs then read unit-stride rows, and the copy is r / in of the base weights' size. Into the
            # workspace when given (reused): a fresh copy per pass measured 1.3-5.6 ms against ~1.2 ms reused
            # (E = 128, r = 8; page faults), and the copies live only while the pass runs
            if t.dtype == compute_dtype and t.is_contiguous():
                return t
            if ws is None:
                return t.to(compute_dtype).contiguous()
            return ws.get(f"lora_{name}", tuple(t.shape), compute_dtype).copy_(t)

        a1, b1, a2, b2 = (operand(n, t) for n, t in zip(LORA_NAMES, (a1, b1, a2, b2)))
        # gate_up: A [E, r, H], B [E, 2I, r]; down: A [E, r, I], B [E, H, r]
        self._ab: dict[Projection, tuple[torch.Tensor, torch.Tensor]]
        self._ab = {"gate_up": (a1, b1), "down": (a2, b2)}

    def _dropout(self, proj: Projection) -> tuple[int, float, int]:
        """The compiled calls' dropout arguments: this pass's seed (-1: none), p and the projection's mask index."""
        return (-1 if self.seed is None else self.seed), self.lora.dropout, int(proj == "down")

    def _mask(self, proj: Projection, e: int, inp: torch.Tensor) -> torch.Tensor | None:
        """The keep-mask ``[n, D_in]`` forward applied to expert e's input of ``proj``, or None."""
        if self.seed is None:
            return None
        return dropout_mask(self.seed, e, proj == "down", tuple(inp.shape), self.lora.dropout, inp.dtype)

    def forward_run(
        self,
        proj: Projection,
        segments: Sequence[Segment],
        inp: torch.Tensor,
        out: torch.Tensor,
        a_out: torch.Tensor,
    ) -> None:
        """:meth:`forward` for each ``(e, s0, s1)`` of ``segments`` on rows s0:s1 of inp ``[N, D_in]``, out
        ``[N, D_out]`` and a_out ``[N, r]``: one compiled call for them all (``engine.shapes``)."""
        if self.split.native:
            a, b = self._ab[proj]
            flat = flat_segments(segments)
            native_ops().lora_forward_run(
                inp, a, b, flat, out, a_out, self.lora.scaling, self.split.enabled, *self._dropout(proj)
            )
            return
        for e, s0, s1 in segments:
            self.forward(proj, e, inp[s0:s1], out[s0:s1], a_out[s0:s1])

    def forward(
        self, proj: Projection, e: int, inp: torch.Tensor, out: torch.Tensor, a_out: torch.Tensor
    ) -> None:
        """out ``[n, D_out]`` = s * drop(inp) A_e^T B_e^T for inp ``[n, D_in]`` (written, not added: the caller's
        base GEMM then accumulates into it, saving a pass over out); the A-projection drop(inp) A_e^T ``[n, r]``
        is written to ``a_out`` (backward reuses it under the retain policy). In Python, one expert: the reference
        of :meth:`forward_run`'s compiled call."""
        a, b = self._ab[proj]
        mask = self._mask(proj, e, inp)
        dropped = inp if mask is None else inp * mask
        self.split.mm(dropped, a[e].t(), a_out)
        self.split.mm(a_out, b[e].t(), out, alpha=self.lora.scaling)  # beta 0: out's old values are ignored

    def backward_run(
        self,
        proj: Projection,
        segments: Sequence[Segment],
        grads: dict[str, torch.Tensor],
        g_out: torch.Tensor,
        g_in: torch.Tensor,
        inp: torch.Tensor,
        a_proj: torch.Tensor | None,
        w: torch.Tensor | None,
        g_out_offset: int = 0,
    ) -> None:
        """:meth:`backward` for each ``(e, s0, s1)`` of ``segments`` (their grads into ``grads``) on rows s0:s1 of
        g_in, inp, a_proj and w (``[N, ...]``, sorted by expert) and rows ``s0 - g_out_offset : s1 - g_out_offset``
        of g_out (which may hold the run's rows alone): one compiled call for them all (``engine.shapes``)."""
        if self.split.native:
            a, b = self._ab[proj]
            flat = flat_segments(segments)
            ga, gb = grads[f"{proj}_A"], grads[f"{proj}_B"]
            native_ops().lora_backward_run(
                g_out,
                g_out_offset,
                g_in,
                inp,
                a_proj,
                w,
                a,
                b,
                flat,
                ga,
                gb,
                self.lora.scaling,
                self.split.enabled,
                *self._dropout(proj),
            )
            return
        for e, s0, s1 in segments:
            a_e = None if a_proj is None else a_proj[s0:s1]
            w_e = None if w is None else w[s0:s1]
            g = g_out[s0 - g_out_offset : s1 - g_out_offset]
            self.backward(proj, e, g, g_in[s0:s1], inp[s0:s1], a_e, w_e, grads)

    def backward(
        self,
        proj: Projection,
        e: int,
        g_out: torch.Tensor,
        g_in: torch.Tensor,
        inp: torch.Tensor,
        a_proj: torch.Tensor | None,
        w_e: torch.Tensor | None,
        grads: dict[str, torch.Tensor],
    ) -> None:
        """The LoRA part of one projection's backward for expert e, all in the compute dtype (in Python: the
        reference of :meth:`backward_run`'s compiled call).

        g_out ``[n, D_out]`` is the gradient at the projection's output: unweighted for down, with the routing
        weights w_e ``[n, 1]`` applied to the LoRA grads here; already weighted for gate_up (w_e None).
        Writes the LoRA term into g_in ``[n, D_in]``, the gradient at inp ``[n, D_in]`` (the caller's base GEMM
        then accumulates into it), and writes expert e's
        grads of A ``[r, D_in]`` and B ``[D_out, r]`` into ``grads`` (fp32, from ``new_grads``).
        ``a_proj`` ``[n, r]`` is drop(inp) A_e^T as forward computed it, or None to recompute it here.
        """
        s = self.lora.scaling
        a, b = self._ab[proj]
        n, split = g_out.shape[0], self.split
        gb = g_out.new_empty((n, self.rank))  # [n, r]
        split.mm(g_out, b[e], gb)
        mask = self._mask(proj, e, inp)
        dropped = inp if mask is None else inp * mask
        if mask is None:
            split.mm(gb, a[e], g_in, alpha=s)  # beta 0: g_in's old values are ignored
        else:  # the mask applies to the gradient flowing back into the input too
            split.mm(gb, a[e], g_in)
            g_in.mul_(mask).mul_(s)
        if a_proj is None:
            a_proj = inp.new_empty((n, self.rank))
            split.mm(dropped, a[e].t(), a_proj)
        if w_e is not None:
            gb = gb * w_e
            a_proj = a_proj * w_e
        split.mm_t(gb, dropped, grads[f"{proj}_A"][e])
        grads[f"{proj}_A"][e].mul_(s)
        # (a^T g)^T, not g^T a: MKL runs the [r, n] x [n, D] form ~9x faster than [D, n] x [n, r] here
        split.mm_t(a_proj, g_out, grads[f"{proj}_B"][e].t())
        grads[f"{proj}_B"][e].mul_(s)

    def new_grads(self, zeroed: bool) -> dict[str, torch.Tensor]:
        """Grads shaped like the four tensors in the engine's order (gate_up_B ``[E, 2I, r]``), keyed by
        ``LORA_NAMES``: fp32 at least (fp64 for fp64 LoRA), so that accumulating them over many micro-batches
        loses nothing. Zeroed, or (``zeroed`` False) left uninitialised for a pass that writes every expert's
        grads (a batched pass: ``LoraBatch.backward_weights`` and the per-expert terms of its large experts)."""
        (a1, b1), (a2, b2) = self._ab["gate_up"], self._ab["down"]
        new = torch.zeros if zeroed else torch.empty
        return {
            name: new(t.shape, dtype=torch.promote_types(p.dtype, torch.float32))
            for name, t, p in zip(LORA_NAMES, (a1, b1, a2, b2), self.lora.tensors())
        }

    def in_call_order(self, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``grads`` (from :meth:`backward`) with gate_up_B's ``[E, 2I, r]`` rows put back in the order and shape
        of the tensor the call passed (``ExpertLoRA.gate_up_rows``), so each grad matches its tensor's layout;
        a row the engine used twice (tied rows) gets the sum of both."""
        rows = self.lora.gate_up_rows
        if rows is None:
            return grads
        g = grads["gate_up_B"]  # [E, 2I, r], engine order: row j holds the grad of the call's row rows[j]
        call = torch.zeros((g.shape[0], self.lora.gate_up_B.shape[1], g.shape[2]), dtype=g.dtype)
        return {**grads, "gate_up_B": call.index_add_(1, rows, g)}
