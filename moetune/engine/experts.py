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
from collections.abc import Callable, Sequence

import torch

from moetune.engine.activations import GluActivation, get_activation
from moetune.engine.base_grads import BaseGrads
from moetune.engine.formats import DenseExperts, ExpertFormat
from moetune.engine.formats.base import Projection
from moetune.engine.gemm import BlockedGemm
from moetune.engine.lora import ExpertLoRA, LoraPass, dropout_seed
from moetune.engine.lora_batch import Chunk, LoraBatch
from moetune.engine.plan import EngineOptions, EnginePlan, TrainMode, resolve_compute_dtype
from moetune.engine.routing import (
    Dispatch,
    Run,
    Segment,
    combine,
    dispatch,
    gather_sorted,
    sorted_weights,
    sum_slots,
    to_slots,
    validate_routing,
)
from moetune.engine.saved import ExpertGrads, SavedForward
from moetune.engine.schedule import ExpertSchedule
from moetune.engine.shapes import RowSplit, native_ops_available
from moetune.engine.workspace import Workspace, thread_workspace
from moetune.errors import EngineError, EngineStateError, NonFiniteError
from moetune.finite import all_finite, non_finite_mask

_engine_ids = itertools.count()


class ExpertEngine:
    """One MoE layer's routed experts in host memory, with forward and backward.

    Args:
        weights: the expert weights in any registered format.
        activation: a registered activation name (``"silu"``, ``"gpt_oss"``, ...) or an instance.
        gate_up_bias: ``[E, 2I]`` or None. down_bias: ``[E, H]`` or None.
        lora: expert LoRA tensors, or None: what calls that pass no ``lora`` of their own compute with.
        train_base: full mode, differentiate the base weights (dense formats only).
        options: policy, compute dtype, finiteness checks.

    The GEMMs run on the CPU threads the caller sized torch's intra-op pool to (``set_engine_threads``):
    several experts at once, each on a share of them (``schedule.ExpertSchedule`` on ``threads.ExpertPool``,
    ``options.expert_workers``).
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
        self.plan = EnginePlan.resolve(self.options.policy, has_lora=lora is not None, train_base=train_base)
        self.compute_dtype = resolve_compute_dtype(weights.storage_dtype, self.options.compute_dtype)
        self._id = next(_engine_ids)
        self._forwards = 0
        self.ws = Workspace()
        split, native = self.options.split_rows, self.options.native_ops
        native = native_ops_available() if native is None else native
        self.split = (
            RowSplit.for_dtype(self.compute_dtype, native) if split is None else RowSplit(split, native)
        )
        self.gemm = self._gemm(weights)
        if self.options.expert_workers is not None and self.options.expert_workers < 1:
            raise EngineError(f"expert_workers must be >= 1 or None; got {self.options.expert_workers}")
        self.schedule = ExpertSchedule(self.options.expert_workers, 3 * h * i)

    def _gemm(self, weights: ExpertFormat) -> BlockedGemm:
        """The GEMMs on ``weights``; a float32 / float64 compute dtype asked for in the options (a float32 load)
        is exact: no kernel rounds the activations (``resolve_gemm_path``'s ``exact``)."""
        exact = self.options.compute_dtype in (torch.float32, torch.float64)
        return BlockedGemm(
            weights,
            self.compute_dtype,
            split=self.split,
            int8_rows=self.options.int8_activations,
            exact=exact,
        )

    @property
    def weights(self) -> ExpertFormat:
        """The expert weights, as the GEMMs read them (replacing them keeps the compute dtype and plan; the GEMM
        path is resolved again for the new format)."""
        return self.gemm.weights

    @weights.setter
    def weights(self, weights: ExpertFormat) -> None:
        self.gemm = self._gemm(weights)

    @property
    def mode(self) -> TrainMode:
        """What backward differentiates besides x and the routing weights."""
        return self.plan.mode

    def call_lora(self, lora: ExpertLoRA | None = None) -> ExpertLoRA | None:
        """The expert LoRA a call computes with: its own ``lora`` (checked against the weights), else the engine's."""
        if lora is None:
            return self.lora
        lora.check_shape(self.num_experts, self.hidden_size, self.intermediate_size)
        return lora

    def trained_tensors(self, lora: ExpertLoRA | None = None) -> tuple[torch.Tensor, ...]:
        """The tensors backward differentiates besides x and w, for a call with ``lora`` (None: the engine's):
        LoRA (``LORA_NAMES`` order; ``ExpertGrads.flat``), then in full mode ``base_tensors()`` in its order."""
        lora = self.call_lora(lora)
        out: tuple[torch.Tensor, ...] = lora.tensors() if lora is not None else ()
        if self.plan.base_grads:
            out += tuple(self.base_tensors().values())
        return out

    def _lora_pass(self, plan: EnginePlan, lora: ExpertLoRA | None, seed: int | None) -> LoraPass | None:
        """The LoRA terms of one pass with the call's ``lora`` (compute-dtype copies of A and B), or None when
        the call's ``plan`` has no LoRA. Its copies, and the batched products' buffers (``_lora_batch``), go to the
        calling thread's workspace: a pass's own scratch, so one set serves every engine (layer) the thread runs,
        one pass at a time, instead of one set per layer."""
        if not plan.lora:
            return None
        assert lora is not None
        return LoraPass(lora, self.compute_dtype, seed, self.split, thread_workspace())

    @staticmethod
    def _own_lora(lora: LoraPass | None, batch: LoraBatch | None) -> Callable[[Run], Sequence[Segment]]:
        """A run -> its segments whose experts take per-expert LoRA terms (``lora``'s): all of them, none without
        LoRA, or those ``batch`` leaves out (its large experts). The batch writes before the per-expert terms of
        its other experts, which overwrite their rows."""
        if lora is None:
            return lambda run: ()
        if batch is None:
            return lambda run: run.segments
        return lambda run: [seg for seg in run.segments if batch.large[seg[0]]]

    def _lora_batch(self, lora: LoraPass | None, disp: Dispatch) -> LoraBatch | None:
        """The pass's LoRA products for all experts at once (``lora_batch``), or None: per expert."""
        rows = LoraBatch.plan(lora, disp) if self.options.batch_lora else None
        return None if rows is None else LoraBatch(lora, disp, rows, thread_workspace())  # type: ignore[arg-type]

    def _sum_rows(self, g: torch.Tensor, inp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A base weight's gradient ``g [n, D_out]^T @ inp [n, D_in]`` -> ``[D_out, D_in]`` in ``dtype``, summed over
        row pieces (``engine.shapes``) where the compute dtype asks for them."""
        out = torch.empty((g.shape[1], inp.shape[1]), dtype=dtype)
        self.split.mm_t(g, inp, out)
        return out

    def _bias(self, proj: Projection, e: int) -> torch.Tensor | None:
        """Expert e's bias of ``proj`` (``[2I]`` or ``[H]``) in the compute dtype, or None."""
        bias = self.gate_up_bias if proj == "gate_up" else self.down_bias
        return None if bias is None else bias[e].detach().to(self.compute_dtype)

    def _project_run(
        self,
        proj: Projection,
        run: Run,
        inp: torch.Tensor,
        out: torch.Tensor,
        lora_a: torch.Tensor | None,
        lora: LoraPass | None,
        own: Sequence[Segment],
    ) -> None:
        """For every expert e of ``run``: out ``[N, D_out]``'s rows of e = inp ``[N, D_in]``'s rows of e @ W_e^T
        (+ bias) (+ LoRA term, its A-projection ``[n, r]`` into ``lora_a``'s rows), all in the compute dtype.
        The LoRA terms of the experts in ``own`` (``lora``'s) are written first, those of the others by
        ``LoraBatch`` before, and the base GEMMs of the whole run (``BlockedGemm.run``) accumulate into them: one
        pass over out fewer than adding them afterwards."""
        if own:
            assert lora is not None and lora_a is not None
            lora.forward_run(proj, own, inp, out, lora_a)
        self.gemm.run(True, proj, run.segments, inp, out, lora is not None)
        for e, s0, s1 in run.segments:
            bias = self._bias(proj, e)
            if bias is None:
                break  # none of them has one
            out[s0:s1].add_(bias)

    def _check_finite(self, what: str, t: torch.Tensor, disp: Dispatch | None = None) -> None:
        """With ``check_finite``: raise NonFiniteError for NaN/Inf in t (rows first: ``[T, ...]``, or ``[N, ...]``
        sorted by expert when ``disp`` is given, which names the expert)."""
        if not self.options.check_finite or all_finite(t):
            return
        bad = non_finite_mask(t)
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
        """x ``[T, H]`` float, topk_ids ``[T, k]`` int64, topk_weights ``[T, k]`` float -> y ``[T, H]`` in x's
        dtype. GEMMs run in the compute dtype.

        With ``save`` (the default) also returns what backward needs; ``save=False`` keeps nothing.
        ``training`` turns LoRA dropout on (as ``nn.Dropout`` does in train mode). ``lora``: this call's
        expert LoRA instead of the engine's own (a PEFT layer passes its active adapter's tensors).
        """
        lora = self.call_lora(lora)
        plan = self.plan.for_call(lora is not None)
        self._validate(x, topk_ids, topk_weights)
        cd, h, i = self.compute_dtype, self.hidden_size, self.intermediate_size
        self._check_finite("x", x)
        xc = x.detach().to(cd)  # [T, H]
        disp = dispatch(topk_ids, self.num_experts)
        t, k = topk_ids.shape
        n = t * k
        # kept tensors are fresh: workspace buffers are overwritten by the next pass
        keep = save and plan.keep_activations
        seed = dropout_seed(lora, training) if lora is not None else None
        lora_pass = self._lora_pass(plan, lora, seed)

        def buffer(name: str, cols: int) -> torch.Tensor:  # [N, cols] compute dtype
            return torch.empty(n, cols, dtype=cd) if keep else self.ws.get(name, (n, cols), cd)

        xs = gather_sorted(xc, disp, self.ws.get("xs", (n, h), cd))  # [N, H]
        gu = buffer("gu", 2 * i)  # [N, 2I]
        hid = self.ws.get("h", (n, i), cd)  # [N, I]
        ys = self.ws.get("ys", (n, h), cd)  # [N, H], unweighted expert outputs
        xa = buffer("xa", lora_pass.rank) if lora_pass is not None else None  # [N, r]
        ha = buffer("ha", lora_pass.rank) if lora_pass is not None else None  # [N, r]

        batch = self._lora_batch(lora_pass, disp)
        own = self._own_lora(lora_pass, batch)  # own(run): its experts with per-expert LoRA terms
        if batch is not None:
            self.schedule.each_chunk(batch, lambda ch: batch.forward(ch, "gate_up", xs, gu, xa))

        def gate_up_forward(run: Run) -> None:
            self._project_run("gate_up", run, xs, gu, xa, lora_pass, own(run))
            self.act(gu[run.start : run.end], out=hid[run.start : run.end])

        def down_forward(run: Run) -> None:
            self._project_run("down", run, hid, ys, ha, lora_pass, own(run))

        def expert_forward(run: Run) -> None:
            gate_up_forward(run)
            down_forward(run)

        if batch is None:
            self.schedule.each_run(disp, expert_forward)
        else:  # the down projection's LoRA needs every expert's h first
            self.schedule.each_run(disp, gate_up_forward)
            self.schedule.each_chunk(batch, lambda ch: batch.forward(ch, "down", hid, ys, ha))
            self.schedule.each_run(disp, down_forward)
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
        if keep:
            saved.disp, saved.gate_up, saved.lora_xa, saved.lora_ha = disp, gu, xa, ha
        return y, saved

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
        """grad_y ``[T, H]`` (any float dtype) -> gradients of x ``[T, H]`` and topk_weights ``[T, k]`` (in their
        dtypes), of expert LoRA (fp32) and, in full mode, of the base (see :class:`ExpertGrads`)."""
        self._check_saved(saved)
        assert saved is not None  # _check_saved raised otherwise
        x = saved.x  # [T, H] compute dtype
        t, h = x.shape
        if tuple(grad_y.shape) != (t, h):
            raise EngineError(f"{self.name}: grad_y must be {(t, h)}; got {tuple(grad_y.shape)}")
        saved.consumed = True
        self._check_finite("grad_y", grad_y)
        cd, i = self.compute_dtype, self.intermediate_size
        plan = self.plan.for_call(saved.lora is not None)
        k = saved.topk_ids.shape[1]
        n = t * k
        lora_pass = self._lora_pass(plan, saved.lora, saved.seed)

        if plan.recompute_gate_up:  # filled per expert below
            disp = dispatch(saved.topk_ids, self.num_experts)
            gu_all = self.ws.get("gu", (n, 2 * i), cd)  # [N, 2I]
            xa_all = self.ws.get("xa", (n, lora_pass.rank), cd) if lora_pass is not None else None  # [N, r]
            ha_all = None  # the LoRA backward recomputes drop(h) A2^T
        else:
            assert saved.disp is not None and saved.gate_up is not None  # kept by this engine's forward
            disp, gu_all, xa_all, ha_all = saved.disp, saved.gate_up, saved.lora_xa, saved.lora_ha
        gs = gather_sorted(grad_y.detach().to(cd), disp, self.ws.get("gs", (n, h), cd))  # [N, H] unweighted
        w_sorted = sorted_weights(saved.topk_weights, disp).to(cd).unsqueeze(1)  # [N, 1]
        xs = gather_sorted(x, disp, self.ws.get("xs", (n, h), cd)) if plan.gather_inputs else None  # [N, H]
        hid = self.ws.get("h", (n, i), cd)  # [N, I]
        gh_all = self.ws.get("gh", (n, i), cd)  # [N, I]: grad at the activation's output
        gxs = self.ws.get("gxs", (n, h), cd)  # [N, H]: grad at the sorted inputs
        gw_sorted = torch.empty(n, dtype=cd)  # [N]: grad of the routing weights, sorted
        base_g = BaseGrads() if plan.base_grads else None
        # why fp32: these are summed over micro-batches (fp64 for an fp64 engine, as its LoRA grads)
        gdt = torch.promote_types(cd, torch.float32)

        batch = self._lora_batch(lora_pass, disp)
        # a batched pass writes every expert's LoRA grads, so they need no zeros first (per expert, experts without
        # rows are never visited)
        lora_g = lora_pass.new_grads(zeroed=batch is None) if lora_pass is not None else {}
        own = self._own_lora(lora_pass, batch)  # own(run): its experts with per-expert LoRA terms
        ggu_all = None  # [N, 2I] grad at gate_up, kept between the two loops when LoRA runs batched
        if batch is not None:
            if plan.recompute_gate_up:
                assert xs is not None  # gathered whenever LoRA runs
                self.schedule.each_chunk(batch, lambda ch: batch.forward(ch, "gate_up", xs, gu_all, xa_all))
            self.schedule.each_chunk(batch, lambda ch: batch.backward_input(ch, "down", gs, gh_all))
            ggu_all = self.ws.get("ggu", (n, 2 * i), cd)

        def down_backward(run: Run) -> torch.Tensor:
            """A run's recompute, activation and down projection backward: its grad at gate_up ``[rows, 2I]``."""
            r0, r1 = run.start, run.end
            if plan.recompute_gate_up:
                assert xs is not None
                self._project_run("gate_up", run, xs, gu_all, xa_all, lora_pass, own(run))
            # per-thread scratch (runs may be computed in parallel): what the vjp reuses of the activation, and its
            # result; both live only inside this run's backward
            scratch = thread_workspace()
            memo = scratch.get("act_memo", (r1 - r0, i), cd)  # [rows, I]
            gu, g, w, gh = gu_all[r0:r1], gs[r0:r1], w_sorted[r0:r1], gh_all[r0:r1]
            h = self.act.forward_saving(gu, hid[r0:r1], memo)  # [rows, I]

            # down projection: gh = g @ (W2 + s B2 A2 (dropout)) ; all unweighted by w until the router grad is taken
            segs = own(run)
            if segs:  # writes their terms into gh's rows; the base GEMMs accumulate into them
                assert lora_pass is not None
                lora_pass.backward_run("down", segs, lora_g, gs, gh_all, hid, ha_all, w_sorted)
            self.gemm.run(False, "down", run.segments, gs, gh_all, accumulate=lora_pass is not None)
            # d y / d w[t, j] = <grad_y[t], FFN_e(x_t)> = <gh_unweighted, h> (+ <g, b2_e>): no [N, H] output kept
            torch.sum(gh * h, dim=1, out=gw_sorted[r0:r1])
            if self.down_bias is not None or base_g is not None:
                self._down_bias_and_base_grads(run, g, h, w, gw_sorted[r0:r1], base_g, gdt)
            gh.mul_(w)
            ggu = scratch.get("act_grad", (r1 - r0, 2 * i), cd) if ggu_all is None else ggu_all[r0:r1]
            return self.act.vjp_into(gu, gh, memo, ggu)  # [rows, 2I]

        def gate_up_backward(run: Run, ggu: torch.Tensor) -> None:
            """A run's gate_up projection backward from its grad at gate_up ggu ``[rows, 2I]``."""
            segs = own(run)
            if segs:
                assert lora_pass is not None and xs is not None
                lora_pass.backward_run(
                    "gate_up", segs, lora_g, ggu, gxs, xs, xa_all, None, g_out_offset=run.start
                )
            self.gemm.run(
                False,
                "gate_up",
                run.segments,
                ggu,
                gxs,
                accumulate=lora_pass is not None,
                inp_offset=run.start,
            )
            if base_g is not None:
                assert xs is not None
                for e, s0, s1 in run.segments:
                    ggu_e, mine = ggu[s0 - run.start : s1 - run.start], base_g.by_expert[e]
                    mine["gate_up"] = self._sum_rows(ggu_e, xs[s0:s1], gdt)
                    if self.gate_up_bias is not None:
                        mine["gate_up_bias"] = ggu_e.sum(0).to(gdt)

        if batch is None:
            self.schedule.each_run(disp, lambda run: gate_up_backward(run, down_backward(run)))
        else:  # the batched LoRA products need every expert's h, then every expert's grad at gate_up
            assert ggu_all is not None and xs is not None
            self.schedule.each_run(disp, down_backward)
            xs_all, ggu = xs, ggu_all  # narrowed for the closures

            def lora_grads(ch: Chunk) -> None:
                batch.backward_weights(ch, "down", hid, ha_all, w_sorted, lora_g)
                batch.backward_input(ch, "gate_up", ggu, gxs)
                batch.backward_weights(ch, "gate_up", xs_all, xa_all, None, lora_g)

            self.schedule.each_chunk(batch, lora_grads)
            self.schedule.each_run(disp, lambda run: gate_up_backward(run, ggu_all[run.start : run.end]))
        if lora_pass is not None:
            lora_g = lora_pass.in_call_order(lora_g)
        grad_x = sum_slots(gxs, disp, self.ws.get("slots", (n, h), cd))  # [T, H]
        grad_w = to_slots(gw_sorted, disp).view(t, k)  # [T, k]
        self._check_finite("grad_x", grad_x)
        return ExpertGrads(
            x=grad_x.to(saved.x_dtype),
            topk_weights=grad_w.to(saved.topk_weights.dtype),
            lora=lora_g or None,
            base=base_g,
        )

    def _down_bias_and_base_grads(
        self,
        run: Run,
        g: torch.Tensor,
        h: torch.Tensor,
        w: torch.Tensor,
        gw: torch.Tensor,
        base_g: BaseGrads | None,
        gdt: torch.dtype,
    ) -> None:
        """A run's down-bias term of the router grad (``gw [rows] += g_e @ b2_e``) and, in full mode, its experts'
        down and down-bias grads, from g ``[rows, H]`` (unweighted), h ``[rows, I]`` and w ``[rows, 1]``."""
        hw = h * w if base_g is not None else None  # [rows, I]
        gwt = g * w if base_g is not None and self.down_bias is not None else None  # [rows, H]
        for e, s0, s1 in run.segments:
            a, b = s0 - run.start, s1 - run.start
            b2 = self._bias("down", e)
            if b2 is not None:
                gw[a:b] += g[a:b] @ b2
            if hw is not None:  # only this expert's slices: experts without rows get no tensor at all
                assert base_g is not None
                mine = base_g.by_expert[e] = {"down": self._sum_rows(g[a:b], hw[a:b], gdt)}
                if gwt is not None:
                    mine["down_bias"] = gwt[a:b].sum(0).to(gdt)

    def base_tensors(self) -> dict[str, torch.Tensor]:
        """Full mode's trained base tensors by ``base_grads.BASE_NAMES`` name: gate_up ``[E, 2I, H]``, down
        ``[E, H, I]`` and the biases present (the engine's own tensors, updated in place by an optimizer)."""
        assert isinstance(self.weights, DenseExperts)
        out = {"gate_up": self.weights.gate_up, "down": self.weights.down}
        if self.gate_up_bias is not None:
            out["gate_up_bias"] = self.gate_up_bias
        if self.down_bias is not None:
            out["down_bias"] = self.down_bias
        return out
