"""The engine self-test: a tiny expert layer forward and backward against a float64 reference, and the GEMM
path every weight format takes on this machine."""

from __future__ import annotations

import torch

from moetune.doctor.base import REPORT, Check, Status
from moetune.doctor.gpu import GpuFacts
from moetune.engine import resolve_compute_dtype
from moetune.engine.formats import FORMATS
from moetune.engine.gemm import resolve_gemm_path
from moetune.engine.kernels import fused_unavailable, fused_variant
from moetune.engine.kernels.loader import int8_rows_formats
from moetune.errors import EngineError
from moetune.testing.selftest import SELFTEST_TOLERANCE, SelftestResult, engine_selftest_case

KERNELS_LINE = "fused kernels"


def gemm_paths() -> list[str]:
    """One line per registered weight format (dense as bf16): the dtype its GEMMs compute in on this machine
    and how its weights reach them (``moetune.engine.gemm.GemmPath``), and for the formats with the opt-in
    ``int8_activations`` a line with it (the path, or why this machine refuses it); then whether the compiled fused
    kernels (``moetune.engine.kernels``) are used, or why not."""
    gen = torch.Generator().manual_seed(0)
    # a tiny layer: H and I multiples of every format's block (int4 groups, mxfp4's 32, fp8's 128)
    gate_up, down = torch.randn(1, 256, 128, generator=gen), torch.randn(1, 128, 128, generator=gen)
    lines = []
    for name in FORMATS.names():
        source = torch.bfloat16 if name == "dense" else torch.float32
        fmt = FORMATS.get(name).from_dense(gate_up.to(source), down.to(source))
        label = "bf16 (dense)" if name == "dense" else name
        compute = resolve_compute_dtype(fmt.storage_dtype)
        path = resolve_gemm_path(fmt, compute)
        lines.append(f"{label}: computes in {str(compute).removeprefix('torch.')}; {path.describe()}")
        if name in int8_rows_formats():
            try:
                lines.append(
                    f"{label} with int8_activations: {resolve_gemm_path(fmt, compute, int8_rows=True).describe()}"
                )
            except EngineError as err:
                lines.append(f"{label} with int8_activations: refused here ({err})")
    why = fused_unavailable()
    lines.append(
        f"{KERNELS_LINE}: "
        + (
            f"not used ({why}); the torch path runs, each expert's op sequences in Python"
            if why
            else f"{fused_variant()} variant built and used, with each expert's op sequences (kernels/ops.h)"
        )
    )
    return lines


def check_engine(results: list[SelftestResult], paths: list[str] | None = None) -> Check:
    """Judge engine self-test cases (``moetune.testing.selftest``) against ``SELFTEST_TOLERANCE``; ``paths``
    (``gemm_paths``) are listed with the facts."""
    details, bad = [], []
    for res in results:
        name, err = res.worst
        tol = SELFTEST_TOLERANCE[res.storage]
        label = f"{str(res.storage).removeprefix('torch.')} on {res.device}"
        details.append(
            f"{label} (computed in {str(res.compute).removeprefix('torch.')}): "
            f"worst {name} {err:.1e}, tolerance {tol:.0e}"
        )
        bad += [
            f"{label}: {n} off by {e:.1e} (tolerance {tol:.0e})"
            for n, e in res.errors.items()
            if not e <= tol
        ]
    if bad:
        return Check(
            "engine",
            Status.FAIL,
            "; ".join(bad),
            tuple(details + (paths or [])),
            fix=f"the expert engine computes wrong numbers on this machine: {REPORT}",
        )
    return Check(
        "engine",
        Status.OK,
        "forward and every gradient match a float64 reference",
        tuple(details + (paths or [])),
    )


def run_engine_check(devices: list[GpuFacts]) -> Check:
    """Run the self-test on the CPU in fp32 and bf16 (and from ``cuda`` when ``devices`` has a GPU), then judge
    it, listing each format's GEMM path."""
    cases = [(torch.float32, "cpu"), (torch.bfloat16, "cpu")]
    if devices:  # activations arrive from the GPU in training: check that path too
        cases.append((torch.bfloat16, "cuda"))
    return check_engine([engine_selftest_case(dtype, device) for dtype, device in cases], gemm_paths())
