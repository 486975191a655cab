"""The engine self-test: a tiny expert layer forward and backward against a float64 reference."""

from __future__ import annotations

import torch

from moetune.doctor.base import REPORT, Check, Status
from moetune.doctor.gpu import GpuFacts
from moetune.testing.selftest import SELFTEST_TOLERANCE, SelftestResult, engine_selftest_case


def check_engine(results: list[SelftestResult]) -> Check:
    """Judge engine self-test cases (``moetune.testing.selftest``) against ``SELFTEST_TOLERANCE``."""
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
            tuple(details),
            fix=f"the expert engine computes wrong numbers on this machine: {REPORT}",
        )
    return Check("engine", Status.OK, "forward and every gradient match a float64 reference", tuple(details))


def run_engine_check(devices: list[GpuFacts]) -> Check:
    """Run the self-test on the CPU in fp32 and bf16 (and from ``cuda`` when ``devices`` has a GPU), then judge it."""
    cases = [(torch.float32, "cpu"), (torch.bfloat16, "cpu")]
    if devices:  # activations arrive from the GPU in training: check that path too
        cases.append((torch.bfloat16, "cuda"))
    return check_engine([engine_selftest_case(dtype, device) for dtype, device in cases])
