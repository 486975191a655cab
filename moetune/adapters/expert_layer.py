"""``ExpertsLora``: routed-expert LoRA as a PEFT LoRA layer around a ``CpuExperts``, in stock PEFT's layout.

Stock PEFT adapts a transformers experts module's fused parameters with one ``lora.ParamWrapper`` per
parameter, nested in the module's registration order (``moetune.adapters.peft_layout``). Around a
``CpuExperts`` at path ``P`` moetune builds the same nesting out of two ``ExpertsLora`` layers::

    P                          ExpertsLora("down")     lora_A.<adapter>: Linear(I, r * E)  lora_B: Linear(r * E, H)
    P.base_layer               ExpertsLora("gate_up")  lora_A.<adapter>: Linear(H, r * E)  lora_B: Linear(r * E, 2I)
    P.base_layer.base_layer    CpuExperts

so the LoRA tensors have exactly the names, shapes and layout of ParamWrapper's (gpt-oss's gate_up ``lora_B``
rows interleaved, as its module orders its outputs; Llama 4's in and out swapped, as PEFT reads its flagless
transposed experts), and PEFT treats them as its own:
``get_peft_model_state_dict`` / ``save_pretrained`` / a plain ``Trainer``'s checkpoints write them,
``set_peft_model_state_dict`` / ``load_adapter`` read them, ``set_adapter``, ``disable_adapter``,
``delete_adapter`` and ``unload`` act on them, and the adapter file loads in stock PEFT on the unmodified
transformers model. A new adapter on a wrapped module is added in place by ``update_layer`` (PEFT calls it for
a ``target_modules`` entry naming the experts module). Tensors are fp32 on the host whatever the model's
dtype: the engine computes with them there and the optimizer updates them in place (bf16 masters would lose
small updates); ``model.to(...)`` leaves them alone, as it leaves ``CpuExperts``.

Forward (the outer layer): the active adapter's four tensors, seen in the engine layout (views: A ``[E, r, in]``,
B ``[E, out, r]``; an interleaved gate_up B with the row order that de-interleaves it), go with the call to
the engine, so autograd hands their gradients to PEFT's parameters. With adapters disabled, or no active adapter
on this module, the experts run without LoRA. The engine runs one LoRA per call: two active adapters at
once, mixed-adapter batches and merging into the engine's (possibly quantized) weights raise
:class:`~moetune.errors.AdapterError`.

PEFT cannot create these layers itself (``get_peft_model`` with a ``_register_custom_module`` mapping for
``CpuExperts``): ``LoraModel._replace_module`` reads the device of the replaced module's first parameter
(``next(child.parameters())``) and ``CpuExperts`` has none. moetune therefore wraps each targeted experts
module, without adapters, before ``get_peft_model`` runs (``moetune.adapters.apply``).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from peft.tuners.lora import LoraLayer
from torch import nn

from moetune.adapters.expert_rows import HeldRows, Kind, held_part, share
from moetune.adapters.peft_layout import ExpertParamNames, engine_view
from moetune.engine import ExpertLoRA, lora_scaling
from moetune.errors import AdapterError
from moetune.layer import CpuExperts
from moetune.layer.sharded import ShardedExperts

Projection = Literal["gate_up", "down"]
INITS = (True, False, "gaussian")  # PEFT's init_lora_weights values that need no base weight


class ExpertsLora(nn.Module, LoraLayer):
    """PEFT LoRA on one fused projection of a ``CpuExperts`` (``ParamWrapper``'s tensors); build with :func:`wrap`.

    ``in_features`` / ``out_features`` are the projection's (gate_up: H -> 2I, down: I -> H; the other way round
    where PEFT swaps them, ``ExpertParamNames.swapped``); each adapter's ``lora_A`` is ``Linear(in, r * E)`` and
    ``lora_B`` ``Linear(r * E, out)`` as in ``ParamWrapper``.
    """

    def __init__(self, base_layer: nn.Module, projection: Projection) -> None:
        self.projection = projection  # read by _get_in_out_features during LoraLayer.__init__
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        # a whole adapter (a file, a checkpoint) loads into a sharded layer's rows: cut to them on the way in
        self.register_load_state_dict_pre_hook(_held_from_whole)

    @property
    def experts(self) -> CpuExperts:
        """The wrapped routed-experts module."""
        experts = self.get_base_layer()
        assert isinstance(experts, CpuExperts), type(experts)
        return experts

    @property
    def num_experts(self) -> int:
        return self.experts.num_experts

    @property
    def lora_experts(self) -> int:
        """Experts this projection's LoRA is sized for, as stock PEFT sizes it from the module's parameter:
        gate_up also counts the zero-computation experts whose unused rows it holds (LongCat-Flash's
        ``[E + Z, 2I, H]``); the engine reads the first E."""
        layout = self.experts.layout
        extra = layout.identity_experts if layout is not None and self.projection == "gate_up" else 0
        return self.num_experts + extra

    @property
    def held_experts(self) -> tuple[int, int]:
        """(first, count): the experts whose LoRA rows this layer holds; all ``lora_experts`` of them, or, around
        a :class:`ShardedExperts` (``expert_parallel: sharded``), this rank's, with the zero-computation experts'
        unused rows on the last rank (``moetune.adapters.expert_rows.share``)."""
        experts = self.experts
        if isinstance(experts, ShardedExperts):
            return share(experts.num_experts, self.lora_experts, experts.owners.world, experts.rank)
        return 0, self.lora_experts

    def held_rows(self, kind: Kind, adapter_name: str) -> HeldRows:
        """Where adapter ``adapter_name``'s ``lora_A`` (kind A) or ``lora_B`` (kind B) rows sit among the layer's."""
        first, count = self.held_experts
        return HeldRows(kind, self.r[adapter_name], first, count, self.lora_experts)

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        assert isinstance(module, CpuExperts), type(module)
        flat = module.layout.flat if module.layout is not None else None
        if flat is not None:  # refused where an expert LoRA layer is created, before any training
            raise AdapterError(
                f"{module.engine.name}: these experts are flat [E*I, H] matrices ({', '.join(flat.names)}: DBRX); "
                "stock PEFT adapts such a parameter with one low-rank update of the whole matrix, A shared by all "
                "experts, which moetune's per-expert LoRA does not compute. Leave the experts out of lora_target "
                "on this family (lora_target: Wqkv,out_proj trains DBRX's attention)"
            )
        h, i = module.engine.hidden_size, module.engine.intermediate_size
        names = ExpertParamNames.of(module)
        gate_up_out = i if names.tied else 2 * i  # non-gated: up_proj's I rows
        n_in, n_out = (h, gate_up_out) if self.projection == "gate_up" else (i, h)
        # PEFT's roles the other way round (Llama 4): its lora_A on the projection's output side, as stock PEFT
        return (n_out, n_in) if names.swapped else (n_in, n_out)

    def update_layer(self, adapter_name: str, r: int, lora_alpha: float, config: Any, **kwargs: Any) -> None:
        """Add adapter ``adapter_name`` (rank ``r``) to this projection and, on the outer layer, to the inner one.

        The inner layer draws its initial A first, as stock PEFT creates the inner ``ParamWrapper`` first.
        """
        if isinstance(self.base_layer, ExpertsLora):
            self.base_layer.update_layer(adapter_name, r, lora_alpha, config, **kwargs)
        self._check_supported(config, adapter_name)
        if r <= 0:
            raise AdapterError(f"adapter {adapter_name!r}: LoRA rank r must be a positive integer; got {r}")
        self.r[adapter_name] = r
        self.lora_alpha[adapter_name] = lora_alpha
        # the engine applies dropout to each projection's input (an nn.Dropout here only records p; no state)
        p = float(config.lora_dropout)
        self.lora_dropout[adapter_name] = nn.Dropout(p) if p > 0 else nn.Identity()
        rows = r * self.lora_experts
        n_in, n_out = self._get_in_out_features(self.experts)
        self.lora_A[adapter_name] = nn.Linear(n_in, rows, bias=False, dtype=torch.float32)
        self.lora_B[adapter_name] = nn.Linear(rows, n_out, bias=False, dtype=torch.float32)
        self.lora_bias[adapter_name] = False
        self.use_rslora[adapter_name] = bool(config.use_rslora)
        self.use_dora[adapter_name] = False
        self.scaling[adapter_name] = lora_scaling(r, lora_alpha, bool(config.use_rslora))
        self.reset_lora_parameters(adapter_name, config.init_lora_weights)
        self._keep_held_rows(adapter_name)
        self.set_adapter(self.active_adapters, inference_mode=config.inference_mode)

    def _keep_held_rows(self, adapter_name: str) -> None:
        """Sharded experts: keep only this rank's experts' rows of the adapter's tensors, drawn whole first (the
        same draw as one process makes, so every rank's rows are one process's)."""
        for kind, linear in (("A", self.lora_A[adapter_name]), ("B", self.lora_B[adapter_name])):
            rows = self.held_rows(kind, adapter_name)  # type: ignore[arg-type]
            if rows.whole:
                return
            assert isinstance(linear, nn.Linear)
            linear.weight = nn.Parameter(held_part(linear.weight.data, rows))
            linear.in_features, linear.out_features = linear.weight.shape[1], linear.weight.shape[0]

    def _check_supported(self, config: Any, adapter_name: str) -> None:
        """Raise for LoRA options the engine does not implement (the ones ``ParamWrapper`` refuses too)."""
        bad = {
            name: getattr(config, name, None)
            for name in ("use_dora", "lora_bias", "fan_in_fan_out", "velora_config", "kasa_config")
            if getattr(config, name, None)
        }
        variant = self.resolve_lora_variant(config=config)
        if variant is not None:
            bad["variant"] = type(variant).__name__
        if config.init_lora_weights not in INITS:
            bad["init_lora_weights"] = config.init_lora_weights
        if bad:
            raise AdapterError(
                f"adapter {adapter_name!r}: {bad} is not supported for routed-expert LoRA (moetune's expert "
                f"engine runs plain LoRA: no LoRA variants, biases or fan_in_fan_out; init_lora_weights one of "
                f"{list(INITS)})"
            )

    def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device: Any = None) -> None:
        # expert LoRA stays fp32 on the host, where the engine computes with it
        return

    def _apply(self, fn: Any, recurse: bool = True) -> ExpertsLora:
        # model.to("cuda") / model.bfloat16() must not move or down-cast the host-resident fp32 LoRA
        return self

    def engine_lora(self) -> ExpertLoRA | None:
        """The active adapter's expert LoRA in the engine layout, or None (adapters disabled or none here).

        Views of both layers' parameters (gradients flow back to them); fp32, A ``[E, r, in]``, B ``[E, out, r]``.
        """
        if self.disable_adapters:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if not active:
            return None
        if len(active) > 1:
            raise AdapterError(
                f"adapters {active} are active together on routed experts; moetune's expert engine runs one "
                "expert LoRA per call. Activate one (peft_model.set_adapter(name)), or merge them into one "
                "adapter first (peft_model.add_weighted_adapter)."
            )
        (name,) = active
        layers = {layer.projection: layer for layer in self._chain()}
        assert set(layers) == {"gate_up", "down"}, set(layers)
        names = ExpertParamNames.of(self.experts)
        tensors: dict[str, torch.Tensor] = {}
        for proj, layer in layers.items():
            lora_a, lora_b = layer.lora_A[name], layer.lora_B[name]
            assert isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)
            a, b = engine_view(lora_a.weight, lora_b.weight, layer.held_experts[1], swapped=names.swapped)
            # the engine's experts: the first of the held rows (the zero-computation experts' rows come after)
            used = self.experts.engine.num_experts
            tensors[f"{proj}_A"], tensors[f"{proj}_B"] = a[:used], b[:used]
        # the engine keeps gate rows first: an interleaved module's gate_up B is read through the row order, a
        # non-gated module's up B serves both halves
        rows = names.engine_rows(tensors["gate_up_B"].shape[1])
        p = getattr(self.lora_dropout[name], "p", 0.0)
        return ExpertLoRA(**tensors, scaling=self.scaling[name], dropout=p, gate_up_rows=rows)

    def _chain(self) -> list[ExpertsLora]:
        layers: list[ExpertsLora] = []
        layer: nn.Module = self
        while isinstance(layer, ExpertsLora):
            layers.append(layer)
            layer = layer.base_layer
        return layers

    def forward(self, *args: torch.Tensor, adapter_names: list[str] | None = None) -> torch.Tensor:
        """The wrapped experts module's own call (for a v5 experts module: hidden_states ``[T, H]``,
        top_k_index ``[T, k]``, top_k_weights ``[T, k]`` -> ``[T, H]``; Llama 4's: routed_in ``[E*T, H]``), with
        the active adapter's expert LoRA."""
        if adapter_names is not None:
            raise AdapterError(
                "mixed-adapter batches (adapter_names=...) are not supported on routed experts: moetune's "
                "expert engine runs one expert LoRA per call; run one adapter per batch"
            )
        return self.experts(*args, lora=self.engine_lora())

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise AdapterError(
            f"merging LoRA into routed experts held by moetune's CPU engine is not supported (module "
            f"{type(self.experts).__name__}, format {self.experts.engine.weights.name}). Use the adapter "
            "unmerged, or merge it on the plain transformers model: "
            "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir).merge_and_unload(). "
            "Linear LoRA layers PEFT visited before this one may already be merged: reload the model."
        )

    def unmerge(self) -> None:
        # merge() always raises, so nothing here is ever merged: unmerging leaves the layer as it is
        return

    def extra_repr(self) -> str:
        return f"projection={self.projection}, in={self.in_features}, out={self.out_features}, E={self.num_experts}"


