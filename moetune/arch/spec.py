"""What moetune knows about a routing family: ``ArchSpec``, the ``ARCHS`` registry and its one lookup.

A spec says which transformers ``model_type``s it covers, how the family routes (for logs and docs:
the routing itself always stays in the model's own MoE block and router module), where the block keeps
its router, and, only where the experts module computes something other than ``act(gate) * up``, the
engine activation that reproduces it. Everything else (E, H, I, layout, biases) is read off the experts
modules themselves by ``moetune.arch.detect``.

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


class Routing(str, Enum):
    """How a family turns router logits into top-k ids and weights (computed by the model, not by moetune)."""

    SOFTMAX_TOPK = "softmax over E, top-k (optionally renormalised)"
    SOFTMAX_GROUP_LIMITED = "softmax over E, top-k within the best expert groups, scaled"
    SIGMOID_GROUP_LIMITED = (
        "sigmoid scores + correction bias, top-k within the best groups, renormalised, scaled"
    )
    TOPK_SOFTMAX = "top-k of the logits, softmax over the k"
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
    """

    name: str
    model_types: tuple[str, ...]
    routing: Routing
    router_attr: str | None = "gate"
    activation: ActivationResolver | None = field(default=None, compare=False)
    shared_attr: str | None = None

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
    families = [ARCHS.get(n) for n in ARCHS if n != GENERIC]
    lines = [f"  - {s.describe()}" for s in families]
    lines.append(
        "  - generic: any other transformers model whose experts modules follow the v5 layout "
        "(gate_up_proj [E, 2I, H], down_proj [E, H, I], called as "
        "experts(hidden, top_k_index, top_k_weights))"
    )
    return "\n".join(lines)


def supported_model_types() -> list[str]:
    """The model types registered by name (the generic fallback may cover more)."""
    return sorted(t for n in ARCHS for t in ARCHS.get(n).model_types)
