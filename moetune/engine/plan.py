"""The engine's settings and the plan resolved from them once, when an engine is built.

``EngineOptions`` says how to compute (activation policy, compute dtype, finiteness checks);
``EnginePlan`` turns the options, the LoRA present and the training mode into the decisions forward and
backward act on (what forward keeps, what backward recomputes and which gradients it forms), so no pass
re-derives them from flags. ``ActivationPolicy`` is the config's (``moetune.config.experts``), re-exported here.

The CPU thread count is not an engine setting: the engine's GEMMs run on torch's intra-op pool, which is
process-wide; whoever owns the process sizes it once (``moetune.engine.threads.set_engine_threads``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import torch

from moetune.config.experts import ActivationPolicy
from moetune.sysinfo import cpu_info

__all__ = ["ActivationPolicy", "EngineOptions", "EnginePlan", "TrainMode", "resolve_compute_dtype"]


class TrainMode(str, Enum):
    """What backward differentiates besides x and the routing weights (resolved once, at construction)."""

    FROZEN = "frozen"  # nothing else: the cheapest backward (a call may still pass LoRA to train)
    LORA = "lora"  # the engine's own expert LoRA A/B
    FULL = "full"  # base expert weights (and biases), plus LoRA when present


@dataclass(frozen=True)
class EngineOptions:
    """Engine settings. ``compute_dtype=None`` picks per machine (see ``resolve_compute_dtype``)."""

    policy: ActivationPolicy = ActivationPolicy.RETAIN
    compute_dtype: torch.dtype | None = None
    check_finite: bool = False  # debug: raise NonFiniteError naming the tensor and expert
    # experts computed at once (``threads.split_threads``); None: one per thread of the caller's intra-op pool
    # (experts under ``threads.MIN_POOL_EXPERT_PARAMS`` one at a time), 1: one expert at a time on all of them
    expert_workers: int | None = None
    # the int8 format's kernels round the activations to 8-bit integer rows (``ExpertOptions.int8_activations``,
    # ``gemm.resolve_gemm_path``'s ``int8_rows``)
    int8_activations: bool = False
    # GEMM rows in pieces from a fixed set of sizes (``engine.shapes``); None: where the compute dtype runs on
    # oneDNN's per-shape kernels (bf16, fp16); False measures the whole-row GEMMs (the benchmarks' A/B)
    split_rows: bool | None = None
    # LoRA products of experts with few rows as one bmm over all experts (``engine.lora_batch``) where GEMMs run
    # on oneDNN (bf16, fp16) and no dropout applies; False: per expert (the benchmarks' A/B)
    batch_lora: bool = True
    # each expert's op sequences (row-split GEMMs, LoRA terms) as one compiled call that releases the GIL once
    # (``engine.shapes``, ``kernels/ops.h``); None: wherever the kernels load, False: the Python reference (the
    # benchmarks' A/B)
    native_ops: bool | None = None


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


def _gathers_inputs(recompute_gate_up: bool, lora: bool, base_grads: bool) -> bool:
    """Whether backward needs the inputs sorted by expert, xs ``[N, H]`` (see ``EnginePlan.gather_inputs``)."""
    return recompute_gate_up or lora or base_grads


@dataclass(frozen=True)
class EnginePlan:
    """What one engine's passes do, for N = T * k routed rows.

    An engine resolves its plan once, at construction, from its options, its own LoRA and its training mode.
    A call may bring LoRA of its own (``ExpertEngine.forward(..., lora=...)``: a PEFT layer's active adapter),
    which can differ from the engine's only in being present where the engine has none: the pass then runs
    :meth:`for_call`, the same plan with ``lora`` and ``gather_inputs`` switched on. Those two are the only
    per-call choices; the mode (``TrainMode.FROZEN`` stays frozen: the engine has no LoRA of its own), the
    policy's choices and the base grads are the engine's. Backward runs the plan of its forward's LoRA
    (``SavedForward.lora``).

    Attributes:
        mode: what backward differentiates besides x and the routing weights, as the engine was built.
        lora: forward adds the LoRA terms and backward forms their fp32 grads (the engine's own LoRA in lora
            mode or full with LoRA, or a call's).
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
            gather_inputs=_gathers_inputs(not retain, has_lora, train_base),
            base_grads=train_base,
        )

    def for_call(self, has_lora: bool) -> EnginePlan:
        """The plan of one pass whose LoRA (the call's, else the engine's) is present or not: this plan, or,
        for LoRA on an engine built without any, this plan with the LoRA terms and the inputs they need."""
        if has_lora == self.lora:
            return self
        assert has_lora, "a call without LoRA of its own computes with the engine's"
        return replace(
            self, lora=True, gather_inputs=_gathers_inputs(self.recompute_gate_up, True, self.base_grads)
        )
