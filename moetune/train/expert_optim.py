"""The optimizer of full and freeze training: torch's AdamW, plus an in-place CPU AdamW for the routed experts.

``ExpertAdamW`` is a ``torch.optim.AdamW`` (a subclass; nothing is patched) over every trained parameter, so the
Trainer's learning-rate schedule, checkpoints and resume see one optimizer. Parameters with a dense ``.grad``
(attention, norms, routers, embeddings) take torch's own step. The routed experts' base weights ``[E, ...]`` get no
``.grad``: their backward leaves fp32 gradients of the experts that received tokens in an
``ExpertGradBuffer`` (``moetune.engine.base_grads``), and this class updates those weights in place, expert by
expert, on the engine's own tensors (no re-layout, no copy of the weights; ``step`` bumps their in-place version,
which the engine checks against stale activations).

Semantics (``ExpertUpdate``):

- ``exact`` (default): what torch's AdamW does with a dense gradient that is zero for the experts without tokens.
  Every expert steps every step: weight decay ``w *= 1 - lr * wd``, moment decay ``m *= b1``, ``v *= b2`` and the
  update ``lr * m_hat / (sqrt(v_hat) + eps)`` (nonzero once the expert has had a gradient). With fp32 state the
  result is torch's AdamW bit for bit (``foreach=False`` arithmetic; tests/unit/train/test_expert_optim.py).
- ``lazy``: only experts with tokens step (as ``torch.optim.SparseAdam`` treats rows): an expert without tokens
  keeps its weights, moments and step count; bias correction uses the expert's own count. Cheaper (untouched
  experts cost nothing), but not torch's AdamW: no weight decay and no momentum drift for idle experts.

State (``moetune.train.moment_store``): the moments in the parameter's dtype (torch's ``zeros_like``: fp32 master
weights -> fp32), fp32, bf16, or blockwise 8-bit; ``step`` is an fp32 ``[E]`` count per expert.
``optim`` (the Trainer's key) picks it: ``STATE_OF_OPTIM``.

Overlap: when no clipping needs the global gradient norm first (``max_grad_norm`` 0) and no guard may still skip
the step, :meth:`arm` (called before the last micro-batch's backward) lets each experts module's update start on a
worker thread as soon as that module's last backward of the step is done, while autograd continues below it;
:meth:`step` waits for those and updates the rest.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.adamw import adamw

from moetune.config.schema import ExpertUpdate
from moetune.engine.base_grads import ExpertGradBuffer
from moetune.errors import ConfigError
from moetune.train.moment_store import MOMENTS, STORES, MomentStore, PlainStore

logger = logging.getLogger(__name__)


# the Trainer's ``optim`` -> the experts' state ("param": the parameter's dtype, as torch's AdamW)
STATE_OF_OPTIM = {
    "adamw_torch": "param",
    "adamw_torch_fused": "param",
    "adamw_anyprecision": "anyprecision",  # optim_args momentum_dtype / variance_dtype: float32 or bfloat16
    "adamw_torch_8bit": "8bit",
    "adamw_8bit": "8bit",
    "adamw_bnb_8bit": "8bit",
    "paged_adamw_8bit": "8bit",
}
_DTYPE_ARGS = {"float32": "fp32", "bfloat16": "bf16"}


@dataclass(frozen=True)
class ExpertOptimSpec:
    """The expert optimizer a run uses: its moments' store (``param`` or a ``moment_store.STORES`` name) and
    update semantics."""

    state: str = "param"
    update: ExpertUpdate = ExpertUpdate.EXACT

    @classmethod
    def from_optim(
        cls, optim: str, optim_args: str | None = None, update: ExpertUpdate = ExpertUpdate.EXACT
    ) -> ExpertOptimSpec:
        """The spec for the Trainer's ``optim`` / ``optim_args``; ``ConfigError`` for an optimizer the experts
        cannot take (before anything loads: ``moetune.train.preflight``)."""
        optim = str(getattr(optim, "value", optim))
        state = STATE_OF_OPTIM.get(optim)
        if state is None:
            raise ConfigError(
                f"optim: {optim!r} cannot train the routed experts (finetuning_type full/freeze: moetune's CPU "
                f"AdamW updates them); allowed: {', '.join(STATE_OF_OPTIM)} (README, training modes)"
            )
        if state == "anyprecision":
            args = dict(a.split("=", 1) for a in (optim_args or "").replace(" ", "").split(",") if "=" in a)
            dtypes = {args.get("momentum_dtype", "float32"), args.get("variance_dtype", "float32")}
            if len(dtypes) != 1 or not dtypes <= set(_DTYPE_ARGS):
                raise ConfigError(
                    f"optim_args: {optim_args!r}: with optim adamw_anyprecision the experts' momentum_dtype and "
                    f"variance_dtype must be equal, one of {', '.join(_DTYPE_ARGS)}"
                )
            state = _DTYPE_ARGS[dtypes.pop()]
        return cls(state=state, update=ExpertUpdate(update))

    def store(self, param: torch.Tensor) -> MomentStore:
        return PlainStore(param.dtype) if self.state == "param" else STORES.get(self.state)


@dataclass(eq=False)
class ExpertLayer:
    """One full-mode experts module: its gradient buffer and its base parameters by ``BASE_NAMES`` name."""

    name: str
    buffer: ExpertGradBuffer
    params: dict[str, nn.Parameter]


def expert_layers(model: nn.Module) -> list[ExpertLayer]:
    """Every full-mode ``CpuExperts`` of ``model``, each given an ``ExpertGradBuffer`` (its backward then keeps
    sparse gradients there instead of dense ``.grad``)."""
    from moetune.engine import TrainMode
    from moetune.layer import CpuExperts

    out = []
    for path, m in model.named_modules():
        if isinstance(m, CpuExperts) and m.engine.mode is TrainMode.FULL:
            if m.base_grads is None:
                m.base_grads = ExpertGradBuffer(path)
            params = {n: t for n, t in m.engine.base_tensors().items() if isinstance(t, nn.Parameter)}
            out.append(ExpertLayer(path, m.base_grads, params))
    return out


# the most bytes of fp32 zeros kept to step idle experts with torch's kernel (why a cap: a run of idle experts
# as long as a whole layer would otherwise keep a zero tensor the size of the layer's fp32 weights)
ZERO_BUFFER_BYTES = 64 << 20
_ZERO = torch.zeros(())  # lerp towards 0: the exact arithmetic of a zero gradient, without a zero tensor


class ExpertAdamW(torch.optim.AdamW):
    """torch's AdamW for dense-gradient parameters; in-place sparse AdamW for the ``layers``' expert weights
    (module docstring). ``params`` / ``kwargs``: as ``torch.optim.AdamW``, over all trained parameters."""

    def __init__(
        self,
        params: Iterable[Any],
        layers: list[ExpertLayer],
        spec: ExpertOptimSpec = ExpertOptimSpec(),
        **kwargs: Any,
    ) -> None:
        super().__init__(params, **kwargs)
        self.layers, self.spec = layers, spec
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        missing = [
            f"{lay.name}.{n}" for lay in layers for n, p in lay.params.items() if id(p) not in group_of
        ]
        if missing:
            raise ConfigError(
                f"the expert optimizer got experts whose weights are not among its parameters: {missing}"
            )
        self._group_of = group_of
        self._expert_ids = {id(p) for lay in layers for p in lay.params.values()}
        self._by_buffer = {id(lay.buffer): lay for lay in layers}
        self._clip: torch.Tensor | None = None  # this step's clip coefficient for the expert grads
        self._done: set[int] = set()  # layers already updated this step (overlap)
        self._futures: list[Future[float]] = []
        self._norm_sq_done = 0.0  # sum of squares of the grads of the layers already updated this step
        self._worker: ThreadPoolExecutor | None = None
        self._zero_buffer = torch.zeros(0)  # zero gradients of idle experts (_torch_adamw)
        self.early_updates = 0  # experts-module updates run during backward so far (overlap)
        for lay in layers:
            lay.buffer.clear()

    # gradient norm and clipping ----------------------------------------------------------------------------
    def grad_norm(self, dense: Iterable[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm (fp32 0-d) of the ``dense`` parameters' ``.grad`` and every expert gradient of this
        step (the layers updated early included), as ``clip_grad_norm_`` would compute it over dense grads."""
        self.wait()
        grads = [p.grad for p in dense if p.grad is not None]
        dense_sq = float(torch.nn.utils.get_total_norm(grads, 2.0).double() ** 2) if grads else 0.0
        sparse_sq = self._norm_sq_done + sum(float(lay.buffer.norm_sq()) for lay in self.layers)
        return torch.tensor(math.sqrt(dense_sq + sparse_sq), dtype=torch.float32)

    def clip_grad_norm_(self, dense: list[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip like ``torch.nn.utils.clip_grad_norm_`` over the dense grads and the expert grads together (the
        experts' coefficient is applied as they are updated); returns the norm before clipping."""
        if self._done:
            raise AssertionError(
                "clipping after expert layers were updated early (overlap needs max_grad_norm 0)"
            )
        total = self.grad_norm(dense)
        torch.nn.utils.clip_grads_with_norm_(dense, max_norm, total)
        self._clip = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's own coefficient
        return total

    # overlap ---------------------------------------------------------------------------------------------
    def arm(self) -> None:
        """Update each experts module on a worker thread as soon as its last backward of this step is done."""
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="moetune-expert-step")
        for lay in self.layers:
            lay.buffer.on_ready = self._ready

    def _ready(self, buffer: ExpertGradBuffer) -> None:
        lay = self._by_buffer[id(buffer)]
        buffer.on_ready = None
        self._done.add(id(lay))
        self.early_updates += 1
        assert self._worker is not None
        self._futures.append(self._worker.submit(self._update_layer, lay))

    def wait(self) -> None:
        """Block until the experts modules updated during backward (:meth:`arm`) are done."""
        futures, self._futures = self._futures, []
        for f in futures:
            self._norm_sq_done += f.result()  # re-raises a failed update here, on the training thread

    # the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Update the experts (those not already updated during backward), then torch's AdamW step of the rest."""
        try:
            self.wait()
            for lay in self.layers:
                lay.buffer.on_ready = None
                if id(lay) not in self._done:
                    self._update_layer(lay)
        finally:
            self._done, self._clip, self._norm_sq_done = set(), None, 0.0
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for lay in self.layers:
            lay.buffer.clear()

    def _update_layer(self, lay: ExpertLayer) -> float:
        """AdamW on one experts module's weights, in place; returns the sum of squares of its gradients. A
        non-finite gradient is not applied (during backward no guard has judged the step yet; the returned NaN
        reaches the guard through the gradient norm, which then stops the run)."""
        grads = lay.buffer.take()
        norm_sq = sum(
            float(torch.linalg.vector_norm(g, dtype=torch.float64) ** 2)
            for n in grads.values()
            for g in n.values()
        )
        if not math.isfinite(norm_sq):
            logger.warning(
                "moetune: %s: non-finite expert gradients; this module's update is not applied", lay.name
            )
            return norm_sq
        with torch.no_grad():
            for name, p in lay.params.items():
                self._update_param(p, name, grads)
        return norm_sq

    def _update_param(self, p: nn.Parameter, name: str, grads: dict[int, dict[str, torch.Tensor]]) -> None:
        """AdamW on one ``[E, ...]`` expert parameter: the experts with a gradient, then (``exact``) every other
        expert as with a zero gradient, in runs of neighbouring experts with the same step count (one op chain
        over ``[n, ...]`` views per run rather than per expert)."""
        group = self._group_of[id(p)]
        store = self.spec.store(p)
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros(p.shape[0], dtype=torch.float32)
            for key in MOMENTS:
                state.update(store.init(key, p.shape))
        with_grad = {e: named[name] for e, named in sorted(grads.items()) if name in named}
        if self._clip is not None:
            for g in with_grad.values():
                g.mul_(self._clip)  # torch's clip multiplies each grad by the same fp32 coefficient
        steps = state["step"]
        idle = _idle_runs(steps.tolist(), with_grad) if self.spec.update is ExpertUpdate.EXACT else []
        if isinstance(store, PlainStore) and store.dtype == p.dtype == torch.float32:
            # the state tensors are the moments: torch's own AdamW kernel with the group's fused/foreach flags, so
            # the result is that of torch's AdamW on a dense gradient, bit for bit
            self._torch_adamw(p, with_grad, idle, state, group)
            return
        for e, g in with_grad.items():
            self._adamw(p, slice(e, e + 1), g.unsqueeze(0), state, store, group)
        for sl in idle:
            self._adamw(p, sl, None, state, store, group)

    def _torch_adamw(
        self,
        p: torch.Tensor,
        with_grad: dict[int, torch.Tensor],
        idle: list[slice],
        state: dict[str, torch.Tensor],
        group: dict[str, Any],
    ) -> None:
        """fp32 weights and state: ``torch.optim.adamw.adamw`` on the experts with a gradient, then on the idle
        runs with a zero gradient (views of one reused zero buffer of at most ``ZERO_BUFFER_BYTES``: a run
        longer than that goes in chunks; no gradient-sized zero fill per step)."""
        steps = state["step"]
        per_expert = p[0].numel()
        chunk = max(1, ZERO_BUFFER_BYTES // (4 * per_expert))
        pieces = [slice(e, e + 1) for e in with_grad]
        grads = [with_grad[e].unsqueeze(0) for e in with_grad]
        for run in idle:
            for s0 in range(run.start, run.stop, chunk):
                sl = slice(s0, min(s0 + chunk, run.stop))
                pieces.append(sl)
                grads.append(self._zeros(sl.stop - sl.start, p.shape[1:]))
        counts = [steps[sl][0].clone() for sl in pieces]  # one count per piece: its experts share it
        adamw(
            [p[sl] for sl in pieces],
            grads,
            [state["exp_avg"][sl] for sl in pieces],
            [state["exp_avg_sq"][sl] for sl in pieces],
            [],
            counts,
            foreach=group.get("foreach"),
            fused=group.get("fused"),
            amsgrad=False,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group.get("maximize", False),
        )
        for sl, count in zip(pieces, counts, strict=True):
            steps[sl] = count

    def _zeros(self, n: int, shape: torch.Size) -> torch.Tensor:
        """``[n, *shape]`` fp32 zeros: a view of one buffer kept across steps (never written by AdamW)."""
        numel = n * math.prod(shape)
        if self._zero_buffer.numel() < numel:
            self._zero_buffer = torch.zeros(numel, dtype=torch.float32)
        return self._zero_buffer[:numel].view(n, *shape)

    @staticmethod
    def _adamw(
        p: torch.Tensor,
        sl: slice,
        g: torch.Tensor | None,
        state: dict[str, torch.Tensor],
        store: MomentStore,
        group: dict[str, Any],
    ) -> None:
        """AdamW on experts ``sl`` of ``p`` (one step count), torch's single-tensor arithmetic in fp32; ``g``
        ``[n, ...]``, or None: a zero gradient."""
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        steps = state["step"][sl]
        steps += 1
        step = float(steps[0])
        w = p[sl]
        work = w if w.dtype == torch.float32 else w.float()
        m, v = store.read(state, "exp_avg", sl), store.read(state, "exp_avg_sq", sl)
        if wd != 0:
            work.mul_(1 - lr * wd)
        if g is None:
            m.lerp_(_ZERO, 1 - beta1)
            v.mul_(beta2)  # torch adds (1 - b2) * 0 * 0 = +0: the same bits
        else:
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step_size = lr / (1 - beta1**step)
        denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
        work.addcdiv_(m, denom, value=-step_size)
        store.write(state, "exp_avg", sl, m)
        store.write(state, "exp_avg_sq", sl, v)
        if work is not w:
            w.copy_(work)  # round to nearest into the bf16 weights

    # checkpoints -----------------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, except that the experts' state keeps its saved dtypes (torch casts floating state to the
        parameter's dtype, which would turn bf16 moments of fp32 weights into fp32 and 8-bit scales into bf16)."""
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for idx, saved in state_dict["state"].items():
            p = params[int(idx)]
            if id(p) in self._expert_ids:
                self.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved.items()}

    def state_name(self) -> str:
        """The experts' moment store as run (``param`` resolved to the weights' dtype: fp32, bf16)."""
        p = next(iter(self.layers[0].params.values()))
        return self.spec.store(p).name

    # memory ------------------------------------------------------------------------------------------------
    def host_bytes(self) -> dict[str, int]:
        """Bytes of the experts' optimizer state (as allocated, or as it will be before the first step) and the
        most expert-gradient bytes held at once so far (sparse: experts with tokens only)."""
        state = 0
        for lay in self.layers:
            for p in lay.params.values():
                held = self.state.get(p)
                if held:
                    state += sum(t.nbytes for t in held.values() if isinstance(t, torch.Tensor))
                else:
                    state += int(2 * p.numel() * self.spec.store(p).bytes_per_element) + 4 * p.shape[0]
        return {"state": state, "grads_peak": sum(lay.buffer.peak_nbytes for lay in self.layers)}


def _idle_runs(steps: list[float], with_grad: dict[int, torch.Tensor]) -> list[slice]:
    """Maximal runs of neighbouring experts without a gradient and with the same step count."""
    runs: list[slice] = []
    start = None
    for e in range(len(steps) + 1):
        idle = e < len(steps) and e not in with_grad
        if start is not None and (not idle or steps[e] != steps[start]):
            runs.append(slice(start, e))
            start = None
        if idle and start is None:
            start = e
    return runs


def spec_of_config(config: Any) -> ExpertOptimSpec | None:
    """The expert optimizer of a validated ``MoetuneConfig`` (its ``optim`` / ``optim_args`` pass-through keys,
    transformers' default ``optim`` otherwise, and ``expert_update``); ``ConfigError`` for an unusable one.

    None where the Trainer's own optimizer trains the experts on dense ``.grad`` tensors instead (logged): an
    ``optim`` that is no AdamW (``sgd``, ``adafactor``, ...). Under several processes the sparse gradients are
    averaged over the ranks before the step (``moetune.train.host_grads.average_sparse``)."""
    from transformers import TrainingArguments

    extra = dict(config.training.extra_args)
    optim = extra.get("optim", TrainingArguments.__dataclass_fields__["optim"].default)
    name = str(getattr(optim, "value", optim))
    if name not in STATE_OF_OPTIM:
        logger.warning(
            "moetune: optim %s is no AdamW: it trains the routed experts itself, on dense fp32 gradients of every "
            "expert (4 bytes per expert parameter, with tokens or not) instead of moetune's sparse AdamW",
            name,
        )
        return None
    return ExpertOptimSpec.from_optim(name, extra.get("optim_args"), config.finetune.expert_update)


def build_expert_optimizer(
    model: nn.Module, groups: list[dict[str, Any]], spec: ExpertOptimSpec, **adamw_kwargs: Any
) -> ExpertAdamW | None:
    """An :class:`ExpertAdamW` over ``groups`` (the Trainer's parameter groups) when ``model`` trains routed
    experts fully; None otherwise (torch's AdamW then does)."""
    layers = expert_layers(model)
    if not layers:
        return None
    logger.info(
        "moetune: expert optimizer: %d experts modules, state %s, update %s",
        len(layers),
        spec.state,
        spec.update.value,
    )
    return ExpertAdamW(groups, layers, spec, **adamw_kwargs)


def unwrap(optimizer: Any) -> ExpertAdamW | None:
    """The :class:`ExpertAdamW` inside ``optimizer`` (accelerate wraps the Trainer's), or None."""
    inner = getattr(optimizer, "optimizer", optimizer)
    return inner if isinstance(inner, ExpertAdamW) else None
