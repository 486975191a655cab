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
from typing import TYPE_CHECKING

import torch
from torch import nn

from moetune.engine import LORA_NAMES, DenseExperts, ExpertEngine, ExpertLoRA, TrainMode
from moetune.errors import SaveError
from moetune.layer.function import routed_experts
from moetune.layer.memo import ForwardMemo
from moetune.layer.overlap import SharedAhead
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
        if engine.mode is TrainMode.FULL:
            weights = engine.weights
            assert isinstance(weights, DenseExperts)
            weights.gate_up = nn.Parameter(weights.gate_up.detach())
            weights.down = nn.Parameter(weights.down.detach())
            self.gate_up_proj, self.down_proj = weights.gate_up, weights.down
            if engine.gate_up_bias is not None:
                engine.gate_up_bias = self.gate_up_proj_bias = nn.Parameter(engine.gate_up_bias.detach())
            if engine.down_bias is not None:
                engine.down_bias = self.down_proj_bias = nn.Parameter(engine.down_bias.detach())

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
        return routed_experts(
            self.engine,
            hidden_states,
            top_k_index,
            top_k_weights,
            training=self.training,
            memo=self.memo,
            host=host,
            lora=lora,
        )

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if PEFT_WRAPPED_PREFIX not in prefix:
            raise SaveError(
                f"{prefix.rstrip('.') or 'this module'}: the routed experts live in moetune's CPU engine, not in "
                "torch parameters, so a state dict or save_pretrained of this model would silently leave them out. "
                "Save what you trained as an adapter instead, moetune.save_adapter(peft_model, dir) or "
                "peft_model.save_pretrained(dir) (stock PEFT format, loads on the original checkpoint), and keep "
                "using the original base checkpoint; "
                "exporting merged full weights is not supported yet."
            )
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> CpuExperts:
        # model.to("cuda") / model.bfloat16() must not move or down-cast host-resident expert state:
        # the engine computes on the CPU and keeps fp32 master LoRA weights.
        return self

    def extra_repr(self) -> str:
        e = self.engine
        return (
            f"E={e.num_experts}, H={e.hidden_size}, I={e.intermediate_size}, format={e.weights.name}, "
            f"storage={e.weights.storage_dtype}, compute={e.compute_dtype}, mode={e.mode.value}, "
            f"policy={e.options.policy.value}"
        )
