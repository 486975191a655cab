"""Find a model's routed-experts modules and read their weight layout off the modules themselves.

transformers 5 decorates each experts class with ``use_experts_implementation``, which fixes the call
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` and stores the layout
on every instance: ``is_transposed`` (``x @ W`` with gate_up ``[E, H, 2I]``, down ``[E, I, H]``, instead of
``W x`` with ``[E, 2I, H]`` / ``[E, H, I]``), ``is_concatenated`` (gate block then up block, else gate/up
interleaved along 2I), ``has_bias``, ``has_gate`` and ``has_post_expert_norm``. E, H and I come from the
parameter shapes; the activation from ``act_fn`` unless the class computes its own ``_apply_gate``, which
the family's ``ArchSpec.activation`` must then name. Works on a model built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moetune.arch.spec import ArchSpec, supported_summary
from moetune.engine import ACTIVATIONS
from moetune.errors import ArchError

GATE_UP, DOWN, GATE_UP_BIAS, DOWN_BIAS = "gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"
LAYOUT_FLAGS = ("is_transposed", "is_concatenated", "has_bias", "has_gate")


def _act_fn_names() -> dict[type, str]:
    """transformers activation classes whose ``act(gate) * up`` the engine computes, by exact type."""
    from transformers.activations import GELUActivation, GELUTanh, SiLUActivation

    return {
        SiLUActivation: "silu",
        nn.SiLU: "silu",
        GELUActivation: "gelu",
        GELUTanh: "gelu_pytorch_tanh",
        nn.ReLU: "relu",
    }


@dataclass(frozen=True)
class ExpertsLayout:
    """How one experts module stores its E experts at run time, and the engine activation they need."""

    num_experts: int  # E
    hidden_size: int  # H
    intermediate_size: int  # I
    transposed: bool  # gate_up [E, H, 2I], down [E, I, H] (else [E, 2I, H], [E, H, I])
    interleaved: bool  # gate at even, up at odd indices of 2I (else gate block first)
    has_bias: bool  # gate_up_proj_bias [E, 2I] (same order as gate_up), down_proj_bias [E, H]
    activation: str  # a name in moetune.engine.ACTIVATIONS
    activation_kwargs: tuple[tuple[str, float], ...] = ()

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The experts module's tensors, as named in the module and in fused checkpoints."""
        return (GATE_UP, DOWN, GATE_UP_BIAS, DOWN_BIAS) if self.has_bias else (GATE_UP, DOWN)

    def runtime_shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` in the transformers module."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        return {
            GATE_UP: (e, h, 2 * i) if self.transposed else (e, 2 * i, h),
            DOWN: (e, i, h) if self.transposed else (e, h, i),
            GATE_UP_BIAS: (e, 2 * i),
            DOWN_BIAS: (e, h),
        }[name]


@dataclass(frozen=True)
class ExpertsSite:
    """One experts module of a model: where it is, how it is laid out, which router feeds it."""

    path: str  # e.g. "model.layers.3.mlp.experts"
    layout: ExpertsLayout
    router: str | None  # path of the block's router module, kept on the model's device


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) else None


def _looks_like_experts(module: nn.Module) -> bool:
    gate_up, down = _tensor(module, GATE_UP), _tensor(module, DOWN)
    return gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3


def _activation(module: nn.Module, spec: ArchSpec, path: str) -> tuple[str, dict[str, float]]:
    from transformers.integrations.moe import _default_apply_gate  # the v5 default: act_fn(gate) * up

    if getattr(type(module), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        if spec.activation is None:
            raise ArchError(
                f"{path} ({type(module).__name__}) computes its own gated activation (_apply_gate), which "
                f"the {spec.name!r} spec does not describe; moetune cannot know what it computes. "
                f"Supported:\n"
                f"{supported_summary()}"
            )
        name, kwargs = spec.activation(module)
    else:
        act = getattr(module, "act_fn", None)
        names = _act_fn_names()
        if type(act) not in names:
            raise ArchError(
                f"{path}: expert activation {type(act).__name__} is not one the engine computes; supported "
                f"act_fn classes: {', '.join(sorted(c.__name__ for c in names))}"
            )
        name, kwargs = names[type(act)], {}
    if name not in ACTIVATIONS:
        raise ArchError(
            f"{path}: activation {name!r} is not registered in the engine ({ACTIVATIONS.names()})"
        )
    return name, kwargs


def read_layout(module: nn.Module, spec: ArchSpec, path: str) -> ExpertsLayout:
    """The layout of one v5 experts module; ``ArchError`` naming ``path`` if the engine cannot run it."""
    missing = [f for f in LAYOUT_FLAGS if not hasattr(module, f)]
    if missing:
        raise ArchError(
            f"{path} ({type(module).__name__}) has 3-D gate_up_proj/down_proj but not the layout flags "
            f"{missing} that transformers' use_experts_implementation sets, so its call signature and "
            f"layout are unknown. Supported:\n{supported_summary()}"
        )
    if not module.has_gate or getattr(module, "has_post_expert_norm", False):
        raise ArchError(
            f"{path} ({type(module).__name__}): experts without a gate projection or with a post-expert norm "
            "are not supported by the engine (it computes down(act(gate) * up))"
        )
    gate_up, down = _tensor(module, GATE_UP), _tensor(module, DOWN)
    assert gate_up is not None and down is not None
    transposed = bool(module.is_transposed)
    e, two_i, h = (
        (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1]) if transposed else tuple(gate_up.shape)
    )
    if two_i % 2:
        raise ArchError(f"{path}: gate_up_proj {tuple(gate_up.shape)} has an odd 2I dimension ({two_i})")
    act, kwargs = _activation(module, spec, path)
    layout = ExpertsLayout(
        num_experts=e,
        hidden_size=h,
        intermediate_size=two_i // 2,
        transposed=transposed,
        interleaved=not module.is_concatenated,
        has_bias=bool(module.has_bias),
        activation=act,
        activation_kwargs=tuple(sorted(kwargs.items())),
    )
    for name in layout.tensor_names:
        t = _tensor(module, name)
        if t is None or tuple(t.shape) != layout.runtime_shape(name):
            raise ArchError(
                f"{path} ({type(module).__name__}, is_transposed={transposed}, has_bias={layout.has_bias}): "
                f"{name} is {None if t is None else tuple(t.shape)}, expected {layout.runtime_shape(name)} "
                f"from gate_up_proj {tuple(gate_up.shape)}"
            )
    return layout


def _router(model: nn.Module, path: str, spec: ArchSpec) -> str | None:
    if spec.router_attr is None:
        return None
    block_path = path.rpartition(".")[0]
    router = getattr(model.get_submodule(block_path), spec.router_attr, None)
    if not isinstance(router, nn.Module):
        raise ArchError(
            f"the {spec.name!r} spec expects the MoE block {block_path or '<root>'} to keep its router in "
            f".{spec.router_attr}; it has none (did transformers rename it?)"
        )
    return f"{block_path}.{spec.router_attr}" if block_path else spec.router_attr


def find_experts(model: nn.Module, spec: ArchSpec, model_type: str) -> list[ExpertsSite]:
    """Every routed-experts module of ``model``, in module order; ``ArchError`` when there is none."""
    sites = [
        ExpertsSite(path, read_layout(module, spec, path), _router(model, path, spec))
        for path, module in model.named_modules()
        if _looks_like_experts(module)
    ]
    if not sites:
        raise ArchError(
            f"model_type {model_type!r} ({type(model).__name__}) is not a supported MoE architecture: none "
            "of its modules is a routed-experts module (searched every module for 3-D gate_up_proj and "
            f"down_proj tensors). Supported:\n{supported_summary()}"
        )
    return sites
