"""The one battery every registered expert weight format passes (docs/formats.md states the bounds).

Each case is a format plus its options. Error bounds are for Gaussian weights (std 1/sqrt(fan_in)) and
come from the quantization step: uniform rounding error has rms step/sqrt(12), so

* int8 per channel: step = max|row| / 127 ~ 2.9 sigma / 127 for rows of 128-256 -> ~0.7%, bound 1%.
* int4 symmetric: step = max|group| / 7; the max of 32/64/128 Gaussians ~ 2.4/2.6/2.9 sigma -> ~9.7/10.7/
  11.7%, bounds 11/12/13%. asymmetric: step = range / 15 -> ~9%, bound 10.5%.
* fp8 e4m3: 3 mantissa bits, relative half-ulp 2^-4, rms over a binade ~2.6%, bound 3%.
* mxfp4 (e2m1, power-of-two scale per 32, OCP rule): 1 mantissa bit, so a relative half-step of up to 2^-2
  in the top binades, plus the clipping of (6, 8) * scale to 6; measured 11.5% on these weights, bound 13%.
* dense bf16 from fp32: unit roundoff 2^-9 -> ~0.1%, bound 0.4%.

The lower bounds prove the weights really were quantized. A layer's output ``W_d (silu(W_g x) * W_u x)``
carries three independent weight errors of about the same relative size e, which add in quadrature:
~sqrt(3) e (measured 1.73-1.80 e for every case), so its bound is 2x the weight bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from moetune.engine import (
    LORA_NAMES,
    ActivationPolicy,
    DenseExperts,
    EngineOptions,
    ExpertEngine,
    ExpertFormat,
    ExpertLoRA,
)
from moetune.engine.formats import FORMATS
from moetune.engine.gemm import Conversion
from moetune.errors import EngineError
from moetune.layer import CpuExperts
from tests.unit.engine_cases import make_routing, run_module

E, H, I, R = 4, 256, 128, 4  # H != 2I; every int4 group size divides H and I
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny GEMMs (see the fixture)


@dataclass(frozen=True)
class Case:
    id: str
    format: str
    weight_err: tuple[float, float]  # (lower, upper) relative Frobenius error of dequantize()
    max_bytes_per_param: float
    options: dict[str, Any] = field(default_factory=dict)
    source_dtype: torch.dtype = torch.float32

    def build(self, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertFormat:
        fmt = FORMATS.get(self.format).from_dense(
            gate_up.to(self.source_dtype), down.to(self.source_dtype), **self.options
        )
        assert isinstance(fmt, ExpertFormat)
        return fmt


CASES = [
    Case("dense-bf16", "dense", (1e-4, 4e-3), 2.0, source_dtype=torch.bfloat16),
    Case("int8", "int8", (3e-3, 1e-2), 1.02),
    Case("int4-g32-sym", "int4", (0.07, 0.11), 0.57, {"group_size": 32}),
    Case("int4-g64-sym", "int4", (0.08, 0.12), 0.56, {"group_size": 64}),
    Case("int4-g64-asym", "int4", (0.07, 0.105), 0.56, {"group_size": 64, "symmetric": False}),
    Case("int4-g128-sym", "int4", (0.08, 0.13), 0.52, {"group_size": 128}),
    Case("fp8_block", "fp8_block", (0.02, 0.03), 1.01),
    Case("mxfp4", "mxfp4", (0.09, 0.13), 0.54),
]
QUANTIZED = [c for c in CASES if c.format != "dense"]
case_params = pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)


def gaussian(e: int = E, h: int = H, i: int = I, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up ``[E, 2I, H]``, down ``[E, H, I]`` fp32 with std 1/sqrt(fan_in), as trained layers roughly are."""
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(e, 2 * i, h, generator=gen) / h**0.5,
        torch.randn(e, h, i, generator=gen) / i**0.5,
    )


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_F / ||b||_F in float64 (b the reference)."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def built() -> dict[str, tuple[ExpertFormat, torch.Tensor, torch.Tensor]]:
    gate_up, down = gaussian()
    return {c.id: (c.build(gate_up, down), gate_up, down) for c in CASES}