def _held_from_whole(
    layer: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
) -> None:
    """``load_state_dict`` pre-hook of an :class:`ExpertsLora`: a whole adapter's tensors (every expert's rows)
    are cut to the rows this layer holds, so stock PEFT loading (``load_adapter``, ``set_peft_model_state_dict``)
    fills a sharded layer from the adapter one process writes. Tensors already of the held shape load as they are;
    any other shape reaches ``load_state_dict``'s own size check."""
    assert isinstance(layer, ExpertsLora)
    for kind, tensors in (("A", layer.lora_A), ("B", layer.lora_B)):
        for name in tensors:
            key = f"{prefix}lora_{kind}.{name}.weight"
            rows = layer.held_rows(kind, name)  # type: ignore[arg-type]
            value = state_dict.get(key)
            if not rows.whole and isinstance(value, torch.Tensor) and rows.is_whole(value):
                state_dict[key] = held_part(value, rows)


def wrap(experts: CpuExperts) -> ExpertsLora:
    """The two nested ``ExpertsLora`` layers (no adapter yet) around ``experts``; returns the outer one.

    The parameter the replaced module registers first is wrapped innermost, as PEFT nests ``ParamWrapper``.
    """
    order: tuple[Projection, Projection] = ("gate_up", "down")
    first, second = order if ExpertParamNames.of(experts).gate_up_first else order[::-1]
    return ExpertsLora(ExpertsLora(experts, first), second)
