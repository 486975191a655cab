"""Grouped routed-expert forward and backward on the CPU, over any weight format, expert LoRA included.

For a batch of T tokens routed to k of E experts:

    y[t] = sum_j w[t, j] * FFN_e(x[t]),  e = ids[t, j]
    FFN_e(x) = D_e(act(G_e x, U_e x)),   each projection = base weight (+ bias) (+ LoRA term)

Rows are sorted by expert once (``routing.dispatch``) so every expert's GEMMs run on contiguous views of
scratch buffers reused across steps. Backward returns grad_x ``[T, H]``, grad_topk_weights ``[T, k]`` (the
router's gradient), fp32 expert-LoRA gradients and, in full mode, base weight gradients.

Each forward that will be differentiated returns a :class:`SavedForward`; its backward consumes it once
and computes with the LoRA that forward used (the engine's own, or the one the call passed).
Using it twice, on another engine, or after the trained weights changed in place raises
:class:`EngineStateError` instead of computing with stale activations.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import torch

from moetune.config.experts import ActivationPolicy
from moetune.engine.activations import GluActivation, get_activation
from moetune.engine.formats import DenseExperts, ExpertFormat
from moetune.engine.formats.base import Projection
from moetune.engine.lora import LORA_NAMES, ExpertLoRA, dropout_mask
from moetune.engine.routing import (
    Dispatch,
    combine,
    dispatch,
    gather_sorted,
    sorted_weights,
    sum_slots,
    to_slots,
    validate_routing,
)
from moetune.engine.workspace import Workspace
from moetune.errors import EngineError, EngineStateError, NonFiniteError
from moetune.sysinfo import cpu_info, default_num_threads


class TrainMode(str, Enum):
    """What backward differentiates besides x and the routing weights (resolved once, at construction)."""

    FROZEN = "frozen"  # nothing else: the cheapest backward (a call may still pass LoRA to train)
    LORA = "lora"  # the engine's own expert LoRA A/B
    FULL = "full"  # base expert weights (and biases), plus LoRA when present


@dataclass(frozen=True)
class EngineOptions:
    """Engine settings. ``compute_dtype=None`` picks per machine (see ``resolve_compute_dtype``)."""

    policy: ActivationPolicy = ActivationPolicy.RETAIN
    compute_dtype: torch.dtype | None = None
    num_threads: int | None = None  # None: physical cores visible to the process
    check_finite: bool = False  # debug: raise NonFiniteError naming the tensor and expert


def resolve_compute_dtype(storage: torch.dtype, requested: torch.dtype | None = None) -> torch.dtype:
    """The dtype GEMMs run in.

    fp32/fp64 weights compute as stored. bf16 weights, and quantized ones (1-byte storage: int8, packed
    int4 as uint8, fp8), compute in bf16 only where the CPU has bf16 dot products (AMX-BF16 or
    AVX512-BF16); elsewhere oneDNN emulates bf16 and fp32 GEMMs on tiles converted into reused buffers are
    faster (measured 6x on an AVX2-only EPYC: 0.015 vs 0.09 TFLOP/s). fp16 computes in fp32.
    """
    if requested is not None:
        return requested
    if storage in (torch.float32, torch.float64):
        return storage
    dequantized_like_bf16 = storage == torch.bfloat16 or storage.itemsize == 1
    if dequantized_like_bf16 and cpu_info().native_bf16_gemm:
        return torch.bfloat16
    return torch.float32


@dataclass(eq=False)
class SavedForward:
    """What one forward hands its backward. Consumed exactly once."""

    engine_id: int
    index: int  # the engine's forward counter, for messages
    x: torch.Tensor  # [T, H] compute dtype
    x_dtype: torch.dtype  # dtype of the caller's x: grad_x is returned in it
    topk_ids: torch.Tensor  # [T, k] int64
    topk_weights: torch.Tensor  # [T, k]
    seed: int | None  # LoRA dropout seed (masks are regenerated, not stored)
    versions: tuple[int, ...]  # in-place versions of the trained tensors at forward time
    lora: ExpertLoRA | None = None  # the expert LoRA this forward computed with; its backward uses the same
    disp: Dispatch | None = None  # retain only
    gate_up: torch.Tensor | None = None  # [N, 2I], retain only
    lora_xa: torch.Tensor | None = None  # [N, r], retain + LoRA only
    lora_ha: torch.Tensor | None = None  # [N, r], retain + LoRA only
    consumed: bool = field(default=False)

    TENSOR_FIELDS = ("x", "topk_ids", "topk_weights", "gate_up", "lora_xa", "lora_ha")

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The large tensors, in ``TENSOR_FIELDS`` order (for ``ctx.save_for_backward``)."""
        return tuple(getattr(self, f) for f in self.TENSOR_FIELDS)

    def with_tensors(self, tensors: tuple[torch.Tensor | None, ...]) -> SavedForward:
        """A fresh, unconsumed copy holding ``tensors`` (as returned by ``ctx.saved_tensors``)."""
        fields: dict[str, Any] = dict(zip(self.TENSOR_FIELDS, tensors))
        return replace(self, consumed=False, **fields)

    @property
    def nbytes(self) -> int:
        """Bytes held for backward (inputs included)."""
        held = [self.x, self.topk_ids, self.topk_weights, self.gate_up, self.lora_xa, self.lora_ha]
        total = sum(t.nbytes for t in held if t is not None)
        return total + (self.disp.nbytes if self.disp is not None else 0)