def test_every_registered_format_has_a_case():
    assert set(FORMATS.names()) == {c.format for c in CASES}


@case_params
def test_contract_shapes_and_dtypes(case, built):
    fmt, _, _ = built[case.id]
    assert FORMATS.get(fmt.name) is type(fmt) and fmt.name == case.format
    assert (fmt.num_experts, fmt.hidden_size, fmt.intermediate_size) == (E, H, I)
    assert fmt.shape("gate_up") == (2 * I, H) and fmt.shape("down") == (H, I)
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        gate_up, down = fmt.dequantize(dtype)
        assert gate_up.shape == (E, 2 * I, H) and down.shape == (E, H, I)
        assert gate_up.dtype == down.dtype == dtype
    if case.format != "dense":
        assert fmt.storage_dtype.itemsize == 1  # codes stay compact; the engine computes in bf16 or fp32


@case_params
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_tile_equals_dequantize_and_fills_the_buffer(case, built, dtype):
    fmt, _, _ = built[case.id]
    full = dict(zip(("gate_up", "down"), fmt.dequantize(dtype)))
    bufs = {p: torch.full(fmt.shape(p), float("nan"), dtype=dtype) for p in full}  # stale garbage
    # interleave projections and experts: per-thread scratch must not leak between calls
    for e, proj in [(0, "gate_up"), (3, "down"), (1, "gate_up"), (2, "down"), (3, "gate_up"), (0, "down")]:
        if fmt.needs_buffer(dtype):
            out = fmt.tile(proj, e, dtype, bufs[proj])
            assert out.data_ptr() == bufs[proj].data_ptr()
        else:
            out = fmt.tile(proj, e, dtype, None)  # a view of the stored weights
        assert out.dtype == dtype and tuple(out.shape) == fmt.shape(proj)
        assert torch.equal(out, full[proj][e]), (proj, e)


@case_params
def test_needs_buffer(case, built):
    fmt, _, _ = built[case.id]
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        expected = dtype != fmt.storage_dtype if case.format == "dense" else True
        assert fmt.needs_buffer(dtype) is expected, dtype


@case_params
def test_bytes_per_parameter_target(case):
    # a mid-size layer: per-channel scales are amortised as in real models (H = 512 is small for an MoE)
    fmt = case.build(*gaussian(e=2, h=512, i=256))
    assert fmt.nbytes / (2 * 3 * 512 * 256) == pytest.approx(fmt.bytes_per_param)
    assert fmt.bytes_per_param <= case.max_bytes_per_param


@case_params
def test_round_trip_error_within_bounds(case, built):
    fmt, gate_up, down = built[case.id]
    gq, dq = fmt.dequantize(torch.float32)
    lower, upper = case.weight_err
    for got, ref in ((gq, gate_up), (dq, down)):
        assert lower < rel_fro(got, ref) < upper


def _module(weights: ExpertFormat, lora: dict[str, torch.Tensor], **opts: Any) -> CpuExperts:
    tensors = {n: t.clone() for n, t in lora.items()}
    return CpuExperts(
        ExpertEngine(weights, lora=ExpertLoRA(**tensors, scaling=2.0), options=EngineOptions(**opts))
    )


