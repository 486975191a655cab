"""This machine's roofline for one expert layer: the best GEMM throughput torch reaches on the layer's
projection shapes, and large-tensor read bandwidth.

Peak is measured in bf16 and in fp32 and the larger is used: on CPUs without bf16 dot products (no AMX-BF16
or AVX512-BF16) oneDNN emulates bf16 GEMMs, which run several times slower than fp32 ones, and the engine
computes bf16 weights in fp32 there (``moetune.engine.resolve_compute_dtype``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moetune.bench.timing import CallBudget, TimingPolicy, measure

PEAK_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class GemmShape:
    """One projection GEMM as the engine runs it: ``a [M, K] @ b [K, N]``."""

    name: str  # e.g. "gate_up fwd"
    m: int
    k: int
    n: int
    transposed: bool  # b is a transposed view of a row-major [N, K] weight (forward), else row-major [K, N]

    @property
    def flops(self) -> int:
        return 2 * self.m * self.k * self.n


def projection_gemms(hidden: int, intermediate: int, rows: tuple[int, ...]) -> list[GemmShape]:
    """The layer's projection GEMMs for M in ``rows``, in the weight layouts the engine uses.

    Forward: ``[M, H] x [H, 2I]`` and ``[M, I] x [I, H]`` (weights ``[2I, H]`` / ``[H, I]`` used transposed);
    backward (grad of the input): ``[M, 2I] x [2I, H]`` and ``[M, H] x [H, I]`` (the same weights as stored).
    """
    h, i = hidden, intermediate
    out = []
    for m in sorted(rows):
        out += [
            GemmShape("gate_up fwd", m, h, 2 * i, transposed=True),
            GemmShape("down fwd", m, i, h, transposed=True),
            GemmShape("gate_up bwd", m, 2 * i, h, transposed=False),
            GemmShape("down bwd", m, h, i, transposed=False),
        ]
    return out


@dataclass(frozen=True)
class GemmResult:
    """One projection GEMM's best throughput in one dtype, or why it was not measured."""

    shape: GemmShape
    dtype: torch.dtype
    tflops: float | None  # None: skipped
    note: str = ""


@dataclass(frozen=True)
class PeakGemm:
    """Best TFLOP/s per dtype over the layer's projection shapes, and every measurement behind it."""

    by_dtype: dict[torch.dtype, float]
    results: tuple[GemmResult, ...]

    @property
    def best(self) -> float:
        return max(self.by_dtype.values())

    @property
    def best_dtype(self) -> torch.dtype:
        return max(self.by_dtype, key=lambda d: self.by_dtype[d])

    @property
    def best_shape(self) -> GemmShape:
        """The GEMM that reached the peak."""
        measured = [r for r in self.results if r.tflops is not None]
        return max(measured, key=lambda r: r.tflops or 0.0).shape


def measure_peak_gemm(
    hidden: int, intermediate: int, rows: tuple[int, ...], policy: TimingPolicy
) -> PeakGemm:
    """Best-of-``policy`` throughput of each projection GEMM in bf16 and fp32.

    A shape is skipped (in one dtype) when one call, predicted from the same shape at a smaller M, would take
    longer than ``policy.budget_s``: bf16 GEMMs with a row-major right operand run ~30x slower than fp32 on an
    AVX2-only CPU, and one at M = 4096 would take a minute and a half without changing the peak. The smallest
    M of each shape always runs.
    """
    budget = CallBudget(policy.budget_s)
    gen = torch.Generator().manual_seed(0)
    results = []
    for dtype in PEAK_DTYPES:
        for shape in projection_gemms(hidden, intermediate, rows):
            key = (dtype, shape.name)
            reason = budget.skip_reason(key, shape.flops)
            if reason is not None:
                results.append(GemmResult(shape, dtype, None, reason))
                continue
            a = torch.randn(shape.m, shape.k, generator=gen).to(dtype)
            if shape.transposed:
                b = torch.randn(shape.n, shape.k, generator=gen).to(dtype).t()
            else:
                b = torch.randn(shape.k, shape.n, generator=gen).to(dtype)
            out = torch.empty(shape.m, shape.n, dtype=dtype)
            timing = measure(functools.partial(torch.mm, a, b, out=out), None, policy)
            budget.record(key, shape.flops, timing.best_ms / 1e3)
            results.append(GemmResult(shape, dtype, shape.flops / timing.best_ms / 1e9))
    by_dtype = {
        d: max((r.tflops for r in results if r.dtype == d and r.tflops is not None), default=0.0)
        for d in PEAK_DTYPES
    }
    return PeakGemm(by_dtype=by_dtype, results=tuple(results))


def measure_read_bandwidth(nbytes: int, reps: int = 5) -> float:
    """GB/s (1e9 bytes) of summing an fp32 tensor of ``nbytes`` bytes, best of ``reps`` (after one warm-up).

    Use a tensor far larger than the last-level cache (>= 1 GiB) so the sum streams from memory.
    """
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    timing = measure(lambda: x.sum(), None, TimingPolicy(warmup=1, reps=reps, budget_s=float("inf")))
    return x.nbytes / timing.best_ms / 1e6


@dataclass(frozen=True)
class Roofline:
    """The lower bound on a layer's fwd+bwd time: compute at peak or weight reads at full bandwidth."""

    peak: PeakGemm
    bandwidth_gbs: float

    def time_ms(self, flops: int, weight_bytes: int) -> float:
        """``max(flops / peak, weight_bytes / bandwidth)`` in milliseconds."""
        return max(flops / (self.peak.best * 1e9), weight_bytes / (self.bandwidth_gbs * 1e6))
