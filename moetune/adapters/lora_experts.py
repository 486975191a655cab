"""LoRA experts: N small dense SwiGLU experts on the device, added to every MoE block's output.

The definition is KTransformers' (its ``kt_use_lora_experts`` and LLaMA-Factory's ``use_lora_expert``): for each
MoE block ``b`` and every token ``x: [H]`` entering it,

    y_b(x) = moe_b(x) + (1/N) * sum_n D_n (silu(G_n x) * (U_n x)),    G_n, U_n: [I', H],  D_n: [H, I']

The LoRA experts are not routed: every token goes through all N of them (the block's router neither sees nor
weighs them), which makes them a trainable dense MLP of width N * I' beside the frozen routed experts, computed on
the device while the routed experts run on the host. ``D_n`` starts at zero, so at step 0 the model computes the
base model's output exactly; ``G_n`` and ``U_n`` start as ``nn.Linear`` starts (kaiming-uniform, a = sqrt(5)),
drawn from the global torch RNG. Weights are fp32 (trainable weights are fp32 in moetune's bf16 runs too); the
input is cast to fp32 and the sum back to the block's dtype.

Placement, on the model instance (no transformers class is changed): a :class:`LoraExperts` module is registered
as the child ``extra_experts`` of each MoE block (the parent of the routed-experts module) and a forward hook on
the block adds its output to the block's output. The model's existing parameter names are unchanged, so the
ordinary (stock PEFT) adapter keeps its keys; the child's name avoids ``lora_``, which PEFT's
``get_peft_model_state_dict`` selects by substring, so the LoRA experts never enter ``adapter_model.safetensors``.

The LoRA experts are part of the adapter, so they follow PEFT's on/off switch: PEFT turns its adapters off and on
(``PeftModel.disable_adapter()``, which TRL's dpo/kto reference pass uses; ``disable_adapter_layers()``) by calling
``enable_adapters`` on every one of its tuner layers, which all hold the same state. Each :class:`LoraExperts` keeps
one of the model's tuner layers (:class:`AdapterSwitch`, found when they are attached) and the block's hook adds
nothing while that layer's adapters are disabled: the block then returns the base model's output exactly, as
PEFT's LoRA layers return their base layer's. No PEFT or TRL class is changed.

Saved beside the adapter as ``moetune_lora_experts.safetensors`` (:data:`FILE_NAME`; stock PEFT does not know LoRA
experts and ignores the file): fp32 tensors ``<block path>.extra_experts.{gate_proj,up_proj,down_proj}`` of
shapes ``[N, I', H]``, ``[N, I', H]``, ``[N, H, I']`` (block paths as in the transformers model, e.g.
``model.layers.1.mlp``) and header metadata :data:`FORMAT` plus ``num_experts``, ``intermediate_size``,
``hidden_size``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from moetune.adapters.peft_layout import unwrapped_path
from moetune.adapters.swap import LORA_EXPERTS_NAME
from moetune.errors import AdapterError, LoadError, listing
from moetune.layer import CpuExperts

if TYPE_CHECKING:
    from peft.tuners.tuners_utils import BaseTunerLayer

logger = logging.getLogger(__name__)

FILE_NAME = LORA_EXPERTS_NAME
CHILD = "extra_experts"  # the child of each MoE block; not "lora_*" (PEFT's state-dict filter is a substring)
FORMAT = "moetune_lora_experts/1"
PARAMS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraExpertsSpec:
    """N experts of intermediate size I' over hidden size H (the same for every MoE block)."""

    num_experts: int
    intermediate_size: int
    hidden_size: int

    def shapes(self) -> dict[str, tuple[int, int, int]]:
        """``{param: shape}`` of one block's tensors."""
        n, i, h = self.num_experts, self.intermediate_size, self.hidden_size
        return {"gate_proj": (n, i, h), "up_proj": (n, i, h), "down_proj": (n, h, i)}

    def metadata(self) -> dict[str, str]:
        """The safetensors header metadata of the saved file."""
        return {
            "format": FORMAT,
            "num_experts": str(self.num_experts),
            "intermediate_size": str(self.intermediate_size),
            "hidden_size": str(self.hidden_size),
        }