def _lora(seed: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    init = ExpertLoRA.init(E, H, I, R, alpha=8.0, generator=gen)
    tensors = {n: t.clone() for n, t in zip(LORA_NAMES, init.tensors())}
    for n in ("gate_up_B", "down_B"):  # B = 0 would hide every LoRA path
        tensors[n].normal_(generator=gen).mul_(0.05)
    return tensors


@case_params
def test_layer_output_error_within_bound(case, built):
    fmt, gate_up, down = built[case.id]
    x, ids, w = make_routing(T=32, E=E, k=2, H=H, dtype=torch.float32)
    with torch.no_grad():
        y_q = _module(fmt, _lora())(x, ids, w)
        y_ref = _module(DenseExperts(gate_up, down), _lora())(x, ids, w)
    assert rel_fro(y_q, y_ref) < 2 * case.weight_err[1]


@case_params
@pytest.mark.parametrize(
    "policy,compute",
    [
        (ActivationPolicy.RETAIN, torch.float32),
        (ActivationPolicy.RECOMPUTE, torch.float32),
        (ActivationPolicy.RETAIN, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("workers", [1, 4])
def test_engine_equals_dense_engine_on_dequantized_weights(
    case, built, policy, compute, workers, four_threads
):
    """Forward and backward read the very same effective weights (``tile``), so the engine on a format equals
    a dense engine holding ``dequantize(compute)``: same GEMMs on the same numbers. Bound 1e-6 relative
    (max-abs) in fp32 and 1e-3 in bf16. The format's engine computes its experts one at a time or four at once
    on the expert pool (per-thread dequantization scratch); the dense one one at a time."""
    fmt, _, _ = built[case.id]
    dense = DenseExperts(*fmt.dequantize(compute))
    x, ids, w = make_routing(T=24, E=E, k=2, H=H, dtype=torch.float32)
    gy = torch.randn(24, H)
    lora = _lora()
    opts = {"policy": policy, "compute_dtype": compute}
    module = _module(fmt, lora, **opts, expert_workers=workers)
    path = module.engine.gemm.path
    # the torch path on dequantized tiles (and the dense engine's on its stored weights); int8's scaled codes and
    # the fused kernels compute the same weights in another order: against float64 in test_gemm_paths.py, and test_fused_kernels.py
    conversion = Conversion.DEQUANTIZED if path.conversion is Conversion.SCALED_CODES else path.conversion
    module.engine.gemm.path = replace(path, conversion=conversion, fused_rows=0)
    y_q, g_q = run_module(module, x, ids, w, gy)
    reference = _module(dense, lora, **opts, expert_workers=1)
    # bf16: oneDNN's GEMMs, not the kernels' bf16_gemm
    reference.engine.gemm.path = replace(reference.engine.gemm.path, fused_rows=0)
    y_d, g_d = run_module(reference, x, ids, w, gy)
    # fp32: 1e-5 relative (summation order differs: quantized tiles arrive in row blocks, dense ones whole;
    # a different effective weight would show as ~1e-2, the quantization error)
    bound = 1e-5 if compute == torch.float32 else 1e-3
    assert set(g_q) == {"x", "w"} | {f"lora_{n}" for n in LORA_NAMES} == set(g_d)
    for name, got, ref in [("y", y_q, y_d)] + [(n, g_q[n], g_d[n]) for n in g_d]:
        assert got is not None and ref is not None, name
        err = float((got.double() - ref.double()).abs().max() / ref.double().abs().max())
        assert err <= bound, (name, err)
        if name.startswith("lora_"):
            assert got.dtype == torch.float32 and got.abs().max() > 0, name


@case_params
def test_full_mode_needs_a_dense_format(case, built):
    fmt, _, _ = built[case.id]
    if case.format == "dense":
        assert ExpertEngine(fmt, train_base=True).mode.value == "full"
        return
    with pytest.raises(EngineError, match=rf"full mode .* dense format; got '{case.format}'.*LoRA"):
        ExpertEngine(fmt, train_base=True)


@case_params
@pytest.mark.parametrize(
    "gate_up,down,match",
    [
        (torch.zeros(2, 8, 64), torch.zeros(2, 64), "3-D"),
        (torch.zeros(2, 8, 64), torch.zeros(2, 64, 5), r"down must be \[E, H, I\] = \(2, 64, 4\)"),
        (torch.zeros(2, 7, 64), torch.zeros(2, 64, 3), r"second dimension must be even; got 7"),
        (torch.zeros(2, 8, 64, dtype=torch.int32), torch.zeros(2, 64, 4, dtype=torch.int32), "float dtype"),
    ],
)
def test_from_dense_rejects_bad_input(case, gate_up, down, match):
    with pytest.raises(EngineError, match=match):
        FORMATS.get(case.format).from_dense(gate_up, down, **case.options)
