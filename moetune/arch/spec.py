"""What moetune knows about a routing family: ``ArchSpec``, the ``ARCHS`` registry and its one lookup.

A spec says which transformers ``model_type``s it covers, how the family routes (for logs and docs:
the routing itself always stays in the model's own MoE block and router module), where the block keeps
its router, and the variants a family needs: where the experts module computes something other than
``act(gate) * up``, the engine activation that reproduces it; where its class lacks transformers' layout
flags, the flags; where the block calls its experts other than with top-k ids and weights, the call.
Everything else (E, H, I, layout, biases) is read off the experts modules themselves by
``moetune.arch.detect``.

The ``generic`` spec is the fallback for any model type not registered here: it works for every model
whose experts modules follow the transformers v5 layout, detected from their attributes and shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from moetune.errors import RegistryError
from moetune.registry import Registry

ActivationResolver = Callable[[Any], tuple[str, dict[str, float]]]
"""experts module -> (engine activation name, its keyword arguments)."""


class ExpertsCall(str, Enum):
    """How the family's MoE block calls its experts module (moetune's replacement takes the same call)."""

    TOPK = "experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]"
    TOPK_WITH_IDENTITY = (
        "experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], where ids E..E+Z-1 name "
        "zero-computation experts that return the token itself (LongCat-Flash)"
    )
    TOPK_POST_NORM = (
        "experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H], each expert's output "
        "normalised by the module's post_expert_norm before its routing weight applies (Muse Spark)"
    )
    TOPK_BATCHED = (
        "experts(hidden [B, S, H], top_k_index [B*S, k], top_k_weights [B*S, k]) -> [B, S, H] (DBRX)"
    )
    PRESCALED_DENSE = (
        "experts(routed_in [E*T, H]) -> [E*T, H]: row e*T + t is token t scaled by its router score for "
        "expert e, zero where e is not among its top k (Llama 4)"
    )


@dataclass(frozen=True)
class LayoutFlags:
    """The layout flags ``use_experts_implementation`` records on an experts module, for families whose experts
    class lacks the decorator (see ``moetune.arch.detect``)."""

    is_transposed: bool = False  # gate_up [E, H, 2I], down [E, I, H]
    is_concatenated: bool = True  # gate block then up block along 2I (else interleaved)
    has_bias: bool = False
    has_gate: bool = True


@dataclass(frozen=True)
class FlatTensors:
    """Experts kept as one 2-D ``[E*I, H]`` matrix per projection, expert e's rows ``e*I .. (e+1)*I`` (DBRX), for a
    family whose experts module has neither fused 3-D tensors nor transformers' layout flags.

    Each name is an attribute path under the experts module (``"mlp.w1"``), also the checkpoint key's tail.
    """

    gate: str  # [E*I, H]: gate rows of each expert, [out, in]
    up: str  # [E*I, H]: up rows, [out, in]
    down: str  # [E*I, H]: each expert's down matrix transposed ([in, out]: the module computes h @ W_e)
    activation: str  # attribute path of the gate's activation module (a transformers act_fn)
    num_experts: str = "num_experts"  # attribute of the experts module holding E

    @property
    def names(self) -> tuple[str, str, str]:
        """The three tensors, gate, up, down."""
        return (self.gate, self.up, self.down)


class Routing(str, Enum):
    """How a family turns router logits into top-k ids and weights (computed by the model, not by moetune)."""

    SOFTMAX_TOPK = "softmax over E, top-k (optionally renormalised)"
    SOFTMAX_GROUP_LIMITED = "softmax over E, top-k within the best expert groups, scaled"
    SIGMOID_GROUP_LIMITED = (
        "sigmoid scores + correction bias, top-k within the best groups, renormalised, scaled"
    )
    TOPK_SOFTMAX = "top-k of the logits, softmax over the k"
    TOPK_SIGMOID_PRESCALED = (
        "top-k of the logits, sigmoid of each, multiplied into the token before its expert"
    )
    MODEL_DEFINED = "whatever the model's own router computes"


@dataclass(frozen=True)
class ArchSpec:
    """One routing family.

    Args:
        name: registry name.
        model_types: transformers ``config.model_type`` values it covers; empty for the generic fallback.
        routing: how the family routes (informational: the model's router module is kept and run as is).
        router_attr: attribute of the MoE block holding the router, checked at load so a renamed router in a
            future transformers fails loudly; None where unknown (generic).
        activation: resolves the engine activation of an experts module whose ``_apply_gate`` is not
            transformers' default ``act_fn(gate) * up``; None for families that use the default.
        shared_attr: attribute of the MoE block holding shared experts that the block calls after its
            experts, as ``shared(x)`` on the experts' input; moetune queues them before the CPU engine runs
            so the device computes them meanwhile (``moetune.layer.overlap``). None: not known to.
        layout: the layout flags of an experts class without ``use_experts_implementation`` (Llama 4,
            Step-3.7); None: the modules must carry the flags themselves.
        call: how the MoE block calls its experts.
        identity_attr: for ``ExpertsCall.TOPK_WITH_IDENTITY``, the experts module's attribute holding the number
            Z of zero-computation experts (ids E..E+Z-1 after the E routed ones).
        kept_modules: submodules of the experts module that stay torch modules on the model's device, moved
            onto moetune's replacement (Muse Spark's ``post_expert_norm``, which ``ExpertsCall.TOPK_POST_NORM``
            applies); their checkpoint tensors load through transformers, not into the engine.
        flat: the experts' tensors where the module keeps one flat ``[E*I, H]`` matrix per projection (DBRX);
            None: fused 3-D tensors, read off the module.
        unsupported: why the family cannot run on the engine (its experts are not gated MLPs routed top-k);
            ``find_experts`` refuses it with this reason. None: supported.
    """

    name: str
    model_types: tuple[str, ...]
    routing: Routing
    router_attr: str | None = "gate"
    activation: ActivationResolver | None = field(default=None, compare=False)
    shared_attr: str | None = None
    layout: LayoutFlags | None = None
    call: ExpertsCall = ExpertsCall.TOPK
    identity_attr: str | None = None
    kept_modules: tuple[str, ...] = ()
    flat: FlatTensors | None = None
    unsupported: str | None = None

    def describe(self) -> str:
        """One line for error messages: the model types and the routing."""
        types = ", ".join(self.model_types) if self.model_types else "any model type"
        return f"{self.name} ({types}: {self.routing.value})"


ARCHS: Registry[ArchSpec] = Registry("architecture")

GENERIC = "generic"


def register(spec: ArchSpec) -> ArchSpec:
    """Add ``spec`` to ``ARCHS`` (family modules call this at import). A model type claimed twice raises,
    so the lookup below never depends on registration order."""
    for name in ARCHS:
        taken = set(ARCHS.get(name).model_types) & set(spec.model_types)
        if taken:
            raise RegistryError(f"model types {sorted(taken)} are claimed by both {name!r} and {spec.name!r}")
    ARCHS.register(spec.name)(spec)
    return spec


def resolve_arch(model_type: str) -> ArchSpec:
    """The spec whose ``model_types`` name ``model_type``; otherwise the generic v5-layout spec.

    The generic spec does not promise support: ``detect.find_experts`` then decides from the model's
    modules and raises ``ArchError`` listing ``supported_summary()`` when they do not fit.
    """
    for name in ARCHS:
        spec = ARCHS.get(name)
        if model_type in spec.model_types:
            return spec
    return ARCHS.get(GENERIC)


def supported_summary() -> str:
    """Every registered family with its model types, then the generic rule; for error messages."""
    families = [s for n in ARCHS if n != GENERIC and (s := ARCHS.get(n)).unsupported is None]
    lines = [f"  - {s.describe()}" for s in families]
    lines.append(
        "  - generic: any other transformers model whose experts modules follow the v5 layout "
        "(gate_up_proj [E, 2I, H], down_proj [E, H, I], called as "
        "experts(hidden, top_k_index, top_k_weights))"
    )
    return "\n".join(lines)


def supported_model_types() -> list[str]:
    """The model types registered by name as supported (the generic fallback may cover more)."""
    return sorted(t for n in ARCHS if (s := ARCHS.get(n)).unsupported is None for t in s.model_types)
