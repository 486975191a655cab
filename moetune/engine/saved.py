"""What an engine pass hands on: ``SavedForward`` (one forward's activations for its backward, consumed once) and
``ExpertGrads`` (backward's results). See ``moetune.engine.experts``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from moetune.engine.base_grads import BaseGrads
from moetune.engine.lora import LORA_NAMES, ExpertLoRA
from moetune.engine.routing import Dispatch


@dataclass(eq=False)
class SavedForward:
    """What one forward hands its backward. Consumed exactly once."""

    engine_id: int
    index: int  # the engine's forward counter, for messages
    x: torch.Tensor  # [T, H] compute dtype
    x_dtype: torch.dtype  # dtype of the caller's x: grad_x is returned in it
    topk_ids: torch.Tensor  # [T, k] int64
    topk_weights: torch.Tensor  # [T, k]
    seed: int | None  # LoRA dropout seed (masks are regenerated, not stored)
    versions: tuple[int, ...]  # in-place versions of the trained tensors at forward time
    lora: ExpertLoRA | None = None  # the expert LoRA this forward computed with; its backward uses the same
    disp: Dispatch | None = None  # retain only (EnginePlan.keep_activations)
    gate_up: torch.Tensor | None = None  # [N, 2I] compute dtype, retain only
    lora_xa: torch.Tensor | None = None  # [N, r] compute dtype: drop(x) A1^T, retain + LoRA only
    lora_ha: torch.Tensor | None = None  # [N, r] compute dtype: drop(h) A2^T, retain + LoRA only
    consumed: bool = field(default=False)

    TENSOR_FIELDS = ("x", "topk_ids", "topk_weights", "gate_up", "lora_xa", "lora_ha")

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The large tensors, in ``TENSOR_FIELDS`` order (for ``ctx.save_for_backward``)."""
        return tuple(getattr(self, f) for f in self.TENSOR_FIELDS)

    def with_tensors(self, tensors: tuple[torch.Tensor | None, ...]) -> SavedForward:
        """A fresh, unconsumed copy holding ``tensors`` (as returned by ``ctx.saved_tensors``)."""
        fields: dict[str, Any] = dict(zip(self.TENSOR_FIELDS, tensors))
        return replace(self, consumed=False, **fields)

    @property
    def nbytes(self) -> int:
        """Bytes held for backward (inputs included)."""
        held = [self.x, self.topk_ids, self.topk_weights, self.gate_up, self.lora_xa, self.lora_ha]
        total = sum(t.nbytes for t in held if t is not None)
        return total + (self.disp.nbytes if self.disp is not None else 0)


@dataclass
class ExpertGrads:
    """Backward's results. ``lora`` is fp32 (fp64 for fp64 LoRA), keyed by ``LORA_NAMES``; ``base`` only in full
    mode, for the experts that received rows only (fp32, fp64 for an fp64 engine: ``base_grads.BaseGrads``)."""

    x: torch.Tensor  # [T, H], dtype of x
    topk_weights: torch.Tensor  # [T, k], dtype of topk_weights
    lora: dict[str, torch.Tensor] | None = None
    base: BaseGrads | None = None

    def flat(self) -> tuple[torch.Tensor, ...]:
        """LoRA grads in ``ExpertEngine.trained_tensors`` order (the base ones follow there: ``base``)."""
        return tuple(self.lora[n] for n in LORA_NAMES) if self.lora else ()
