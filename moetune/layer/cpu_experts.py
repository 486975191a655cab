"""``CpuExperts``: an ``nn.Module`` with a transformers v5 experts module's call signature, run by the engine.

``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, so it can take the
place of ``block.experts`` on a model instance. Base expert weights stay inside the engine (host memory,
any format) and are not module parameters unless full mode trains them. Expert LoRA comes either with the
call (``forward(..., lora=...)``: what moetune's PEFT layer ``moetune.adapters.expert_layer.ExpertsLora``
passes, views of its ``lora_A`` / ``lora_B`` parameters for the active adapter) or from an engine built
with LoRA, whose tensors are then registered here as CPU ``nn.Parameter``s that any torch optimizer can
update.

Because the base expert weights are not module tensors, a state dict of the model itself lacks the routed
experts: ``model.save_pretrained`` would write a checkpoint without them. ``CpuExperts`` therefore refuses
to be collected into a state dict unless the model is wrapped by PEFT (the key prefix ``base_model.model.``),
whose ``get_peft_model_state_dict`` / ``PeftModel.save_pretrained`` only pick LoRA tensors out of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moetune.arch.detect import DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS
from moetune.arch.spec import ExpertsCall
from moetune.engine import LORA_NAMES, DenseExperts, ExpertEngine, ExpertLoRA, TrainMode
from moetune.engine.base_grads import ExpertGradBuffer
from moetune.engine.routing import validate_routing
from moetune.errors import ConfigError, SaveError
from moetune.layer.function import routed_experts
from moetune.layer.hot import HotExperts
from moetune.layer.hot_overlap import routed_experts_beside
from moetune.layer.memo import ForwardMemo
from moetune.layer.overlap import SharedAhead
from moetune.layer.runtime_layout import from_runtime, to_runtime
from moetune.layer.transfer import HostCopy

if TYPE_CHECKING:
    from moetune.arch.detect import ExpertsLayout

PEFT_WRAPPED_PREFIX = "base_model.model."
"""Where a ``peft.PeftModel`` keeps the model it wraps: state-dict keys of a wrapped model contain it."""


class CpuExperts(nn.Module):
    """Holds one :class:`ExpertEngine`; its trainable tensors are this module's parameters.

    ``layout`` describes the transformers experts module this one replaced (set by the loader; None: the
    engine's own ``[E, 2I, H]`` gate-rows-first layout), so adapters can be saved in that module's layout.
    """

    def __init__(self, engine: ExpertEngine, layout: ExpertsLayout | None = None) -> None:
        super().__init__()
        self.engine = engine
        self.layout = layout
        self.memo = ForwardMemo()  # lets activation checkpointing's recompute skip the engine
        self.shared_ahead: SharedAhead | None = None  # set by the loader where the block has shared experts
        if engine.lora is not None:
            for name in LORA_NAMES:
                param = nn.Parameter(getattr(engine.lora, name).detach())
                setattr(engine.lora, name, param)  # the engine reads the very Parameter objects
                self.register_parameter(f"lora_{name}", param)
        self.exports = False  # a state dict of the model carries the dense expert weights (export_weights)
        self.hot: HotExperts | None = None  # experts computed on the device (place_hot)
        # gpu_experts auto (moetune.layer.hot_auto): routed slots per expert [E] while counting, and the device and
        # dtype of the hidden states counted
        self.routing_counts: torch.Tensor | None = None
        self.counted_on: tuple[torch.device, torch.dtype] | None = None
        # full mode: where backward puts the base gradients of the experts with rows (set by the expert optimizer,
        # moetune.train.expert_optim); None: dense .grad tensors, for any torch optimizer
        self.base_grads: ExpertGradBuffer | None = None
        if engine.mode is TrainMode.FULL:
            self._register_base()

    def _register_base(self) -> None:
        """Make the full-mode engine's base weights and biases this module's ``nn.Parameter``s, sharing storage."""
        engine = self.engine
        weights = engine.weights
        assert isinstance(weights, DenseExperts)
        weights.gate_up = nn.Parameter(weights.gate_up.detach())
        weights.down = nn.Parameter(weights.down.detach())
        self.gate_up_proj, self.down_proj = weights.gate_up, weights.down
        if engine.gate_up_bias is not None:
            engine.gate_up_bias = self.gate_up_proj_bias = nn.Parameter(engine.gate_up_bias.detach())
        if engine.down_bias is not None:
            engine.down_bias = self.down_proj_bias = nn.Parameter(engine.down_bias.detach())

    def place_hot(self, ids: tuple[int, ...], device: torch.device | str, dtype: torch.dtype) -> None:
        """Hold experts ``ids`` (sorted, distinct, < E) also on ``device`` in ``dtype`` and compute them there
        (``moetune.layer.hot``); the engine then computes the other experts only. Empty ``ids``: none."""
        if self.engine.mode is TrainMode.FULL:
            raise ConfigError(
                f"gpu_experts: {self.engine.name} trains its base expert weights (finetuning_type full or freeze), "
                "which the engine updates on the host; hot experts on the device hold frozen copies. Set "
                "gpu_experts to 0 for full/freeze training"
            )
        self.hot = HotExperts(self.engine, ids, torch.device(device), dtype) if ids else None

    def export_weights(self) -> None:
        """Let a state dict of the model carry this module's expert weights, in the layout of the transformers
        module it replaced (``moetune.layer.runtime_layout``), and ``load_state_dict`` fill them back; then
        ``model.save_pretrained`` writes a checkpoint plain transformers loads. Dense formats only: a quantized
        format has no exact float weights to write (``ConfigError``)."""
        if not isinstance(self.engine.weights, DenseExperts):
            raise ConfigError(
                f"{self.engine.name}: the routed experts are held as {self.engine.weights.name!r}, which has no "
                "exact float weights to save or train; full and freeze training need "
                "`moetune: {expert_format: dense}` on a float checkpoint (LoRA trains quantized experts)"
            )
        if self.layout is not None and self.layout.identity_experts:
            raise ConfigError(
                f"{self.engine.name}: its transformers module holds {self.layout.identity_experts} zero-computation "
                "experts the engine does not; full and freeze training of these experts are not supported (use LoRA)"
            )
        self.exports = True

    def train_base(self, dtype: torch.dtype | None = None) -> None:
        """Switch to full mode: the base expert weights (and biases) become trainable CPU ``nn.Parameter``s whose
        gradient the engine computes (``TrainMode.FULL``). ``dtype``: hold them in it (a copy, e.g. fp32 master
        weights of a bf16 model), else in place, without a copy. Also :meth:`export_weights`."""
        if self.hot is not None:
            raise ConfigError(
                f"gpu_experts: {self.engine.name} holds {len(self.hot.ids)} experts on the device (frozen copies); "
                "full and freeze training update the base expert weights in the engine. Set gpu_experts to 0 for "
                "finetuning_type full or freeze"
            )
        self.export_weights()
        old = self.engine
        weights = old.weights
        assert isinstance(weights, DenseExperts)
        if old.mode is TrainMode.FULL:
            return
        cast = dtype if dtype is not None and dtype != weights.storage_dtype else None

        def held(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None or cast is None else t.detach().to(cast)

        self.engine = ExpertEngine(
            DenseExperts(weights.gate_up.to(cast), weights.down.to(cast)) if cast is not None else weights,
            activation=old.act,
            gate_up_bias=held(old.gate_up_bias) if cast is not None else old.gate_up_bias,
            down_bias=held(old.down_bias) if cast is not None else old.down_bias,
            lora=old.lora,
            train_base=True,
            options=old.options,
            name=old.name,
        )
        self.memo = ForwardMemo()  # forwards of the old engine are not this one's
        self._register_base()

    @property
    def num_experts(self) -> int:
        """The layer's routed experts, which its expert LoRA is sized for (``ShardedExperts``: over every rank)."""
        return self.engine.num_experts

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[T, H]`` (any device), top_k_index ``[T, k]``, top_k_weights ``[T, k]`` -> ``[T, H]``.

        ``lora``: expert LoRA for this call (fp32 CPU, A ``[E, r, in]``, B ``[E, out, r]``, views allowed)
        instead of the engine's own. The host copies of the inputs are queued first, then the block's shared
        experts (if attached), so the device computes those while the engine runs (``moetune.layer.overlap``).
        """
        top_k_index = top_k_index.to(torch.int64)
        host = HostCopy(hidden_states, top_k_index, top_k_weights)
        if self.shared_ahead is not None:
            self.shared_ahead.launch(hidden_states)
        if self.routing_counts is not None:  # gpu_experts auto: counting (moetune.layer.hot_auto)
            e = self.engine.num_experts
            self.routing_counts += torch.bincount(host.wait()[1].reshape(-1), minlength=e)[:e]
            self.counted_on = (hidden_states.device, hidden_states.dtype)
        run = (self.engine, hidden_states, top_k_index, top_k_weights)
        if self.hot is None:  # full mode's base gradients, sparse, into the expert optimizer's buffer
            sink = self.base_grads if self.engine.mode is TrainMode.FULL else None
            return routed_experts(
                *run, training=self.training, memo=self.memo, host=host, lora=lora, sink=sink
            )
        # computed beside the engine, forward and backward (moetune.layer.hot, moetune.layer.hot_overlap)
        x_host, ids_host, w_host = host.wait()
        # all slots, before the split: the engine then sees one expert per row and could not tell duplicates
        validate_routing(ids_host, w_host, x_host.shape[0], self.engine.num_experts)
        route, hot, call_lora = self.hot.route(ids_host), self.hot, self.engine.call_lora(lora)
        return routed_experts_beside(
            *run,
            beside=lambda: hot(hidden_states, top_k_weights, route, call_lora, self.training),
            subset=route.cold,
            training=self.training,
            memo=self.memo,
            host=host,
            lora=lora,
        )

    def _expert_tensors(self) -> dict[str, torch.Tensor]:
        """The engine's dense tensors by module name (``gate_up_proj``, ``down_proj``, biases), engine layout."""
        weights = self.engine.weights
        assert isinstance(weights, DenseExperts)
        out = {GATE_UP: weights.gate_up, DOWN: weights.down}
        for name, bias in ((GATE_UP_BIAS, self.engine.gate_up_bias), (DOWN_BIAS, self.engine.down_bias)):
            if bias is not None:
                out[name] = bias
        return out

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if PEFT_WRAPPED_PREFIX in prefix:
            super()._save_to_state_dict(destination, prefix, keep_vars)
            return
        if not self.exports:
            raise SaveError(
                f"{prefix.rstrip('.') or 'this module'}: the routed experts live in moetune's CPU engine, not in "
                "torch parameters, so a state dict or save_pretrained of this model would silently leave them out. "
                "Save what you trained as an adapter instead, moetune.save_adapter(peft_model, dir) or "
                "peft_model.save_pretrained(dir) (stock PEFT format, loads on the original checkpoint), and keep "
                "using the original base checkpoint; a model trained with finetuning_type full or freeze "
                "(moetune.train.modes) saves its dense experts."
            )
        for name, t in self._expert_tensors().items():
            out = to_runtime(name, t, self.layout)
            destination[prefix + name] = out if keep_vars else out.detach()

    def _load_from_state_dict(
        self,
        state_dict: dict,
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        if not self.exports or PEFT_WRAPPED_PREFIX in prefix:
            super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
            )
            return
        mine = self._expert_tensors()
        for name, t in mine.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
                continue
            src = from_runtime(name, state_dict[key], self.layout)
            if tuple(src.shape) != tuple(t.shape):
                expected = tuple(to_runtime(name, t, self.layout).shape)
                error_msgs.append(f"{key}: expected shape {expected}, got {tuple(state_dict[key].shape)}")
                continue
            with torch.no_grad():
                t.copy_(src)
        rest = {k: v for k, v in state_dict.items() if k.startswith(prefix) and k[len(prefix) :] not in mine}
        before = len(missing_keys)
        super()._load_from_state_dict(
            rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        # in full mode the engine's tensors are also this module's parameters, which torch looked for in `rest`
        handled = {prefix + name for name in mine}
        missing_keys[before:] = [k for k in missing_keys[before:] if k not in handled]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CpuExperts:
        # model.to("cuda") / model.bfloat16() must not move or down-cast host-resident expert state:
        # the engine computes on the CPU and keeps fp32 master LoRA weights. Hot experts' device copies move
        # and cast with the model, as its other device weights.
        if self.hot is not None:
            self.hot._apply(fn)
        return self

    def extra_repr(self) -> str:
        e = self.engine
        hot = f", hot={self.hot.ids.tolist()}" if self.hot is not None else ""
        return (
            f"E={e.num_experts}, H={e.hidden_size}, I={e.intermediate_size}, format={e.weights.name}, "
            f"storage={e.weights.storage_dtype}, compute={e.compute_dtype}, mode={e.mode.value}, "
            f"policy={e.options.policy.value}{hot}"
        )


_PARAM_OF_BASE = {
    "gate_up": "gate_up_proj",
    "down": "down_proj",
    "gate_up_bias": "gate_up_proj_bias",
    "down_bias": "down_proj_bias",
}


def non_finite_base_grads(model: nn.Module) -> list[str]:
    """Parameter names (``<experts path>.gate_up_proj``, ...) whose sparse base gradients hold a NaN/Inf."""
    return [
        f"{path}.{_PARAM_OF_BASE[n]}"
        for path, m in model.named_modules()
        if isinstance(m, CpuExperts) and m.base_grads is not None
        for n in m.base_grads.non_finite()
    ]


def drop_base_grads(model: nn.Module) -> None:
    """Drop the sparse base gradients every full-mode experts module of ``model`` holds (``model.zero_grad``
    cannot see them: they are no ``.grad``); a skipped step then updates no expert."""
    for m in model.modules():
        if isinstance(m, CpuExperts) and m.base_grads is not None:
            m.base_grads.clear()


class PrescaledDenseExperts(CpuExperts):
    """Llama 4's experts call: ``experts(routed_in [E*T, H]) -> [E*T, H]``, row ``e*T + t`` holding token t
    multiplied by its router score for expert e, or zeros where e is not among its top k.

    transformers multiplies every row by its expert (E times the work of top-k routing); the engine computes the
    non-zero rows only, each with its row's expert and weight 1, and returns zeros for the others. That is exact,
    gradients included: with no biases an expert maps a zero row to ``down(act(0) * 0) = 0``, and its gradient
    there, ``up^T (act(0) * grad)``, is zero too for act(0) = 0 (SiLU, GELU, ReLU).
    """

    def __init__(self, engine: ExpertEngine, layout: ExpertsLayout | None = None, **shard: Any) -> None:
        # shard: ShardedExperts' keywords where this call form is combined with it (moetune.layer.sharded)
        super().__init__(engine, layout, **shard)
        assert engine.gate_up_bias is None and engine.down_bias is None, (
            "zero rows map to zero only without biases"
        )

    def forward(  # type: ignore[override]
        self, routed_in: torch.Tensor, lora: ExpertLoRA | None = None
    ) -> torch.Tensor:
        """routed_in ``[E*T, H]`` (any device) -> ``[E*T, H]``; ``lora`` as in :meth:`CpuExperts.forward`."""
        rows, h = routed_in.shape
        tokens = rows // self.num_experts  # E of the layer (ShardedExperts: over every rank)
        active = (
            routed_in.ne(0).any(dim=-1).nonzero().squeeze(1)
        )  # [N]: a device sync, as transformers' loops
        out = routed_in.new_zeros(rows, h)
        # also with N = 0: the engine computes no row, and a sharded module still joins its layer's exchange
        expert = torch.div(active, tokens, rounding_mode="floor").unsqueeze(1)  # [N, 1]
        ones = torch.ones(active.numel(), 1, dtype=routed_in.dtype, device=routed_in.device)  # [N, 1]
        y = super().forward(routed_in.index_select(0, active), expert, ones, lora=lora)
        return out.index_copy(0, active, y)


class IdentityExperts(CpuExperts):
    """LongCat-Flash's experts call: ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` where
    ids ``>= E`` name zero-computation experts that return the token itself.

    Their share, ``sum_j w[t, j] * x[t]`` over such slots, is computed on the device; each remaining slot goes
    to the engine as a row of its own (``[N, H]`` with ``k = 1``, since tokens keep different numbers of real
    experts) and is added back to its token.
    """

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[T, H]``, top_k_index ``[T, k]``, top_k_weights ``[T, k]`` -> ``[T, H]``; ``lora`` as in
        :meth:`CpuExperts.forward`."""
        real = top_k_index < self.num_experts  # [T, k]; E of the layer (ShardedExperts: over every rank)
        # summed in the wider of the two dtypes, as transformers adds each slot's w * x: float32 weights of a
        # float64 model are not rounded to float32 again
        wide = torch.promote_types(top_k_weights.dtype, hidden_states.dtype)
        identity = (
            (top_k_weights.to(wide) * ~real).sum(dim=-1, keepdim=True).to(hidden_states.dtype)
        )  # [T, 1]
        out = identity * hidden_states
        token, slot = real.nonzero(as_tuple=True)  # [N] each: a device sync, as transformers' own loop
        # also with N = 0: the engine computes no row, and a sharded module still joins its layer's exchange
        y = super().forward(
            hidden_states.index_select(0, token),
            top_k_index[token, slot].unsqueeze(1),
            top_k_weights[token, slot].unsqueeze(1),
            lora=lora,
        )
        return out.index_add(0, token, y.to(out.dtype))


class PostNormExperts(CpuExperts):
    """Muse Spark's experts call: ``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` computing
    ``sum_j w[t, j] * norm(FFN_e(x[t]))``, ``norm`` the replaced module's ``post_expert_norm`` (set on this one by
    the loader, ``ArchSpec.kept_modules``: a torch module on the model's device).

    Each (token, slot) goes to the engine as a row of its own with weight 1 (``[T*k, H]``, ``k = 1``), so the
    engine returns every unweighted expert output; the norm and the routing weights apply here, on the device,
    and autograd differentiates them (the norm's weight included) exactly. The engine computes the same T*k
    rows as for a weighted call; the host copies of the input and output grow k-fold.
    """

    post_expert_norm: nn.Module

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[T, H]``, top_k_index ``[T, k]``, top_k_weights ``[T, k]`` -> ``[T, H]``; ``lora`` as in
        :meth:`CpuExperts.forward`."""
        t, k = top_k_index.shape
        rows = hidden_states.repeat_interleave(k, dim=0)  # [T*k, H]: row t*k + j is token t for slot j
        ones = torch.ones(t * k, 1, dtype=hidden_states.dtype, device=hidden_states.device)  # [T*k, 1]
        y = super().forward(rows, top_k_index.reshape(t * k, 1), ones, lora=lora)  # [T*k, H] unweighted
        y = self.post_expert_norm(y) * top_k_weights.reshape(t * k, 1)
        return y.view(t, k, -1).sum(dim=1).to(hidden_states.dtype)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> PostNormExperts:
        # the norm is a device module of the model: it moves and casts with it (the engine's state does not)
        if recurse:
            self.post_expert_norm._apply(fn)
        super()._apply(fn, recurse)  # the hot experts' device copies, if any
        return self


class BatchedExperts(CpuExperts):
    """DBRX's experts call: ``experts(hidden [B, S, H], top_k_index [B*S, k], top_k_weights [B*S, k]) -> [B, S, H]``:
    the tokens are flattened for the engine and the batch shape restored."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        lora: ExpertLoRA | None = None,
    ) -> torch.Tensor:
        """hidden_states ``[B, S, H]``, top_k_index and top_k_weights ``[B*S, k]`` -> ``[B, S, H]``; ``lora`` as in
        :meth:`CpuExperts.forward`."""
        h = hidden_states.shape[-1]
        y = super().forward(hidden_states.reshape(-1, h), top_k_index, top_k_weights, lora=lora)
        return y.view(hidden_states.shape[0], -1, h)


EXPERTS_MODULES: dict[ExpertsCall, type[CpuExperts]] = {
    ExpertsCall.TOPK: CpuExperts,
    ExpertsCall.TOPK_POST_NORM: PostNormExperts,
    ExpertsCall.TOPK_BATCHED: BatchedExperts,
    ExpertsCall.TOPK_WITH_IDENTITY: IdentityExperts,
    ExpertsCall.PRESCALED_DENSE: PrescaledDenseExperts,
}
"""The module that takes an experts module's place, by how the family's block calls it (``ArchSpec.call``)."""
