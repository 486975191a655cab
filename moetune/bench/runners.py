"""What the engine benchmark times: the engine and its baselines, all built on the same weights and inputs.

Runners (registered in ``RUNNERS``), each one training step of one layer's routed experts, forward then
backward to x, the routing weights and, in LoRA mode, the LoRA tensors:

- ``engine``: ``moetune.engine.ExpertEngine`` called directly.
- ``loop``: ``moetune.testing.reference.expert_loop`` under eager autograd, one Python iteration per expert
  (the transformers v4 way of computing experts); LoRA tensors in the weights' dtype.
- ``hf``: transformers' own v5 ``Qwen3MoeExperts`` with its ``grouped_mm`` experts implementation; in LoRA
  mode wrapped by stock PEFT (``LoraConfig(target_parameters=[...gate_up_proj, ...down_proj])``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from moetune.engine import (
    LORA_NAMES,
    DenseExperts,
    EngineOptions,
    ExpertEngine,
    ExpertLoRA,
    SavedForward,
    TrainMode,
)
from moetune.registry import Registry
from moetune.testing.reference import expert_loop

B_STD = 0.01  # LoRA B is zero at initialisation; small random values make every LoRA product real work


@dataclass
class BenchWeights:
    """One layer's routed experts: base weights in the benchmarked dtype and master LoRA (fp32; fp64 for fp64)."""

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    lora: ExpertLoRA  # A [E, r, H] / B [E, 2I, r] and A [E, r, I] / B [E, H, r]
    lora_alpha: int


@dataclass
class BenchBatch:
    """One batch routed to the experts, and the gradient arriving at the layer's output."""

    x: torch.Tensor  # [T, H], weight dtype
    topk_ids: torch.Tensor  # [T, k] int64, distinct experts per token
    topk_weights: torch.Tensor  # [T, k], weight dtype, rows sum to 1
    grad_y: torch.Tensor  # [T, H], weight dtype


def make_weights(
    experts: int, hidden: int, intermediate: int, rank: int, alpha: int, dtype: torch.dtype, seed: int
) -> BenchWeights:
    """Random expert weights scaled so activations stay O(1) (std 1/sqrt(fan_in)), drawn directly in ``dtype``
    so no fp32 copy of a multi-GiB layer is ever made, their rows laid out as the loader lays out dense weights
    (``DenseExperts.empty``: bf16 rows of 4 KiB padded); LoRA as PEFT initialises it, then B made non-zero."""
    gen = torch.Generator().manual_seed(seed)
    gate_up, down = DenseExperts.empty(experts, intermediate, hidden, dtype)
    gate_up.normal_(0, hidden**-0.5, generator=gen)
    down.normal_(0, intermediate**-0.5, generator=gen)
    lora_dtype = torch.promote_types(dtype, torch.float32)
    lora = ExpertLoRA.init(experts, hidden, intermediate, rank, alpha, dtype=lora_dtype, generator=gen)
    lora.gate_up_B.normal_(0, B_STD, generator=gen)
    lora.down_B.normal_(0, B_STD, generator=gen)
    return BenchWeights(gate_up, down, lora, alpha)


