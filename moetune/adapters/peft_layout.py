"""Expert LoRA between the engine's layout and stock PEFT's ``target_parameters`` (``lora.ParamWrapper``) layout.

moetune's PEFT layer for routed experts (``moetune.adapters.expert_layer.ExpertsLora``) holds its tensors in
PEFT's layout below; the engine reads them through :func:`engine_view` (views, no copies).

Facts about PEFT 0.21 (checked against ``peft/tuners/lora/layer.py`` and by building PEFT models over
transformers 5.24 ``Qwen3MoeExperts`` and ``GptOssExperts``; ``tests/unit/adapters/test_peft_layout.py`` re-checks them):

Feature roles.
    For a 3-D parameter ``[E, d1, d2]``, ``ParamWrapper._get_in_out_features`` reads ``in, out = d1, d2`` and
    ``update_layer`` swaps them unless the experts module has ``is_transposed = True``:

    - not transposed (``Qwen3MoeExperts``, Mixtral, DeepSeek, ...): the param is ``[E, out, in]``;
      gate_up_proj ``[E, 2I, H]`` has in = H, out = 2I; down_proj ``[E, H, I]`` has in = I, out = H.
    - transposed (``GptOssExperts``): the param is ``[E, in, out]``; gate_up_proj ``[E, H, 2I]``, down_proj
      ``[E, I, H]``; in and out are the same as above.

    Either way ``in`` is the dimension contracted with the activations, and the LoRA tensors below have the
    same layout; only the base parameter and ``get_delta_weight`` (``[E, out, in]`` or ``[E, in, out]``) differ.

    - transposed without the flag (``Llama4TextExperts``: ``x @ W`` with gate_up_proj ``[E, H, 2I]``, no
      ``is_transposed``): PEFT takes the param as ``[E, out, in]``, so its roles are swapped: gate_up has
      PEFT-in = 2I, PEFT-out = H (down: PEFT-in = H, PEFT-out = I), and its delta ``B A`` is ``[E, H, 2I]``, the
      param's own shape. In the engine's terms (``W_e`` ``[out, in]`` = ``[2I, H]``) that delta is transposed:
      the engine's ``A_e`` is PEFT's ``B_e`` transposed and the engine's ``B_e`` PEFT's ``A_e`` transposed
      (``swapped=True`` below; ``ExpertsLayout.peft_swapped``). moetune holds such LoRA in PEFT's swapped
      layout, drawn as PEFT draws it, so stock PEFT loads moetune's adapters there too.

Tensor layout, one projection.
    ``lora_A = nn.Linear(in, r * E)``: ``lora_A.weight`` ``[E * r, in]`` is expert-major,
    ``A_e = lora_A.weight[e * r:(e + 1) * r]`` (``weight.reshape(E, r, in)``).
    ``lora_B = nn.Linear(r * E, out)``: ``lora_B.weight`` ``[out, r * E]`` is rank-major,
    ``B_e[o, j] = lora_B.weight[o, j * E + e]`` (``weight.reshape(out, r, E).permute(2, 0, 1)``).
    The asymmetry is PEFT's; the engine stores ``A`` ``[E, r, in]`` and ``B`` ``[E, out, r]``.
    Expert ``e`` computes with ``W_e + s * B_e @ A_e`` (``[out, in]``), ``s = lora_alpha / r`` or
    ``lora_alpha / sqrt(r)`` with ``use_rslora``. Rows of ``out`` follow the base parameter's own order
    (Qwen: ``[gate; up]`` halves; gpt-oss, ``is_concatenated = False``: gate at even, up at odd indices of
    2I). The engine always keeps gate rows first (the loader de-interleaves gpt-oss's weights), so for an
    interleaved module gate_up's ``B`` rows are interleaved on the way to PEFT and de-interleaved on the way
    back (``ExpertParamNames.interleaved``). Nothing else moves: gate_up's ``A`` (in = H) and down's ``A``
    (in = I, the same intermediate index j = act(gate_j, up_j) either way) and ``B`` (out = H) keep their order.

Key names.
    One ``ParamWrapper`` per targeted parameter; several on one module nest, and the nesting follows the
    order in which the module *registers* its parameters (``named_parameters(recurse=False)``), not the
    order of ``target_parameters``: the last registered is outermost. The i-th of n targeted parameters
    (0-based, registration order) has its tensors under ``<module path> + ".base_layer" * (n - 1 - i)``.
    For ``Qwen3MoeExperts`` and ``GptOssExperts`` (gate_up_proj registered before down_proj), both targeted,
    an experts module at path ``P`` of the original model is saved (``get_peft_model_state_dict``,
    ``save_pretrained``; adapter name removed) as::

        base_model.model.P.base_layer.lora_A.weight   gate_up A  [E * r, H]
        base_model.model.P.base_layer.lora_B.weight   gate_up B  [2I, r * E]
        base_model.model.P.lora_A.weight              down A     [E * r, I]
        base_model.model.P.lora_B.weight              down B     [H, r * E]

    e.g. ``P = model.layers.0.mlp.experts`` in a ``Qwen3MoeForCausalLM``. With one parameter targeted its
    tensors are ``P.lora_A.weight`` / ``P.lora_B.weight``. In a live ``PeftModel.state_dict()`` the adapter
    name is inserted (``P.base_layer.lora_A.default.weight``); loading puts it back.

Dtypes.
    PEFT creates the adapter in the parameter's dtype, then (``autocast_adapter_dtype=True``, the default)
    upcasts fp16/bf16 adapters to fp32; fp32 and fp64 are kept.

adapter_config.json.
    ``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``use_rslora``, ``target_parameters`` (each entry matches a
    ``<module path>.<param>`` exactly or as a dotted suffix, e.g. ``"mlp.experts.gate_up_proj"``);
    ``target_modules`` may be null when ``target_parameters`` is set. ``ParamWrapper`` raises unless
    ``lora_dropout == 0``, ``fan_in_fan_out``, ``lora_bias`` and ``use_dora`` are false; ``lora_dropout`` is one
    field for the whole config, so a saved config with expert ``target_parameters`` must say 0 even if
    attention LoRA trained with dropout (dropout does not change the saved weights). All adapters on a model
    that use ``target_parameters`` must target the same parameters, and PEFT cannot inject
    ``target_parameters`` adapters from a state dict alone (``inject_adapter_in_model(state_dict=...)``):
    loading goes through the config.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from moetune.engine import ExpertLoRA
from moetune.errors import AdapterError, EngineError
from moetune.layer import CpuExperts
from moetune.layer.cpu_experts import PEFT_WRAPPED_PREFIX

PEFT_MODEL_PREFIX = PEFT_WRAPPED_PREFIX
"""What PEFT's saved keys put before a module path of the original model."""