@dataclass
class ExpertGrads:
    """Backward's results. ``lora`` is fp32 (fp64 for fp64 LoRA), keyed by ``LORA_NAMES``; ``base`` only in full mode."""

    x: torch.Tensor  # [T, H], dtype of x
    topk_weights: torch.Tensor  # [T, k], dtype of topk_weights
    lora: dict[str, torch.Tensor] | None = None
    base: dict[str, torch.Tensor] | None = None  # gate_up [E, 2I, H], down [E, H, I], biases if present

    def flat(self) -> tuple[torch.Tensor, ...]:
        """Grads in ``ExpertEngine.trained_tensors`` order."""
        out: tuple[torch.Tensor, ...] = tuple(self.lora[n] for n in LORA_NAMES) if self.lora else ()
        if self.base:
            out += tuple(
                self.base[n] for n in ("gate_up", "down", "gate_up_bias", "down_bias") if n in self.base
            )
        return out


_engine_ids = itertools.count()

# Up to this many rows per expert, forward GEMMs take the weight block as their left operand (_matmul_wt);
# backward keeps grad @ W, which measured faster at every n.
SMALL_ROWS = 128


class ExpertEngine:
    """One MoE layer's routed experts in host memory, with forward and backward.

    Args:
        weights: the expert weights in any registered format.
        activation: a registered activation name (``"silu"``, ``"gpt_oss"``, ...) or an instance.
        gate_up_bias: ``[E, 2I]`` or None. down_bias: ``[E, H]`` or None.
        lora: expert LoRA tensors, or None: what calls that pass no ``lora`` of their own compute with.
        train_base: full mode, differentiate the base weights (dense formats only).
        options: policy, compute dtype, threads, finiteness checks.
    """

    def __init__(
        self,
        weights: ExpertFormat,
        *,
        activation: str | GluActivation = "silu",
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        lora: ExpertLoRA | None = None,
        train_base: bool = False,
        options: EngineOptions | None = None,
        name: str = "experts",
    ) -> None:
        self.weights = weights
        self.name = name
        self.options = options or EngineOptions()
        self.act = get_activation(activation) if isinstance(activation, str) else activation
        e, h, i = weights.num_experts, weights.hidden_size, weights.intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        for bias, shape, label in (
            (gate_up_bias, (e, 2 * i), "gate_up_bias"),
            (down_bias, (e, h), "down_bias"),
        ):
            if bias is not None and tuple(bias.shape) != shape:
                raise EngineError(f"{label} must be {shape}; got {tuple(bias.shape)}")
        self.gate_up_bias, self.down_bias = gate_up_bias, down_bias
        if lora is not None:
            lora.check_shape(e, h, i)
        self.lora = lora
        if train_base and not isinstance(weights, DenseExperts):
            raise EngineError(
                f"full mode trains the base expert weights, which needs a dense format; got {weights.name!r}. "
                "Train LoRA on quantized experts instead."
            )
        self.mode = (
            TrainMode.FULL if train_base else (TrainMode.LORA if lora is not None else TrainMode.FROZEN)
        )
        self.compute_dtype = resolve_compute_dtype(weights.storage_dtype, self.options.compute_dtype)
        threads = self.options.num_threads or default_num_threads()
        if threads < 1:
            raise EngineError(f"num_threads must be >= 1; got {threads}")
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)  # process-wide: the engine's GEMMs use torch's intra-op pool
        self.num_threads = threads
        self._id = next(_engine_ids)
        self._forwards = 0
        self.ws = Workspace()

    # ---- helpers shared by forward, recompute and backward
    def call_lora(self, lora: ExpertLoRA | None = None) -> ExpertLoRA | None:
        """The expert LoRA a call computes with: its own ``lora`` (checked against the weights), else the engine's."""
        if lora is None:
            return self.lora
        lora.check_shape(self.num_experts, self.hidden_size, self.intermediate_size)
        return lora

    def trained_tensors(self, lora: ExpertLoRA | None = None) -> tuple[torch.Tensor, ...]:
        """The tensors backward differentiates besides x and w, for a call with ``lora`` (None: the engine's):
        LoRA (``LORA_NAMES`` order), then in full mode gate_up, down and the biases present.
        ``ExpertGrads.flat`` returns their grads in this order."""
        lora = self.call_lora(lora)
        out: tuple[torch.Tensor, ...] = lora.tensors() if lora is not None else ()
        if self.mode is TrainMode.FULL:
            assert isinstance(self.weights, DenseExperts)
            out += (self.weights.gate_up, self.weights.down)
            out += tuple(b for b in (self.gate_up_bias, self.down_bias) if b is not None)
        return out

    def _lora_c(self, lora: ExpertLoRA) -> tuple[torch.Tensor, ...]:
        # contiguous: a call may pass strided views (PEFT's rank-major lora_B seen as [E, out, r]); every
        # expert's GEMMs then read unit-stride rows, and the copy is r / in of the base weights' size
        a1, b1, a2, b2 = (t.detach() for t in lora.tensors())
        if lora.gate_up_rows is not None:  # into the engine's gate-rows-first order
            b1 = b1.index_select(1, lora.gate_up_rows)
        return tuple(t.to(self.compute_dtype).contiguous() for t in (a1, b1, a2, b2))

    def _row_blocks(
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
        buf = self.ws.get(f"tile_{proj}", (step, d_in), cd)
        for r0 in range(0, d_out, step):
            r1 = min(r0 + step, d_out)
            yield r0, r1, self.weights.tile(proj, e, cd, buf[: r1 - r0], rows=slice(r0, r1))

    def _matmul_wt(self, proj: Projection, e: int, inp: torch.Tensor, out: torch.Tensor) -> None:
        """out ``[n, D_out]`` = inp ``[n, D_in]`` @ W_e^T, block by block of W's rows (= out's columns).

        Few rows: computed as ``W_blk @ inp^T`` (``[R, n]``) then written transposed. MKL runs the weight as
        the left operand 1.3-3x faster for n <= 128 (measured: n = 16, 1.95 vs 3.84 ms per [1536, 2048] tile).
        """
        n = inp.shape[0]
        for r0, r1, w in self._row_blocks(proj, e, n):
            if n <= SMALL_ROWS:
                tmp = self.ws.get("wt_tmp", (r1 - r0, n), inp.dtype)
                torch.mm(w, inp.t(), out=tmp)
                out[:, r0:r1].copy_(tmp.t())
            else:
                torch.mm(inp, w.t(), out=out[:, r0:r1])

    def _matmul_w(self, proj: Projection, e: int, grad: torch.Tensor, out: torch.Tensor) -> None:
        """out ``[n, D_in]`` = grad ``[n, D_out]`` @ W_e, summed over blocks of W's rows.

        Partial sums land in ``out``'s dtype: blocks only where that is fp32/fp64; a bf16 compute dtype would
        round every partial sum to 8 bits, so it takes the whole matrix in one GEMM (fp32 accumulation inside).
        """
        exact_sums = self.compute_dtype in (torch.float32, torch.float64)
        # no weight-left form here: W^T @ grad^T measured 1.3-12x slower than grad @ W for n <= 24
        for r0, r1, w in self._row_blocks(proj, e, grad.shape[0], whole=not exact_sums):
            if r0 == 0:
                torch.mm(grad[:, r0:r1], w, out=out)
            else:
                out.addmm_(grad[:, r0:r1], w)

    def _bias(self, bias: torch.Tensor | None, e: int) -> torch.Tensor | None:
        return None if bias is None else bias[e].detach().to(self.compute_dtype)

    def _project(
        self,
        proj: Projection,
        e: int,
        inp: torch.Tensor,
        out: torch.Tensor,
        lora_out: torch.Tensor | None,
        lora: ExpertLoRA | None,
        lora_c: tuple[torch.Tensor, ...] | None,
        seed: int | None,
    ) -> None:
        """out ``[n, D_out]`` = inp ``[n, D_in]`` @ W_e^T (+ bias) (+ s * drop(inp) A_e^T B_e^T; A-part to lora_out)."""
        self._matmul_wt(proj, e, inp, out)
        bias = self._bias(self.gate_up_bias if proj == "gate_up" else self.down_bias, e)
        if bias is not None:
            out.add_(bias)
        if lora_c is not None:
            assert lora is not None and lora_out is not None
            a, b = lora_c[0:2] if proj == "gate_up" else lora_c[2:4]
            dropped = self._dropped(inp, seed, e, proj, lora.dropout)
            torch.mm(dropped, a[e].t(), out=lora_out)
            out.addmm_(lora_out, b[e].t(), alpha=lora.scaling)

    def _dropped(
        self, inp: torch.Tensor, seed: int | None, e: int, proj: Projection, p: float
    ) -> torch.Tensor:
        if seed is None:
            return inp
        return inp * dropout_mask(seed, e, proj == "down", tuple(inp.shape), p, inp.dtype)

    def _check_finite(self, what: str, t: torch.Tensor, disp: Dispatch | None = None) -> None:
        if not self.options.check_finite:
            return
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            row = int(bad.reshape(t.shape[0], -1).any(dim=1).nonzero()[0, 0]) if t.dim() else 0
            where = ""
            if disp is not None:
                expert = next(e for e, s0, s1 in disp.segments() if s0 <= row < s1)
                where = f", row {row} routed to expert {expert}"
            raise NonFiniteError(f"{self.name}: non-finite value in {what}{where}")

    def _validate(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise EngineError(
                f"{self.name}: x must be [T, H] with H = {self.hidden_size}; got {tuple(x.shape)}"
            )
        if not x.is_floating_point():
            raise EngineError(f"{self.name}: x must be floating point; got {x.dtype}")
        for t, label in ((x, "x"), (topk_ids, "topk_ids"), (topk_weights, "topk_weights")):
            if t.device.type != "cpu":
                raise EngineError(f"{self.name}: {label} must be on the CPU; got {t.device}")
        validate_routing(topk_ids, topk_weights, x.shape[0], self.num_experts)

    # ---- forward
    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        save: bool = True,
        training: bool = True,
        lora: ExpertLoRA | None = None,
    ) -> tuple[torch.Tensor, SavedForward | None]:
        """x ``[T, H]``, topk_ids ``[T, k]`` int64, topk_weights ``[T, k]`` -> y ``[T, H]`` (dtype of x).

        With ``save`` (the default) also returns what backward needs; ``save=False`` keeps nothing.
        ``training`` turns LoRA dropout on (as ``nn.Dropout`` does in train mode). ``lora``: this call's
        expert LoRA instead of the engine's own (a PEFT layer passes its active adapter's tensors).
        """
        lora = self.call_lora(lora)
        self._validate(x, topk_ids, topk_weights)
        cd, e_, h, i = self.compute_dtype, self.num_experts, self.hidden_size, self.intermediate_size
        self._check_finite("x", x)
        xc = x.detach().to(cd)
        disp = dispatch(topk_ids, e_)
        t, k = topk_ids.shape
        n = t * k
        retain = save and self.options.policy is ActivationPolicy.RETAIN
        lora_c = self._lora_c(lora) if lora is not None else None
        r = lora.rank if lora is not None else 0
        seed = None
        if training and lora is not None and lora.dropout > 0:
            seed = int(
                torch.randint(0, 2**62, (1,)).item()
            )  # from the global RNG, so torch.manual_seed governs it

        xs = gather_sorted(xc, disp, self.ws.get("xs", (n, h), cd))
        gu = torch.empty(n, 2 * i, dtype=cd) if retain else self.ws.get("gu", (n, 2 * i), cd)
        hid = self.ws.get("h", (n, i), cd)
        ys = self.ws.get("ys", (n, h), cd)
        xa = torch.empty(n, r, dtype=cd) if retain else self.ws.get("xa", (n, r), cd)
        ha = torch.empty(n, r, dtype=cd) if retain else self.ws.get("ha", (n, r), cd)
        for e, s0, s1 in disp.segments():
            self._project("gate_up", e, xs[s0:s1], gu[s0:s1], xa[s0:s1], lora, lora_c, seed)
            self.act(gu[s0:s1], out=hid[s0:s1])
            self._project("down", e, hid[s0:s1], ys[s0:s1], ha[s0:s1], lora, lora_c, seed)
        self._check_finite("expert outputs", ys, disp)
        y = combine(ys, disp, topk_weights, self.ws.get("slots", (n, h), cd)).to(x.dtype)

        self._forwards += 1
        if not save:
            return y, None
        saved = SavedForward(
            engine_id=self._id,
            index=self._forwards,
            x=xc,
            x_dtype=x.dtype,
            topk_ids=topk_ids,
            topk_weights=topk_weights.detach(),
            seed=seed,
            versions=tuple(p._version for p in self.trained_tensors(lora)),
            lora=lora,
        )
        if retain:
            saved.disp, saved.gate_up = disp, gu
            if lora is not None:
                saved.lora_xa, saved.lora_ha = xa, ha
        return y, saved

    # ---- backward
    def _check_saved(self, saved: SavedForward | None) -> None:
        if not isinstance(saved, SavedForward):
            raise EngineStateError(
                f"{self.name}: backward needs the SavedForward that forward returned; got {type(saved).__name__}"
            )
        if saved.engine_id != self._id:
            raise EngineStateError(
                f"{self.name}: this saved forward was made by another engine (layer); pass it to that one"
            )
        if saved.consumed:
            raise EngineStateError(
                f"{self.name}: backward already ran for forward #{saved.index}; each forward can be differentiated once "
                "(run the forward again, or retain_graph is not supported by the expert engine)"
            )
        if saved.versions != tuple(p._version for p in self.trained_tensors(saved.lora)):
            raise EngineStateError(
                f"{self.name}: trained expert weights were modified in place after forward #{saved.index} and "
                "before its backward (an optimizer step between forward and backward?); its activations are stale"
            )

    def backward(self, saved: SavedForward | None, grad_y: torch.Tensor) -> ExpertGrads:
        """grad_y ``[T, H]`` -> gradients of x, of topk_weights, of expert LoRA (fp32) and, in full mode, of the base."""
        self._check_saved(saved)
        assert saved is not None  # _check_saved raised otherwise
        x = saved.x
        t, h = x.shape
        if tuple(grad_y.shape) != (t, h):
            raise EngineError(f"{self.name}: grad_y must be {(t, h)}; got {tuple(grad_y.shape)}")
        saved.consumed = True
        self._check_finite("grad_y", grad_y)
        cd, i, mode = self.compute_dtype, self.intermediate_size, self.mode
        k = saved.topk_ids.shape[1]
        n = t * k
        disp = saved.disp if saved.disp is not None else dispatch(saved.topk_ids, self.num_experts)
        lora = saved.lora
        lora_c = self._lora_c(lora) if lora is not None else None
        r = lora.rank if lora is not None else 0
        need_xs = saved.gate_up is None or lora is not None or mode is TrainMode.FULL

        gs = gather_sorted(grad_y.detach().to(cd), disp, self.ws.get("gs", (n, h), cd))  # [N, H] unweighted
        w_sorted = sorted_weights(saved.topk_weights, disp).to(cd).unsqueeze(1)  # [N, 1]
        xs = gather_sorted(x, disp, self.ws.get("xs", (n, h), cd)) if need_xs else None
        gu_all = saved.gate_up if saved.gate_up is not None else self.ws.get("gu", (n, 2 * i), cd)
        xa_all = saved.lora_xa if saved.lora_xa is not None else self.ws.get("xa", (n, r), cd)
        hid = self.ws.get("h", (n, i), cd)
        gh_all = self.ws.get("gh", (n, i), cd)
        gxs = self.ws.get("gxs", (n, h), cd)
        gw_sorted = torch.empty(n, dtype=cd)

        # LoRA grads are at least fp32 so that accumulation over many micro-batches loses nothing
        lora_g = (
            {
                nm: torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32))
                for nm, p in zip(LORA_NAMES, lora.tensors())
            }
            if lora
            else None
        )
        base_g = self._zero_base_grads() if mode is TrainMode.FULL else None

        for e, s0, s1 in disp.segments():
            xs_e = xs[s0:s1] if xs is not None else None
            gu_e = gu_all[s0:s1]
            if saved.gate_up is None:  # recompute policy
                assert xs_e is not None
                self._project("gate_up", e, xs_e, gu_e, xa_all[s0:s1], lora, lora_c, saved.seed)
            h_e = self.act(gu_e, out=hid[s0:s1])
            g_e, w_e, gh_e = gs[s0:s1], w_sorted[s0:s1], gh_all[s0:s1]

            # down projection: gh = g @ (W2 + s B2 A2 (dropout)) ; all unweighted by w until the router grad is taken
            self._matmul_w("down", e, g_e, gh_e)
            if lora is not None and lora_c is not None and lora_g is not None:
                self._lora_backward(
                    "down",
                    e,
                    g_e,
                    gh_e,
                    h_e,
                    saved.lora_ha[s0:s1] if saved.lora_ha is not None else None,
                    w_e,
                    lora,
                    lora_c,
                    lora_g,
                    saved.seed,
                )
            # d y / d w[t, j] = <grad_y[t], FFN_e(x_t)> = <gh_unweighted, h> (+ <g, b2_e>): no [N, H] output kept
            torch.sum(gh_e * h_e, dim=1, out=gw_sorted[s0:s1])
            b2 = self._bias(self.down_bias, e)
            if b2 is not None:
                gw_sorted[s0:s1] += g_e @ b2
            if base_g is not None:
                base_g["down"][e].copy_(g_e.t() @ (h_e * w_e))
                if "down_bias" in base_g:
                    base_g["down_bias"][e].copy_((g_e * w_e).sum(0))
            gh_e.mul_(w_e)

            ggu = self.act.vjp(gu_e, gh_e)  # [n, 2I]
            gxs_e = gxs[s0:s1]
            self._matmul_w("gate_up", e, ggu, gxs_e)
            if lora is not None and lora_c is not None and lora_g is not None:
                assert xs_e is not None
                xa_e = (
                    saved.lora_xa[s0:s1]
                    if saved.lora_xa is not None
                    else xa_all[s0:s1]
                    if saved.gate_up is None
                    else None
                )
                self._lora_backward(
                    "gate_up", e, ggu, gxs_e, xs_e, xa_e, None, lora, lora_c, lora_g, saved.seed
                )
            if base_g is not None:
                assert xs_e is not None
                base_g["gate_up"][e].copy_(ggu.t() @ xs_e)
                if "gate_up_bias" in base_g:
                    base_g["gate_up_bias"][e].copy_(ggu.sum(0))

        if lora_g is not None and lora is not None and lora.gate_up_rows is not None:
            g = lora_g["gate_up_B"]  # engine row order -> the order of the tensor the call passed
            lora_g["gate_up_B"] = torch.empty_like(g).index_copy_(1, lora.gate_up_rows, g)
        grad_x = sum_slots(gxs, disp, self.ws.get("slots", (n, h), cd))
        grad_w = to_slots(gw_sorted, disp).view(t, k)
        self._check_finite("grad_x", grad_x)
        return ExpertGrads(
            x=grad_x.to(saved.x_dtype),
            topk_weights=grad_w.to(saved.topk_weights.dtype),
            lora=lora_g,
            base=base_g,
        )

    def _lora_backward(
        self,
        proj: Projection,
        e: int,
        g_out: torch.Tensor,
        g_in: torch.Tensor,
        inp: torch.Tensor,
        a_proj: torch.Tensor | None,
        w_e: torch.Tensor | None,
        lora: ExpertLoRA,
        lora_c: tuple[torch.Tensor, ...],
        lora_g: dict[str, torch.Tensor],
        seed: int | None,
    ) -> None:
        """LoRA part of one projection's backward, for expert e.

        g_out ``[n, D_out]`` is the gradient at the projection's output (unweighted for down, with ``w_e``
        ``[n, 1]`` applied to the LoRA grads; already weighted for gate_up). Adds the LoRA term into g_in
        ``[n, D_in]`` and writes fp32 grads of A ``[r, D_in]`` and B ``[D_out, r]``.
        ``a_proj`` is drop(inp) @ A^T when retained, else recomputed.
        """
        s = lora.scaling
        a, b = lora_c[0:2] if proj == "gate_up" else lora_c[2:4]
        gb = g_out @ b[e]  # [n, r]
        dropped = self._dropped(inp, seed, e, proj, lora.dropout)
        if seed is None:
            g_in.addmm_(gb, a[e], alpha=s)
        else:  # the mask applies to the gradient flowing back into the input too
            mask = dropout_mask(seed, e, proj == "down", tuple(inp.shape), lora.dropout, inp.dtype)
            g_in.add_((gb @ a[e]) * mask, alpha=s)
        if a_proj is None:
            a_proj = dropped @ a[e].t()
        if w_e is not None:
            gb = gb * w_e
            a_proj = a_proj * w_e
        name_a, name_b = f"{proj}_A", f"{proj}_B"
        lora_g[name_a][e].copy_(gb.t() @ dropped).mul_(s)
        # (a^T g)^T, not g^T a: MKL runs the [r, n] x [n, D] form ~9x faster than [D, n] x [n, r] here
        lora_g[name_b][e].copy_((a_proj.t() @ g_out).t()).mul_(s)

    def _zero_base_grads(self) -> dict[str, torch.Tensor]:
        assert isinstance(self.weights, DenseExperts)
        out = {"gate_up": torch.zeros_like(self.weights.gate_up), "down": torch.zeros_like(self.weights.down)}
        if self.gate_up_bias is not None:
            out["gate_up_bias"] = torch.zeros_like(self.gate_up_bias)
        if self.down_bias is not None:
            out["down_bias"] = torch.zeros_like(self.down_bias)
        return out
