"""Find a model's routed-experts modules and read their weight layout off the modules themselves.

transformers 5 decorates each experts class with ``use_experts_implementation``, which fixes the call
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` and stores the layout
on every instance: ``is_transposed`` (``x @ W`` with gate_up ``[E, H, 2I]``, down ``[E, I, H]``, instead of
``W x`` with ``[E, 2I, H]`` / ``[E, H, I]``), ``is_concatenated`` (gate block then up block, else gate/up
interleaved along 2I), ``has_bias``, ``has_gate`` and ``has_post_expert_norm``; for an experts class without
the decorator the family's ``ArchSpec.layout`` gives them. E, H and I come from the parameter shapes; the
activation from ``act_fn`` (a transformers activation module or a plain function) unless the class computes
its own ``_apply_gate``, which the family's ``ArchSpec.activation`` must then name and which is checked against
the module's own on a random probe. Non-gated experts (``has_gate=False``: ``up_proj`` ``[E, I, H]``) are held as
gated ones on tied rows where their activation is ``f(u) * u`` (``relu2``); a per-expert output norm
(``has_post_expert_norm``) needs a spec with the ``TOPK_POST_NORM`` call; a spec's ``FlatTensors`` describe experts
kept as flat ``[E*I, H]`` matrices (DBRX). Works on a model built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetune.arch.spec import ArchSpec, ExpertsCall, FlatTensors, LayoutFlags, supported_summary
from moetune.engine import ACTIVATIONS
from moetune.errors import ArchError

GATE_UP, DOWN, GATE_UP_BIAS, DOWN_BIAS = "gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"
UP = "up_proj"  # the first projection of non-gated experts (has_gate=False): [E, I, H]
LAYOUT_FLAGS = ("is_transposed", "is_concatenated", "has_bias", "has_gate")  # LayoutFlags' fields, in order


def _act_fn_names() -> dict[Any, str]:
    """transformers activations whose ``act(gate) * up`` the engine computes: classes (matched by exact type)
    and plain functions (LFM2-MoE's ``act_fn = F.silu``, matched by identity)."""
    import torch.nn.functional as F
    from transformers.activations import GELUActivation, GELUTanh, SiLUActivation

    return {
        SiLUActivation: "silu",
        nn.SiLU: "silu",
        GELUActivation: "gelu",
        GELUTanh: "gelu_pytorch_tanh",
        nn.ReLU: "relu",
        F.silu: "silu",
        F.gelu: "gelu",
        F.relu: "relu",
    }


def _tied_gate_names() -> dict[Any, str]:
    """Activations of non-gated experts ``down(act(up x))`` that are a gated one on tied rows,
    ``act(u) = g_act(u) * u``, by the engine name of ``g_act``: relu2 (NemotronH), ``relu(u)^2 = relu(u) * u``."""
    from transformers.activations import ReLUSquaredActivation

    return {ReLUSquaredActivation: "relu"}


def act_fn_name(act: Any) -> str | None:
    """The engine activation of a transformers ``act_fn`` (a module or a plain function), None if it has none."""
    names = _act_fn_names()
    key = act if not isinstance(act, nn.Module) else type(act)
    return names.get(key) if _hashable(key) else None


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


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
    # Z zero-computation experts after the E routed ones (ids E..E+Z-1 return the token: LongCat-Flash); the
    # module's gate_up_proj holds Z unused rows for them, which checkpoints may carry too
    identity_experts: int = 0
    # False: non-gated experts down(act(up x)) with up_proj [E, I, H] (NemotronH's relu2); the engine holds them
    # as gated ones whose gate rows equal their up rows, act(u) = g_act(u) * u (``activation`` names g_act)
    gated: bool = True
    # experts kept as flat [E*I, H] matrices per projection (DBRX's mlp.w1/v1/w2, down transposed); None: fused
    flat: FlatTensors | None = None
    # the module's own ``is_transposed`` attribute (transformers v5's flag), which stock PEFT reads to orient LoRA
    # on 3-D parameters ([E, in, out] when set, else [E, out, in]); Llama4TextExperts is transposed without it
    declares_transposed: bool = False

    @property
    def peft_swapped(self) -> bool:
        """Whether stock PEFT takes this module's 3-D parameters with in and out the other way round from how the
        module computes (its ``lora_A`` then sits on the output side: Llama 4)."""
        return self.transposed != self.declares_transposed

    @property
    def tensor_names(self) -> tuple[str, ...]:
        """The experts module's tensors, as named in the module and in fused checkpoints (flat: attribute paths)."""
        if self.flat is not None:
            return self.flat.names
        if not self.gated:
            return (UP, DOWN)
        return (GATE_UP, DOWN, GATE_UP_BIAS, DOWN_BIAS) if self.has_bias else (GATE_UP, DOWN)

    def runtime_shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor ``name`` in the transformers module."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        if self.flat is not None:
            return (e * i, h)
        return {
            GATE_UP: (e, h, 2 * i) if self.transposed else (e, 2 * i, h),
            UP: (e, h, i) if self.transposed else (e, i, h),
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
    # submodules of the experts module kept on the device (``ArchSpec.kept_modules``: Muse Spark's norm)
    kept: tuple[str, ...] = ()


def _tensor(module: nn.Module, name: str) -> torch.Tensor | None:
    t = getattr(module, name, None)
    return t if isinstance(t, torch.Tensor) else None


def _attr(module: Any, dotted: str) -> Any:
    """``module.a.b`` for ``"a.b"``, None where any step is missing."""
    for part in dotted.split("."):
        module = getattr(module, part, None)
    return module


def _looks_like_experts(module: nn.Module, spec: ArchSpec) -> bool:
    """The spec's flat 2-D tensors (DBRX); else 3-D gate_up_proj and down_proj, or the layout flags
    ``use_experts_implementation`` sets (which also marks experts without a gate projection)."""
    if spec.flat is not None:
        return all(isinstance(t := _attr(module, n), torch.Tensor) and t.dim() == 2 for n in spec.flat.names)
    gate_up, down = _tensor(module, GATE_UP), _tensor(module, DOWN)
    fused = gate_up is not None and down is not None and gate_up.dim() == 3 and down.dim() == 3
    return fused or all(hasattr(module, f) for f in LAYOUT_FLAGS)


PROBE_ROWS = 64  # rows of the random gate_up probe an own-gate activation is checked on
PROBE_SCALE = 15.0  # |gate_up| up to ~50: past every clamp (7, 10) and softcap (4, 25) the families use


def _check_own_gate(
    module: nn.Module, name: str, kwargs: dict[str, float], interleaved: bool, spec: ArchSpec, path: str
) -> None:
    """``ArchError`` unless the engine activation ``name`` computes what the module's own ``_apply_gate`` does,
    on a random probe (fp32): the spec's description is checked against transformers' code itself. The module
    sees the probe in its own gate/up order (``interleaved``: gpt-oss), the engine gate block first."""
    i = 8
    probe = torch.randn(PROBE_ROWS, 2 * i, generator=torch.Generator().manual_seed(0)) * PROBE_SCALE
    apply_gate: Any = type(module)._apply_gate  # type: ignore[attr-defined]
    try:  # the module is on the meta device: an _apply_gate that needs its weights cannot run here
        want = apply_gate(module, probe).float()
    except (RuntimeError, TypeError, NotImplementedError) as e:
        raise ArchError(
            f"{path} ({type(module).__name__}): its _apply_gate could not be checked against the {spec.name!r} "
            f"spec's activation {name!r} ({type(e).__name__}: {e}); moetune refuses what it cannot verify"
        ) from e
    blocks = torch.cat((probe[:, 0::2], probe[:, 1::2]), dim=1) if interleaved else probe
    got = ACTIVATIONS.get(name)(**kwargs)(blocks)
    err = (want - got).abs().max().item()
    if not err <= 1e-5 * max(1.0, want.abs().max().item()):  # fp32: only rounding may differ
        raise ArchError(
            f"{path} ({type(module).__name__}): the {spec.name!r} spec says its _apply_gate is the engine "
            f"activation {name!r} {kwargs}, but on a random probe they differ by {err:.3g}; transformers' "
            "implementation has changed, so moetune refuses rather than train a different model"
        )


def _activation(
    module: nn.Module, spec: ArchSpec, path: str, interleaved: bool
) -> tuple[str, dict[str, float]]:
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
        if name in ACTIVATIONS:
            _check_own_gate(module, name, kwargs, interleaved, spec, path)
    else:
        act = getattr(module, "act_fn", None)
        found = act_fn_name(act)
        if found is None:
            raise ArchError(
                f"{path}: expert activation {getattr(act, '__name__', type(act).__name__)} is not one the engine "
                "computes; supported act_fn classes and functions: "
                f"{', '.join(sorted(getattr(c, '__name__', str(c)) for c in _act_fn_names()))}"
            )
        name, kwargs = found, {}
    if name not in ACTIVATIONS:
        raise ArchError(
            f"{path}: activation {name!r} is not registered in the engine ({ACTIVATIONS.names()})"
        )
    return name, kwargs


def _flags(module: nn.Module, spec: ArchSpec, path: str) -> LayoutFlags:
    """The module's layout flags, or the family's where its class lacks the decorator."""
    if all(hasattr(module, f) for f in LAYOUT_FLAGS):
        return LayoutFlags(*(bool(getattr(module, f)) for f in LAYOUT_FLAGS))
    if spec.layout is not None:
        return spec.layout
    missing = [f for f in LAYOUT_FLAGS if not hasattr(module, f)]
    raise ArchError(
        f"{path} ({type(module).__name__}) has 3-D gate_up_proj/down_proj but not the layout flags "
        f"{missing} that transformers' use_experts_implementation sets, and the {spec.name!r} spec gives none, "
        f"so its call signature and layout are unknown. Supported:\n{supported_summary()}"
    )


def _tied_activation(module: nn.Module, path: str) -> str:
    """The engine activation of non-gated experts, computed as a gated one on tied gate and up rows."""
    act = getattr(module, "act_fn", None)
    found = _tied_gate_names().get(type(act)) if isinstance(act, nn.Module) else None
    if found is None:
        known = ", ".join(sorted(c.__name__ for c in _tied_gate_names()))
        raise ArchError(
            f"{path} ({type(module).__name__}) holds non-gated experts down(act(up x)) with act_fn "
            f"{getattr(act, '__name__', type(act).__name__)}; the engine runs non-gated experts as gated ones "
            f"with gate rows = up rows, which needs act(u) = f(u) * u: supported act_fn classes {known}"
        )
    return found


def _check_post_norm(module: nn.Module, spec: ArchSpec, path: str) -> None:
    """``ArchError`` unless the spec describes the module's per-expert output norm (``has_post_expert_norm``)."""
    kind = type(module).__name__
    if spec.call is not ExpertsCall.TOPK_POST_NORM:
        raise ArchError(
            f"{path} ({kind}) normalises each expert's output before weighting it (post_expert_norm inside "
            f"the sum over the top-k experts), which the {spec.name!r} spec does not describe (it takes the call "
            f"{spec.call.name}, not TOPK_POST_NORM). Supported:\n" + supported_summary()
        )
    missing = [n for n in spec.kept_modules if not isinstance(getattr(module, n, None), nn.Module)]
    if missing:
        raise ArchError(
            f"{path} ({kind}): the {spec.name!r} spec keeps its submodule(s) {missing} on the device, but the "
            "module has none of that name (did transformers rename them?)"
        )


def _flat_layout(module: nn.Module, spec: ArchSpec, flat: FlatTensors, path: str) -> ExpertsLayout:
    """The layout of an experts module keeping flat ``[E*I, H]`` matrices (``ArchSpec.flat``: DBRX)."""
    kind = type(module).__name__
    e = getattr(module, flat.num_experts, None)
    gate = _attr(module, flat.gate)
    if not isinstance(e, int) or e <= 0 or not isinstance(gate, torch.Tensor) or gate.shape[0] % e:
        raise ArchError(
            f"{path} ({kind}): the {spec.name!r} spec reads E from .{flat.num_experts} ({e!r}) and flat [E*I, H] "
            f"experts from .{flat.gate} ({None if gate is None else tuple(gate.shape)}), which do not fit"
        )
    act = _attr(module, flat.activation)
    name = act_fn_name(act)
    if name is None:
        raise ArchError(
            f"{path} ({kind}): expert activation {type(act).__name__} (.{flat.activation}) is not one the engine "
            "computes"
        )
    rows, h = gate.shape
    layout = ExpertsLayout(e, h, rows // e, False, False, False, name, flat=flat)
    for tensor in flat.names:
        t = _attr(module, tensor)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != (rows, h):
            raise ArchError(
                f"{path} ({kind}): .{tensor} is {None if t is None else tuple(t.shape)}, expected {(rows, h)} "
                f"like .{flat.gate}"
            )
    return layout


def read_layout(module: nn.Module, spec: ArchSpec, path: str) -> ExpertsLayout:
    """The layout of one v5 experts module; ``ArchError`` naming ``path`` if the engine cannot run it."""
    if spec.flat is not None:
        return _flat_layout(module, spec, spec.flat, path)
    flags = _flags(module, spec, path)
    kind = type(module).__name__
    if getattr(module, "has_post_expert_norm", False) or spec.call is ExpertsCall.TOPK_POST_NORM:
        _check_post_norm(module, spec, path)
    first = GATE_UP if flags.has_gate else UP
    gate_up, down = _tensor(module, first), _tensor(module, DOWN)
    if gate_up is None or gate_up.dim() != 3 or down is None:
        raise ArchError(
            f"{path} ({kind}, has_gate={flags.has_gate}) has no 3-D {first} and {DOWN} tensors "
            f"(found {first}: {None if gate_up is None else tuple(gate_up.shape)}, {DOWN}: "
            f"{None if down is None else tuple(down.shape)}). Supported:\n{supported_summary()}"
        )
    transposed = flags.is_transposed
    rows, out, h = (
        (gate_up.shape[0], gate_up.shape[2], gate_up.shape[1]) if transposed else tuple(gate_up.shape)
    )
    identity = int(getattr(module, spec.identity_attr) or 0) if spec.identity_attr is not None else 0
    e = rows - identity
    if flags.has_gate:
        if out % 2:
            raise ArchError(f"{path}: gate_up_proj {tuple(gate_up.shape)} has an odd 2I dimension ({out})")
        i = out // 2
        act, kwargs = _activation(module, spec, path, not flags.is_concatenated)
    else:
        if flags.has_bias:
            raise ArchError(
                f"{path} ({kind}): non-gated experts with biases (has_bias=True); moetune runs non-gated experts "
                "without biases only (NemotronH's)"
            )
        i, act, kwargs = out, _tied_activation(module, path), {}
    layout = ExpertsLayout(
        num_experts=e,
        hidden_size=h,
        intermediate_size=i,
        transposed=transposed,
        interleaved=not flags.is_concatenated,
        has_bias=flags.has_bias,
        activation=act,
        activation_kwargs=tuple(sorted(kwargs.items())),
        identity_experts=identity,
        gated=flags.has_gate,
        declares_transposed=bool(getattr(module, "is_transposed", False)),
    )
    for name in layout.tensor_names:
        t = _tensor(module, name)
        want = layout.runtime_shape(name)
        want = (want[0] + identity, *want[1:]) if name == GATE_UP else want  # the identity experts' rows
        if t is None or tuple(t.shape) != want:
            raise ArchError(
                f"{path} ({kind}, is_transposed={transposed}, has_bias={layout.has_bias}): "
                f"{name} is {None if t is None else tuple(t.shape)}, expected {want} "
                f"from {first} {tuple(gate_up.shape)}"
                + (f" and {identity} zero-computation experts" if identity else "")
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
    """Every routed-experts module of ``model``, in module order.

    ``ArchError`` naming ``model_type`` when the family is known not to run on the engine (``spec.unsupported``),
    when an experts module cannot, or when there is none.
    """
    where = f"model_type {model_type!r} ({type(model).__name__})"
    if spec.unsupported is not None:
        raise ArchError(f"{where} is not supported: {spec.unsupported}. Supported:\n{supported_summary()}")
    try:
        sites = [
            ExpertsSite(path, read_layout(module, spec, path), _router(model, path, spec), spec.kept_modules)
            for path, module in model.named_modules()
            if _looks_like_experts(module, spec)
        ]
    except ArchError as e:
        raise ArchError(f"{where}: {e}") from e
    if not sites:
        raise ArchError(
            f"{where} is not a supported MoE architecture: none "
            "of its modules is a routed-experts module (searched every module for 3-D gate_up_proj and "
            f"down_proj tensors). Supported:\n{supported_summary()}"
        )
    return sites