def unwrapped_path(path: str) -> str:
    """The path of the module PEFT's nested wrappers stand around: ``...mlp.experts.base_layer.base_layer`` (a module
    path or a LoRA key prefix inside them) -> ``...mlp.experts``."""
    while path.endswith(".base_layer"):
        path = path.removesuffix(".base_layer")
    return path


def lora_to_peft(
    a: torch.Tensor, b: torch.Tensor, *, swapped: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's LoRA, engine -> PEFT. Exact: only reshapes and permutes.

    a ``[E, r, in]``, b ``[E, out, r]`` -> (``lora_A.weight`` ``[E * r, in]``, ``lora_B.weight`` ``[out, r * E]``),
    same dtype, detached, contiguous; they may share memory with ``a`` / ``b``. ``swapped`` (PEFT's roles the
    other way round, module docstring): (``lora_A.weight`` ``[E * r, out]``, ``lora_B.weight`` ``[in, r * E]``).
    """
    if swapped:
        a, b = b.transpose(1, 2), a.transpose(1, 2)
    e, r, n_in = a.shape
    n_out = b.shape[1]
    assert tuple(b.shape) == (e, n_out, r), f"B {tuple(b.shape)} does not match A {tuple(a.shape)}"
    lora_a = a.detach().reshape(e * r, n_in).contiguous()
    lora_b = b.detach().permute(1, 2, 0).reshape(n_out, r * e).contiguous()  # [out, r, E]: column j * E + e
    return lora_a, lora_b


def engine_view(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int, *, swapped: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's ``lora_A.weight`` ``[E * r, in]`` and ``lora_B.weight`` ``[out, r * E]`` seen in the engine layout:
    (a ``[E, r, in]``, b ``[E, out, r]``), views of the same memory (strided), differentiable. ``swapped``: PEFT's
    in and out are the engine's out and in, and the engine's a is PEFT's B (b PEFT's A) transposed."""
    rows, n_in = lora_a.shape
    n_out = lora_b.shape[0]
    r = rows // num_experts
    a, b = lora_a.view(num_experts, r, n_in), lora_b.view(n_out, r, num_experts).permute(2, 0, 1)
    return (b.transpose(1, 2), a.transpose(1, 2)) if swapped else (a, b)


def lora_from_peft(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    num_experts: int,
    *,
    label: str = "expert LoRA",
    swapped: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's LoRA, PEFT -> engine, checked. Exact: only reshapes and permutes.

    ``lora_A.weight`` ``[E * r, in]``, ``lora_B.weight`` ``[out, r * E]`` -> (a ``[E, r, in]``, b ``[E, out, r]``),
    same dtype, detached, contiguous (:func:`engine_view`, copied; ``swapped`` as there). ``label`` names the
    tensors in error messages (e.g. the key prefix).
    """
    if lora_a.ndim != 2 or lora_b.ndim != 2:
        raise AdapterError(
            f"{label}: lora_A.weight and lora_B.weight must be 2-D; got {tuple(lora_a.shape)} and "
            f"{tuple(lora_b.shape)}"
        )
    rows, cols = lora_a.shape[0], lora_b.shape[1]
    if num_experts <= 0 or rows % num_experts != 0 or cols != rows:
        raise AdapterError(
            f"{label}: for E={num_experts} experts lora_A.weight must be [E * r, in] and lora_B.weight "
            f"[out, r * E] with the same r; got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}. "
            "Check that the adapter was saved for this model (number of experts)."
        )
    a, b = engine_view(lora_a.detach(), lora_b.detach(), num_experts, swapped=swapped)
    return a.contiguous(), b.contiguous()


def interleave_rows(b: torch.Tensor) -> torch.Tensor:
    """gate_up ``B`` ``[E, 2I, r]`` with gate rows then up rows -> gate at even, up at odd rows (gpt-oss)."""
    e, two_i, r = b.shape
    return torch.stack((b[:, : two_i // 2], b[:, two_i // 2 :]), dim=2).reshape(e, two_i, r)


def deinterleaved_order(two_i: int) -> torch.Tensor:
    """``[2I]`` int64: for each gate_up row in gate-rows-then-up-rows order, its row in the interleaved order
    (gate j at 2j, up j at 2j + 1). ``ExpertLoRA.gate_up_rows`` for an interleaved module."""
    return torch.cat((torch.arange(0, two_i, 2), torch.arange(1, two_i, 2)))


def deinterleave_rows(b: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`interleave_rows`: ``[E, 2I, r]`` interleaved -> gate rows then up rows."""
    return b.index_select(1, deinterleaved_order(b.shape[1]))


@dataclass(frozen=True)
class ExpertParamNames:
    """How the transformers experts module PEFT targets lays out its fused parameters.

    Its gate-up and down parameter names, which one it registers first (registration order decides PEFT's
    ``ParamWrapper`` nesting and so the key names, see the module docstring), and whether gate_up's 2I
    outputs interleave gate and up (gpt-oss) instead of gate block then up block.
    """

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    gate_up_first: bool = True
    interleaved: bool = False
    # non-gated experts (NemotronH): the first projection is up_proj [E, I, H], which the engine uses for both
    # its gate and its up rows (``ExpertsLayout.gated``); its lora_B has I rows
    tied: bool = False
    # PEFT's in and out the other way round from the module's (transposed without the flag: Llama 4)
    swapped: bool = False

    @classmethod
    def from_module(
        cls,
        experts: nn.Module,
        gate_up: str = "gate_up_proj",
        down: str = "down_proj",
        *,
        transposed: bool,
    ) -> ExpertParamNames:
        """Read the registration order off a transformers experts module (before PEFT wraps it). ``transposed``:
        whether the module computes ``x @ W`` (``ExpertsLayout.transposed``; the module's own ``is_transposed``
        flag cannot say: Llama 4's is transposed without it), which decides ``swapped``."""
        order = [name for name, _ in experts.named_parameters(recurse=False)]
        missing = [n for n in (gate_up, down) if n not in order]
        if missing:
            raise AdapterError(
                f"{type(experts).__name__} has no parameter(s) {missing}; its parameters are {order}. "
                "Pass the names of its fused gate-up and down expert parameters."
            )
        interleaved = not getattr(experts, "is_concatenated", True)  # transformers v5's layout flags
        swapped = transposed != bool(getattr(experts, "is_transposed", False))
        return cls(gate_up, down, order.index(gate_up) < order.index(down), interleaved, swapped=swapped)

    @classmethod
    def of(cls, experts: CpuExperts) -> ExpertParamNames:
        """For a moetune ``CpuExperts``: the transformers module it replaced, as recorded at load
        (``experts.layout``; None: the engine's own gate-rows-first layout). transformers v5 experts modules all
        name their parameters ``gate_up_proj`` / ``down_proj`` and register gate_up first; non-gated ones
        ``up_proj`` / ``down_proj``, up first."""
        layout = experts.layout
        if layout is None:
            return cls()
        if not layout.gated:
            return cls(gate_up="up_proj", tied=True, swapped=layout.peft_swapped)
        return cls(interleaved=layout.interleaved, swapped=layout.peft_swapped)

    def engine_rows(self, out_rows: int) -> torch.Tensor | None:
        """``ExpertLoRA.gate_up_rows`` for a gate_up ``lora_B`` of ``out_rows`` rows in this module's order: the
        de-interleaving order (gpt-oss), the tie ``[0, I)`` twice (non-gated experts), or None (same order)."""
        if self.tied:
            return torch.arange(out_rows).repeat(2)
        return deinterleaved_order(out_rows) if self.interleaved else None

    def key_prefixes(self, module_prefix: str) -> dict[str, str]:
        """``{"gate_up": ..., "down": ...}``: where each projection's ``lora_A.weight`` / ``lora_B.weight`` live.

        ``module_prefix`` is the experts module's full key prefix, e.g.
        ``"base_model.model.model.layers.0.mlp.experts"``; the inner wrapper's prefix adds ``".base_layer"``.
        """
        inner = f"{module_prefix}.base_layer"
        if self.gate_up_first:
            return {"gate_up": inner, "down": module_prefix}
        return {"gate_up": module_prefix, "down": inner}

    def target_parameters(self, module_path: str) -> list[str]:
        """The ``target_parameters`` entries for an experts module at ``module_path`` (a path or a suffix)."""
        return [f"{module_path}.{self.gate_up}", f"{module_path}.{self.down}"]


def _lora_of(source: ExpertLoRA | CpuExperts) -> ExpertLoRA:
    if isinstance(source, ExpertLoRA):
        return source
    lora = source.engine.lora
    if lora is None:
        raise AdapterError(f"CpuExperts {source.engine.name!r} has no expert LoRA to save")
    return lora


def expert_lora_to_peft_state(
    source: ExpertLoRA | CpuExperts, module_prefix: str, names: ExpertParamNames | None = None
) -> dict[str, torch.Tensor]:
    """One layer's expert LoRA as PEFT state-dict entries (the four keys in the module docstring).

    Tensors keep their dtype (fp32 master weights stay fp32); gate_up ``lora_A`` ``[E * r, H]``, ``lora_B``
    ``[2I, r * E]`` (rows interleaved when ``names.interleaved``); down ``lora_A`` ``[E * r, I]``, ``lora_B``
    ``[H, r * E]``; with ``names.swapped`` gate_up ``[E * r, 2I]`` / ``[H, r * E]``, down ``[E * r, H]`` /
    ``[I, r * E]``.
    """
    lora = _lora_of(source)
    names = names or ExpertParamNames()
    prefixes = names.key_prefixes(module_prefix)
    gate_up_b = interleave_rows(lora.gate_up_B.detach()) if names.interleaved else lora.gate_up_B
    state: dict[str, torch.Tensor] = {}
    for proj, (a, b) in (("gate_up", (lora.gate_up_A, gate_up_b)), ("down", (lora.down_A, lora.down_B))):
        state[f"{prefixes[proj]}.lora_A.weight"], state[f"{prefixes[proj]}.lora_B.weight"] = lora_to_peft(
            a, b, swapped=names.swapped
        )
    return state


def expert_lora_from_peft_state(
    state: Mapping[str, torch.Tensor],
    module_prefix: str,
    *,
    num_experts: int,
    scaling: float,
    names: ExpertParamNames | None = None,
    dropout: float = 0.0,
) -> ExpertLoRA:
    """One layer's expert LoRA from PEFT state-dict entries under ``module_prefix``, in the engine layout.

    ``scaling`` comes from the adapter config (``moetune.engine.lora_scaling(r, lora_alpha, use_rslora)``);
    tensors keep the stored dtype (cast to the fp32 master dtype at the caller); gate_up's ``B`` rows are
    de-interleaved when ``names.interleaved``.
    """
    names = names or ExpertParamNames()
    prefixes = names.key_prefixes(module_prefix)
    wanted = [f"{prefixes[p]}.lora_{m}.weight" for p in ("gate_up", "down") for m in "AB"]
    missing = [k for k in wanted if k not in state]
    if missing:
        near = sorted(k for k in state if k.startswith(module_prefix))
        raise AdapterError(
            f"PEFT state is missing expert LoRA key(s) {missing}; keys under {module_prefix!r}: {near or 'none'}. "
            "Expected both gate_up_proj and down_proj to be in target_parameters."
        )
    tensors: dict[str, torch.Tensor] = {}
    for proj in ("gate_up", "down"):
        p = prefixes[proj]
        a, b = lora_from_peft(
            state[f"{p}.lora_A.weight"],
            state[f"{p}.lora_B.weight"],
            num_experts,
            label=p,
            swapped=names.swapped,
        )
        if proj == "gate_up" and names.interleaved:
            b = deinterleave_rows(b)
        tensors[f"{proj}_A"], tensors[f"{proj}_B"] = a, b
    try:
        return ExpertLoRA(**tensors, scaling=scaling, dropout=dropout)
    except EngineError as exc:  # gate_up and down disagree on E, r, H or I
        raise AdapterError(f"expert LoRA under {module_prefix!r} is inconsistent: {exc}") from exc
