"""Every check in report order, each guarded so that one broken probe cannot hide the others."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from importlib import metadata

import torch

import moetune
from moetune.doctor.base import REPORT, Check, Status
from moetune.doctor.cpu import check_cpu, check_gemm, gemm_tflops, onednn_bf16_kernel
from moetune.doctor.engine import run_engine_check
from moetune.doctor.gpu import GpuFacts, check_gpu, gpu_facts
from moetune.doctor.memory import check_memory
from moetune.doctor.packages import check_install, check_packages, check_python
from moetune.doctor.threads import check_threads
from moetune.engine import resolve_compute_dtype
from moetune.sysinfo import (
    cgroup_cpu_quota,
    cpu_info,
    default_num_threads,
    thp_mode,
    torch_advises_huge_pages,
)


def guarded(name: str, check: Callable[[], Check]) -> Check:
    """``check()``, or a FAIL verdict named ``name`` saying what it raised."""
    # a diagnostic must report every check even when one probe breaks (a half-installed CUDA driver
    # raising in get_device_properties, an unreadable /proc): the failure becomes that check's verdict
    try:
        return check()
    except Exception as err:
        return Check(name, Status.FAIL, f"the check raised {type(err).__name__}: {err}", fix=REPORT)


def run_checks(*, selftest: bool = True) -> list[Check]:
    """Every check, in report order; ``selftest=False`` skips the engine self-test."""
    try:
        dist: metadata.Distribution | None = metadata.distribution("moetune")
    except metadata.PackageNotFoundError:
        dist = None
    requires_python = dist.metadata["Requires-Python"] if dist else None
    requirements = (dist.requires or []) if dist else None
    checks = [
        guarded(
            "install",
            lambda: check_install(
                getattr(moetune, "__version__", None),
                ", ".join(p for p in moetune.__path__ if os.path.isdir(p)),
                dist.version if dist else None,
            ),
        ),
        guarded("python", lambda: check_python(requires_python)),
        guarded("packages", lambda: check_packages(requirements)),
        guarded(
            "cpu",
            lambda: check_cpu(
                cpu_info(),
                platform.machine(),
                torch.backends.cpu.get_cpu_capability(),
                resolve_compute_dtype(torch.bfloat16),
            ),
        ),
        guarded(
            "threads",
            lambda: check_threads(cpu_info(), default_num_threads(), os.cpu_count() or 1, cgroup_cpu_quota()),
        ),
        guarded("memory", lambda: check_memory(thp_mode(), torch_advises_huge_pages())),
        guarded(
            "gemm",
            lambda: check_gemm(gemm_tflops(torch.bfloat16), gemm_tflops(torch.float32), onednn_bf16_kernel()),
        ),
    ]
    devices: list[GpuFacts] = []  # filled by the gpu check; the self-test adds a case per GPU found

    def gpu() -> Check:
        devices.extend(gpu_facts())
        return check_gpu(
            torch.__version__, torch.version.cuda or getattr(torch.version, "hip", None), devices
        )

    checks.append(guarded("gpu", gpu))
    if selftest:
        checks.append(guarded("engine", lambda: run_engine_check(devices)))
    return checks
