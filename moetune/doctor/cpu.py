"""The CPU the expert GEMMs run on: its ISA, and bf16 and fp32 GEMM speed measured, with oneDNN's kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from moetune.doctor.base import Check, Status
from moetune.sysinfo import CpuInfo


def check_cpu(info: CpuInfo, machine: str, torch_capability: str, bf16_compute: torch.dtype) -> Check:
    """The ISA the expert GEMMs get; ``bf16_compute`` is what ``resolve_compute_dtype`` picks for bf16 experts."""
    isa = ", ".join(info.isa) or "none of the tracked x86 extensions"
    details = (
        f"torch CPU kernels: {torch_capability}",
        f"bf16 expert weights compute in {str(bf16_compute).removeprefix('torch.')}"
        + (
            " (native bf16 dot products)"
            if bf16_compute == torch.bfloat16
            else " tiles (no AMX-BF16 or AVX512-BF16: emulated bf16 GEMMs are slower than fp32 here)"
        ),
    )
    summary = f"{info.model} ({machine}); ISA: {isa}"
    # the tracked flags are x86 ones: on other architectures their absence says nothing
    if machine in ("x86_64", "AMD64", "i686") and "AVX2" not in info.isa:
        return Check(
            "cpu",
            Status.WARN,
            summary + "; no AVX2, so expert GEMMs run without vector kernels",
            details,
            fix="use a CPU with AVX2 at least (AMX-BF16 or AVX512-BF16 for fast bf16)",
        )
    return Check("cpu", Status.OK, summary, details)


def gemm_tflops(
    dtype: torch.dtype,
    m: int = 512,
    k: int = 2048,
    n: int = 768,
    reps: int = 5,
    budget_s: float = 1.0,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul,
) -> float:
    """Best-of-``reps`` TFLOP/s of one ``[m, k] x [k, n]`` GEMM in ``dtype`` (an expert projection's shape),
    after a warm-up call (the first picks and JITs the kernel). Stops once the calls have taken ``budget_s``: a
    GEMM without native kernels takes seconds a call (bf16 on an AVX2-only CPU: ~2 s, 0.001 TFLOP/s), and then
    the warm-up call alone is the measurement."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    best, spent = float("inf"), 0.0
    for call in range(reps + 1):
        start = time.perf_counter()
        matmul(a, b)
        took = time.perf_counter() - start
        spent += took
        if call > 0 or spent >= budget_s:
            best = min(best, took)
        if spent >= budget_s:
            break
    return 2 * m * k * n / best / 1e12


_ONEDNN_PROBE = "import torch; a = torch.randn(256, 2048).bfloat16(); [a @ a.T for _ in range(2)]"


def onednn_bf16_kernel() -> str | None:
    """The oneDNN matmul implementation a bf16 GEMM dispatches to (e.g. ``brg_matmul:avx512_core_amx``), or
    None when torch does not send bf16 GEMMs to oneDNN at all (no AMX/AVX512-BF16 path on this CPU).

    Read from ``ONEDNN_VERBOSE`` in a child process: verbose output goes to the C stdout, not Python's.
    """
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    out = subprocess.run(
        [sys.executable, "-c", _ONEDNN_PROBE], env=env, capture_output=True, text=True, timeout=120
    ).stdout
    return parse_onednn_matmul(out)


def parse_onednn_matmul(verbose: str) -> str | None:
    """The implementation field of the first executed matmul in ``ONEDNN_VERBOSE`` output, or None."""
    for line in verbose.splitlines():
        fields = line.split(",")
        if "exec" in fields and "matmul" in fields:
            return fields[fields.index("matmul") + 1]
    return None


def torch_build() -> str:
    """torch's version, accelerator build and CPU libraries, from ``torch.__config__.show()``."""
    accel = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
    libs = [
        line.strip(" -").split(" (")[0].split(" Build")[0]
        for line in torch.__config__.show().splitlines()
        if "Math Kernel Library" in line or "MKL-DNN" in line
    ]
    return ", ".join([f"torch {torch.__version__}", accel, *libs])


def check_gemm(bf16: float, fp32: float, kernel: str | None) -> Check:
    """Whether bf16 GEMMs really run on AMX (or AVX512-BF16) here, measured, not inferred from flags."""
    on_amx = kernel is not None and "amx" in kernel
    where = (
        f"oneDNN kernel {kernel}" if kernel else "not dispatched to oneDNN (no AMX/AVX512-BF16 kernel here)"
    )
    summary = (
        f"bf16 GEMM {bf16:.3f} TFLOP/s, fp32 {fp32:.3f} TFLOP/s ([512, 2048] x [2048, 768]); "
        f"bf16 {'runs on AMX' if on_amx else 'does not run on AMX'}"
    )
    details = (f"bf16 matmul: {where}", f"torch build: {torch_build()}")
    if bf16 < fp32:
        return Check(
            "gemm",
            Status.WARN,
            summary,
            details + ("the engine computes bf16 experts in fp32 tiles here",),
            fix="for fast bf16 training use a CPU with AMX-BF16 (Xeon 4th gen+) or AVX512-BF16",
        )
    return Check("gemm", Status.OK, summary, details)