class AdapterSwitch:
    """Whether the model's PEFT adapters are enabled, read from one of its tuner layers (PEFT switches all of them
    together); a plain object, so the layer is not registered as a submodule of the LoRA experts."""

    def __init__(self, layer: BaseTunerLayer) -> None:
        self.layer = layer

    @property
    def enabled(self) -> bool:
        return not self.layer.disable_adapters


class LoraExperts(nn.Module):
    """One MoE block's LoRA experts (module docstring): ``forward(x: [..., H]) -> [..., H]`` in ``x``'s dtype.

    ``switch`` is PEFT's adapter on/off state they follow (module docstring)."""

    def __init__(
        self, spec: LoraExpertsSpec, switch: AdapterSwitch, device: torch.device | str | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.switch = switch
        shapes = spec.shapes()

        def empty(name: str) -> nn.Parameter:
            return nn.Parameter(torch.empty(shapes[name], dtype=torch.float32, device=device))

        self.gate_proj, self.up_proj, self.down_proj = (empty(name) for name in PARAMS)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """G_n, U_n as ``nn.Linear(H, I')`` initialises its weight; D_n zero (the block's output is unchanged)."""
        with torch.no_grad():
            for weight in (self.gate_proj, self.up_proj):
                for n in range(self.spec.num_experts):
                    nn.init.kaiming_uniform_(weight[n], a=math.sqrt(5))
            self.down_proj.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, i, h = self.spec.num_experts, self.spec.intermediate_size, self.spec.hidden_size
        xf = x.to(torch.float32)
        # all N experts as one [N*I', H] GEMM pair: the mean over experts is one [H, N*I'] product scaled by 1/N
        gate = F.linear(xf, self.gate_proj.reshape(n * i, h))
        up = F.linear(xf, self.up_proj.reshape(n * i, h))
        down = self.down_proj.permute(1, 0, 2).reshape(h, n * i)
        return (F.linear(F.silu(gate) * up, down) / n).to(x.dtype)


def _add_lora_experts(block: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
    """Forward hook on an MoE block: its output plus its LoRA experts' output on the block's input; the output
    unchanged while PEFT's adapters are disabled."""
    extra = getattr(block, CHILD)
    if not extra.switch.enabled:
        return output
    x = args[0] if args else kwargs.get("hidden_states")
    first = output[0] if isinstance(output, tuple) else output
    if not isinstance(x, torch.Tensor) or not isinstance(first, torch.Tensor) or first.shape != x.shape:
        raise AdapterError(
            f"LoRA experts on {type(block).__name__}: the block's input {getattr(x, 'shape', x)!r} and output "
            f"{getattr(first, 'shape', first)!r} are not hidden states of one shape; this family's MoE block does "
            "not take LoRA experts (remove lora_experts)"
        )
    added = first + extra(x)
    return (added, *output[1:]) if isinstance(output, tuple) else added


def _base(model: nn.Module) -> Any:
    """The transformers model under a ``PeftModel`` (the model itself otherwise)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def moe_block_paths(model: nn.Module) -> list[str]:
    """Paths (in the transformers model) of the MoE blocks: the parents of the routed-experts modules, read
    through the PEFT layers around an experts module (``...mlp.experts.base_layer.base_layer`` -> ``...mlp``)."""
    paths = []
    for path, module in _base(model).named_modules():
        if isinstance(module, CpuExperts):
            paths.append(unwrapped_path(path).rpartition(".")[0])
    if not paths:
        raise AdapterError(
            f"lora_experts: {type(_base(model)).__name__} has no routed-experts module (CpuExperts) whose MoE block "
            "could take LoRA experts; load the model with moetune.load_model"
        )
    return paths


def lora_experts_of(model: nn.Module) -> dict[str, LoraExperts]:
    """``{MoE block path: its LoraExperts}`` of ``model`` (a PeftModel or a transformers model); empty without."""
    out = {}
    for path, module in _base(model).named_modules():
        child = getattr(module, CHILD, None)
        if isinstance(child, LoraExperts):
            out[path] = child
    return out


def adapter_switch(model: nn.Module) -> AdapterSwitch:
    """The on/off switch of ``model``'s PEFT adapters (one of its tuner layers); ``AdapterError`` when it has
    none (the LoRA experts belong to an adapter)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            return AdapterSwitch(module)
    raise AdapterError(
        f"LoRA experts belong to a PEFT adapter, and {type(model).__name__} has no PEFT LoRA layer; attach them to "
        "the PeftModel (moetune.adapters.attach_lora, or get_peft_model) after its LoRA"
    )


def attach_lora_experts(model: nn.Module, num_experts: int, intermediate_size: int) -> dict[str, LoraExperts]:
    """Add trainable LoRA experts to every MoE block of the ``PeftModel`` over a ``moetune.load_model`` model, on
    the device of its embeddings; returns ``{block path: LoraExperts}``. Attach after PEFT's ``get_peft_model``
    (which freezes every parameter it does not own); they follow its adapters' on/off switch (module docstring).
    ``AdapterError`` when they are there already, the model has no PEFT adapter, or the sizes are not whole
    numbers >= 1."""
    for key, value in (("lora_experts", num_experts), ("lora_expert_intermediate_size", intermediate_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise AdapterError(f"{key} is {value!r}; it must be a whole number >= 1")
    base = _base(model)
    if lora_experts_of(base):
        raise AdapterError(f"{type(base).__name__} already has LoRA experts; attach them once per model")
    switch = adapter_switch(model)
    hidden = base.config.get_text_config().hidden_size
    spec = LoraExpertsSpec(num_experts, intermediate_size, hidden)
    device = base.get_input_embeddings().weight.device
    added = {}
    for path in moe_block_paths(base):
        block = base.get_submodule(path)
        block.add_module(CHILD, LoraExperts(spec, switch, device))
        block.register_forward_hook(_add_lora_experts, with_kwargs=True)
        added[path] = getattr(block, CHILD)
    from moetune.adapters.lora_experts_config import carry_lora_experts

    carry_lora_experts(model, base)  # PEFT's own save_pretrained then writes them too
    count = sum(p.numel() for m in added.values() for p in m.parameters())
    logger.info(
        "moetune: LoRA experts (N=%d, I'=%d) added to %d MoE blocks (%s) on %s: %d trainable parameters",
        num_experts,
        intermediate_size,
        len(added),
        listing(list(added), inline=True),
        device,
        count,
    )
    return added


def spec_of(model: nn.Module) -> LoraExpertsSpec | None:
    """The LoRA experts' sizes of ``model``, None without LoRA experts."""
    found = lora_experts_of(model)
    return next(iter(found.values())).spec if found else None


def lora_experts_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every LoRA-experts tensor under its saved key (module docstring), on the CPU, contiguous."""
    return {
        f"{path}.{CHILD}.{name}": getattr(module, name).detach().cpu().contiguous()
        for path, module in lora_experts_of(model).items()
        for name in PARAMS
    }


def write_lora_experts(model: nn.Module, path: Path) -> None:
    """Write ``model``'s LoRA experts to the safetensors file ``path`` (module docstring; not atomic by itself:
    callers write it inside an atomic commit, ``adapters.swap`` or a staged checkpoint)."""
    from safetensors.torch import save_file

    spec = spec_of(model)
    assert spec is not None, "write_lora_experts is called for a model with LoRA experts"
    save_file(lora_experts_state(model), str(path), metadata=spec.metadata())


def read_spec(path: Path) -> LoraExpertsSpec:
    """The sizes recorded in a saved LoRA-experts file's header (nothing else read); ``AdapterError`` naming
    the file and field when the header is not moetune's."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as f:
            meta = f.metadata() or {}
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{path} cannot be read ({e}); save the adapter again") from None
    if meta.get("format") != FORMAT:
        raise AdapterError(
            f"{path}: header metadata format is {meta.get('format')!r}, expected {FORMAT!r}; it was not written by "
            "moetune's LoRA-experts save. Save the adapter again"
        )
    values = {}
    for key in ("num_experts", "intermediate_size", "hidden_size"):
        raw = meta.get(key, "")
        if not raw.isdigit() or int(raw) < 1:
            raise AdapterError(f"{path}: header metadata {key} is {raw!r}; expected a whole number >= 1")
        values[key] = int(raw)
    return LoraExpertsSpec(**values)


def expected_keys(spec: LoraExpertsSpec, blocks: list[str]) -> dict[str, tuple[int, int, int]]:
    """``{saved key: shape}`` for LoRA experts of ``spec`` on MoE blocks ``blocks``."""
    return {f"{b}.{CHILD}.{name}": shape for b in blocks for name, shape in spec.shapes().items()}


def check_lora_experts_file(
    path: Path, blocks: list[str] | None = None, hidden_size: int | None = None
) -> LoraExpertsSpec:
    """Check a saved LoRA-experts file from its header (nothing else is read): moetune's metadata, fp32
    tensors, every key a block's ``gate_proj`` / ``up_proj`` / ``down_proj`` of the recorded sizes and every block
    complete; with the model's MoE ``blocks`` and ``hidden_size``, exactly those blocks and that H. Returns
    the sizes; ``AdapterError`` naming the file, the tensor or field, and the fix otherwise."""
    from moetune.tensorfile import read_header

    spec = read_spec(path)
    try:
        tensors = read_header(path)
    except LoadError as e:
        raise AdapterError(f"{path} is damaged: {e}; save the adapter again") from None
    if hidden_size is not None and spec.hidden_size != hidden_size:
        raise AdapterError(
            f"{path}: LoRA experts of hidden size {spec.hidden_size}, the model's hidden_size is {hidden_size}; "
            "was the adapter saved for this model?"
        )
    saved_blocks = sorted({k.rpartition(f".{CHILD}.")[0] for k in tensors if f".{CHILD}." in k})
    want = expected_keys(spec, blocks if blocks is not None else saved_blocks)
    unknown, missing = sorted(set(tensors) - set(want)), sorted(set(want) - set(tensors))
    if unknown or missing:
        raise AdapterError(
            f"{path} does not hold LoRA experts for {'this model' if blocks is not None else 'whole MoE blocks'}: "
            f"tensors not expected {listing(unknown, inline=True) or 'none'}; missing "
            f"{listing(missing, inline=True) or 'none'}. Was it saved for this model? Save the adapter again"
        )
    for key, info in tensors.items():
        if info.dtype != "F32" or tuple(info.shape) != want[key]:
            raise AdapterError(
                f"{path}: {key} is {info.dtype} {list(info.shape)}; LoRA experts of N={spec.num_experts}, "
                f"I'={spec.intermediate_size}, H={spec.hidden_size} (its header) need F32 {list(want[key])}"
            )
    return spec


def load_lora_experts_state(model: nn.Module, state: Mapping[str, torch.Tensor], where: Path) -> None:
    """Copy saved LoRA-experts tensors into ``model``'s (attached) LoRA experts; every key must match."""
    own = dict(
        (f"{path}.{CHILD}.{name}", getattr(module, name))
        for path, module in lora_experts_of(model).items()
        for name in PARAMS
    )
    if set(own) != set(state):
        raise AdapterError(
            f"{where} does not fit the model's LoRA experts: missing {sorted(set(own) - set(state))[:6]}, "
            f"unexpected {sorted(set(state) - set(own))[:6]}; was it saved for this model?"
        )
    with torch.no_grad():
        for key, param in own.items():
            if tuple(state[key].shape) != tuple(param.shape):
                raise AdapterError(
                    f"{where}: {key} has shape {list(state[key].shape)}, the model's LoRA experts {list(param.shape)}"
                )
            param.copy_(state[key])
