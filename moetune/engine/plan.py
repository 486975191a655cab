"""The engine's settings and the plan resolved from them once, when an engine is built.

``EngineOptions`` says how to compute (activation policy, compute dtype, finiteness checks);
``EnginePlan`` turns the options, the LoRA present and the training mode into the decisions forward and
backward act on (what forward keeps, what backward recomputes and which gradients it forms), so no pass
re-derives them from flags.

The CPU thread count is not an engine setting: the engine's GEMMs run on torch's intra-op pool, which is
process-wide; whoever owns the process sizes it once (``moetune.engine.threads.set_engine_threads``).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from moetune.sysinfo import cpu_info


class ActivationPolicy(str, Enum):
    """What a forward keeps for its backward."""

    RETAIN = "retain"  # gate_up pre-activations [N, 2I] and the LoRA A-projections [N, r]
    RECOMPUTE = "recompute"  # only the inputs; backward recomputes gate_up (one third of forward's GEMMs)


class TrainMode(str, Enum):
    """What backward differentiates besides x and the routing weights (resolved once, at construction)."""

    FROZEN = "frozen"  # nothing else: the cheapest backward
    LORA = "lora"  # expert LoRA A/B
    FULL = "full"  # base expert weights (and biases), plus LoRA when present


@dataclass(frozen=True)
class EngineOptions:
    """Engine settings. ``compute_dtype=None`` picks per machine (see ``resolve_compute_dtype``)."""

    policy: ActivationPolicy = ActivationPolicy.RETAIN
    compute_dtype: torch.dtype | None = None
    check_finite: bool = False  # debug: raise NonFiniteError naming the tensor and expert


def resolve_compute_dtype(storage: torch.dtype, requested: torch.dtype | None = None) -> torch.dtype:
    """The dtype GEMMs run in.

    fp32/fp64 weights compute as stored. bf16 weights, and quantized ones (1-byte storage: int8, packed
    int4 as uint8, fp8), compute in bf16 only where the CPU has bf16 dot products (AMX-BF16 or
    AVX512-BF16); elsewhere oneDNN emulates bf16 and fp32 GEMMs on tiles converted into reused buffers are
    faster (measured 6x on an AVX2-only EPYC: 0.015 vs 0.09 TFLOP/s). fp16 computes in fp32.
    """
    if requested is not None:
        return requested
    if storage in (torch.float32, torch.float64):
        return storage
    dequantized_like_bf16 = storage == torch.bfloat16 or storage.itemsize == 1
    if dequantized_like_bf16 and cpu_info().native_bf16_gemm:
        return torch.bfloat16
    return torch.float32


@dataclass(frozen=True)
class EnginePlan:
    """What one engine's passes do, for N = T * k routed rows.

    Attributes:
        mode: what backward differentiates besides x and the routing weights.
        lora: forward adds the LoRA terms and backward forms their fp32 grads (lora mode, or full with LoRA).
        keep_activations: a saving forward keeps the dispatch, gate_up ``[N, 2I]`` and, with LoRA, the
            A-projections ``[N, r]`` of both projections (retain policy); otherwise only its inputs.
        recompute_gate_up: backward recomputes gate_up ``[N, 2I]`` and its LoRA A-projection ``[N, r]`` from
            the inputs (recompute policy); the down A-projection is then formed inside the LoRA backward.
        gather_inputs: backward needs the inputs sorted by expert, xs ``[N, H]``: to recompute gate_up, for
            the LoRA A grads of gate_up, or for the base gate_up grads.
        base_grads: backward forms grads of gate_up, down and the biases present (full mode).
    """

    mode: TrainMode
    lora: bool
    keep_activations: bool
    recompute_gate_up: bool
    gather_inputs: bool
    base_grads: bool

    @classmethod
    def resolve(cls, policy: ActivationPolicy, *, has_lora: bool, train_base: bool) -> EnginePlan:
        """The plan for ``policy``, with or without LoRA, training the base weights or not."""
        retain = policy is ActivationPolicy.RETAIN
        return cls(
            mode=TrainMode.FULL if train_base else TrainMode.LORA if has_lora else TrainMode.FROZEN,
            lora=has_lora,
            keep_activations=retain,
            recompute_gate_up=not retain,
            gather_inputs=not retain or has_lora or train_base,
            base_grads=train_base,
        )