def as_loaded(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` in the layout the loader fills for dense experts
    (``DenseExperts.empty``: bf16 rows of 4 KiB padded)."""
    e, two_i, h = gate_up.shape
    held = DenseExperts.empty(e, two_i // 2, h, gate_up.dtype)
    for dst, src in zip(held, (gate_up, down)):
        dst.copy_(src)
    return held


def cast_bench(
    weights: BenchWeights, batch: BenchBatch, dtype: torch.dtype
) -> tuple[BenchWeights, BenchBatch]:
    """The same layer and batch with base weights and activations in ``dtype`` (same values when upcasting);
    unchanged objects when they already are."""
    if weights.gate_up.dtype == dtype:
        return weights, batch
    return (
        replace(weights, gate_up=weights.gate_up.to(dtype), down=weights.down.to(dtype)),
        replace(
            batch,
            x=batch.x.to(dtype),
            topk_weights=batch.topk_weights.to(dtype),
            grad_y=batch.grad_y.to(dtype),
        ),
    )


def make_batch(
    tokens: int, experts: int, top_k: int, hidden: int, dtype: torch.dtype, seed: int
) -> BenchBatch:
    """Tokens routed like a softmax top-k router over random logits (normalised top-k probabilities)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=gen)
    probs, ids = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
    return BenchBatch(
        x=torch.randn(tokens, hidden, generator=gen).to(dtype),
        topk_ids=ids,
        topk_weights=(probs / probs.sum(dim=-1, keepdim=True)).to(dtype),
        grad_y=torch.randn(tokens, hidden, generator=gen).to(dtype),
    )


class Step:
    """One timed training step, split so forward and backward are timed apart: ``backward(forward())``."""

    held_bytes: int | None = None  # activation bytes the last forward kept for backward, where known

    def forward(self) -> Any:
        raise NotImplementedError

    def backward(self, state: Any) -> None:
        raise NotImplementedError


class EngineStep(Step):
    def __init__(self, engine: ExpertEngine, batch: BenchBatch) -> None:
        self.engine, self.batch = engine, batch

    def forward(self) -> SavedForward:
        b = self.batch
        _, saved = self.engine.forward(b.x, b.topk_ids, b.topk_weights)
        assert saved is not None
        self.held_bytes = saved.nbytes
        return saved

    def backward(self, state: SavedForward) -> None:
        self.engine.backward(state, self.batch.grad_y)


class AutogradStep(Step):
    """Forward ``fn() -> y [T, H]``; backward takes the grads of ``leaves`` with ``torch.autograd.grad`` (no
    accumulation into ``.grad`` between repetitions)."""

    def __init__(
        self, fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor], grad_y: torch.Tensor
    ) -> None:
        self.fn, self.leaves, self.grad_y = fn, leaves, grad_y

    def forward(self) -> torch.Tensor:
        return self.fn()

    def backward(self, state: torch.Tensor) -> None:
        torch.autograd.grad(state, self.leaves, self.grad_y)


StepBuilder = Callable[[BenchWeights, BenchBatch, TrainMode, EngineOptions], Step]
RUNNERS: Registry[StepBuilder] = Registry("benchmark runner")


def _check_mode(mode: TrainMode) -> None:
    assert mode in (TrainMode.LORA, TrainMode.FROZEN), (
        f"the engine benchmark times lora and frozen; got {mode}"
    )


def _inputs(batch: BenchBatch) -> tuple[torch.Tensor, torch.Tensor]:
    return batch.x.detach().requires_grad_(True), batch.topk_weights.detach().requires_grad_(True)


@RUNNERS.register("engine")
def engine_step(weights: BenchWeights, batch: BenchBatch, mode: TrainMode, options: EngineOptions) -> Step:
    """The expert engine on the layer, with the activation policy of ``options``."""
    _check_mode(mode)
    lora = weights.lora if mode is TrainMode.LORA else None
    return EngineStep(
        ExpertEngine(DenseExperts(weights.gate_up, weights.down), lora=lora, options=options), batch
    )


@RUNNERS.register("loop")
def loop_step(weights: BenchWeights, batch: BenchBatch, mode: TrainMode, options: EngineOptions) -> Step:
    """``expert_loop`` under eager autograd; LoRA in the weights' dtype, as the loop multiplies it with x."""
    _check_mode(mode)
    x, w = _inputs(batch)
    leaves = [x, w]
    lora = None
    if mode is TrainMode.LORA:
        lora = {
            name: t.detach().to(weights.gate_up.dtype).requires_grad_(True)
            for name, t in zip(LORA_NAMES, weights.lora.tensors())
        }
        leaves += list(lora.values())
    scaling = weights.lora.scaling

    def fn() -> torch.Tensor:
        return expert_loop(x, batch.topk_ids, w, weights.gate_up, weights.down, lora=lora, scaling=scaling)

    return AutogradStep(fn, leaves, batch.grad_y)


class _Holder(nn.Module):
    """Gives the experts module a parent, so PEFT's ``target_parameters`` can name ``experts.<param>``."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return self.experts(x, topk_ids, topk_weights)


def hf_experts(weights: BenchWeights, mode: TrainMode, top_k: int) -> nn.Module:
    """transformers' ``Qwen3MoeExperts`` (``grouped_mm``) holding ``weights`` (shared, not copied, unless their
    rows are padded), frozen;
    in LoRA mode wrapped by stock PEFT with ``weights.lora`` loaded through PEFT's own state-dict path.

    Called as ``module(x [T, H], topk_ids [T, k], topk_weights [T, k]) -> y [T, H]``.
    """
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from moetune.adapters import PEFT_MODEL_PREFIX, expert_lora_to_peft_state

    e, two_i, h = weights.gate_up.shape
    config = Qwen3MoeConfig(
        hidden_size=h,
        moe_intermediate_size=two_i // 2,
        num_experts=e,
        num_experts_per_tok=top_k,
        hidden_act="silu",
    )
    config._experts_implementation = "grouped_mm"  # what from_pretrained(experts_implementation=...) sets
    with torch.device("meta"):  # the module's own fp32 parameters would be a full extra copy of the layer
        experts = Qwen3MoeExperts(config)
    # as from_pretrained gives them: contiguous (a copy only where make_weights padded the rows)
    experts.gate_up_proj = nn.Parameter(weights.gate_up.contiguous(), requires_grad=False)
    experts.down_proj = nn.Parameter(weights.down.contiguous(), requires_grad=False)
    if mode is TrainMode.FROZEN:
        return experts
    lora = weights.lora
    peft_config = LoraConfig(
        r=lora.rank,
        lora_alpha=weights.lora_alpha,
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    model = get_peft_model(_Holder(experts), peft_config)
    result: Any = set_peft_model_state_dict(
        model, expert_lora_to_peft_state(lora, PEFT_MODEL_PREFIX + "experts")
    )
    assert not result.unexpected_keys, result.unexpected_keys
    return model


@RUNNERS.register("hf")
def hf_step(weights: BenchWeights, batch: BenchBatch, mode: TrainMode, options: EngineOptions) -> Step:
    """transformers v5 ``grouped_mm`` experts (+ stock PEFT in LoRA mode) under eager autograd."""
    _check_mode(mode)
    module = hf_experts(weights, mode, batch.topk_ids.shape[1])
    x, w = _inputs(batch)
    leaves = [x, w] + [p for p in module.parameters() if p.requires_grad]

    def fn() -> torch.Tensor:
        return module(x, batch.topk_ids, w)

    return AutogradStep(fn, leaves, batch.grad_y)
