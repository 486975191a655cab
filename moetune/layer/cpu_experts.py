"""``CpuExperts``: an ``nn.Module`` with a transformers v5 experts module's call signature, run by the engine.

``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, so it can take the
place of ``block.experts`` on a model instance. Base expert weights stay inside the engine (host memory,
any format) and are not module parameters unless full mode trains them; expert LoRA tensors are
registered as CPU ``nn.Parameter``s that any torch optimizer can update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moetune.engine import LORA_NAMES, DenseExperts, ExpertEngine, TrainMode
from moetune.layer.function import routed_experts
from moetune.layer.memo import ForwardMemo
from moetune.layer.overlap import SharedAhead
from moetune.layer.transfer import HostCopy


class CpuExperts(nn.Module):
    """Holds one :class:`ExpertEngine`; its trainable tensors are this module's parameters."""

    def __init__(self, engine: ExpertEngine) -> None:
        super().__init__()
        self.engine = engine
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
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden_states ``[T, H]`` (any device), top_k_index ``[T, k]``, top_k_weights ``[T, k]`` -> ``[T, H]``.

        The host copies of the inputs are queued first, then the block's shared experts (if attached), so the
        device computes those while the engine runs (``moetune.layer.overlap``).
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
        )

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
