"""The work one routed-expert layer does: GEMM FLOPs of forward and backward, and the weight bytes it reads.

These are the numerators of the engine benchmark's throughput and roofline; ``docs/benchmarks.md`` derives them.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.engine import ActivationPolicy, TrainMode


@dataclass(frozen=True)
class FlopCount:
    """GEMM FLOPs (multiply and add counted as two) of one forward and of its backward."""

    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


def expert_flops(
    tokens: int,
    top_k: int,
    hidden: int,
    intermediate: int,
    rank: int,
    mode: TrainMode,
    policy: ActivationPolicy,
) -> FlopCount:
    """GEMM FLOPs the expert engine computes for T tokens routed to k experts each (N = T * k routed rows).

    Only matrix products count; activations, routing and weighting are element-wise and ignored.
    With H hidden, I expert intermediate and r the LoRA rank (0 without LoRA)::

        forward  = 6 N H I                       gate_up [N, H] x [H, 2I] (4NHI), down [N, I] x [I, H] (2NHI)
                 + 2 N r (2H + 3I)               LoRA: x A1^T, (.) B1^T, h A2^T, (.) B2^T
        backward = 6 N H I                       grad through down (2NHI) and through gate_up (4NHI)
                 + 4 N r (2H + 3I)               LoRA: per projection g B, (.) A, grad A, grad B
                 + 6 N H I                       full mode only: grads of the base weights
                 + 4 N H I + 2 N r (H + 3I)      recompute only: gate_up forward again (4NHI), its LoRA
                                                 terms (2Nr(H + 2I)) and down's A-projection h A2^T (2NrI)

    ``rank`` is ignored in frozen mode (no LoRA is computed).
    """
    n, h, i = tokens * top_k, hidden, intermediate
    r = 0 if mode is TrainMode.FROZEN else rank
    forward = 6 * n * h * i + 2 * n * r * (2 * h + 3 * i)
    backward = 6 * n * h * i + 4 * n * r * (2 * h + 3 * i)
    if mode is TrainMode.FULL:
        backward += 6 * n * h * i
    if policy is ActivationPolicy.RECOMPUTE:
        backward += 4 * n * h * i + 2 * n * r * (h + 3 * i)
    return FlopCount(forward=forward, backward=backward)


def expert_weight_bytes(active_experts: int, hidden: int, intermediate: int, bytes_per_element: int) -> int:
    """Bytes of base expert weights one forward plus its backward must read: each active expert's gate_up
    ``[2I, H]`` and down ``[H, I]`` once in each pass (experts that receive no token are never read).

    LoRA tensors are left out: at r = 8 (fp32) they are about 2% of the bf16 base weights' bytes.
    """
    return 2 * active_experts * 3 * hidden * intermediate * bytes_per_element
