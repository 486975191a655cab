"""Checks behind ``moetune doctor``: can this machine run moetune, and how well?

Each check gathers facts (interpreter, installed packages, CPU, threads, memory, GPUs) and judges them into
a :class:`Check` with a status, the facts found and, unless all is well, how to fix it. The judging
functions take their facts as arguments so every verdict can be tested on any machine. The engine
self-test (``moetune.testing.selftest``) runs one tiny expert layer forward and backward through the op
training uses and compares the output and every gradient with a float64 per-expert loop.
Nothing here downloads or writes anything.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from importlib import metadata

import psutil
import torch
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

import moetune
from moetune.engine import resolve_compute_dtype
from moetune.sysinfo import CpuInfo, cgroup_cpu_quota, cpu_info, default_num_threads
from moetune.testing.selftest import SELFTEST_TOLERANCE, SelftestResult, engine_selftest_case

GIB = 1024**3
REPORT = "report it with the output of `moetune doctor --json`"


class Status(str, Enum):
    """A check's verdict."""

    OK = "ok"
    WARN = "warn"  # moetune runs, but slower or with less than this machine could give
    FAIL = "fail"  # moetune will not run, or will compute wrong numbers, until this is fixed


@dataclass(frozen=True)
class Check:
    """One check's verdict: a one-line summary, further facts, and (unless ok) how to fix it."""

    name: str
    status: Status
    summary: str
    details: tuple[str, ...] = ()
    fix: str = ""


# ---- interpreter and packages


def check_python(requires: str | None, version: str | None = None) -> Check:
    """The running interpreter against moetune's ``Requires-Python`` (None: not installed, not judged)."""
    version = version or platform.python_version()
    summary, details = f"{platform.python_implementation()} {version}", (f"interpreter: {sys.executable}",)
    if requires and not SpecifierSet(requires).contains(version, prereleases=True):
        return Check(
            "python",
            Status.FAIL,
            f"{summary} does not satisfy {requires}",
            details,
            fix=f"run moetune with a Python {requires}",
        )
    return Check("python", Status.OK, summary + (f", needs {requires}" if requires else ""), details)


def check_install(imported_version: str | None, location: str, dist_version: str | None) -> Check:
    """The imported moetune package against the installed distribution's metadata.

    ``imported_version`` is ``moetune.__version__`` (None when ``moetune/__init__.py`` did not run);
    ``location`` where the package was imported from; ``dist_version`` the metadata's (None: not installed).
    """
    if dist_version is None:
        return Check(
            "install",
            Status.WARN,
            f"moetune is imported from {location} but not installed as a package",
            fix="install it with `pip install -e .` from the repository root",
        )
    if imported_version is None:
        # a setuptools editable install made before moetune/__init__.py existed maps moetune as a namespace
        # package: the package imports, but its __init__ (public API, version) never runs
        return Check(
            "install",
            Status.FAIL,
            f"moetune from {location} imports as a namespace package: its __init__.py did not run",
            fix="reinstall it: `pip install -e .` from the repository root",
        )
    if imported_version != dist_version:
        return Check(
            "install",
            Status.FAIL,
            f"moetune {imported_version} is imported from {location}, but the "
            f"installed metadata is for {dist_version}",
            fix="reinstall it: `pip install -e .` from the repository root",
        )
    return Check("install", Status.OK, f"moetune {imported_version} from {location}")


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None when it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check_packages(
    requirements: list[str] | None, version_of: Callable[[str], str | None] = installed_version
) -> Check:
    """moetune's declared runtime requirements against what is installed (optional extras are skipped).

    ``requirements`` are PEP 508 strings as ``importlib.metadata.requires("moetune")`` gives them; None
    means moetune is not installed as a distribution, so they cannot be read.
    """
    if requirements is None:
        return Check(
            "packages",
            Status.WARN,
            "moetune's requirements cannot be read: it is not installed as a package (see install)",
        )
    found, problems, wanted = [], [], []
    for line in requirements:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue  # an extra (dev tools) or another platform's dependency: not needed to run here
        have = version_of(req.name)
        spec = str(req.specifier) or "any version"
        if have is None:
            problems.append(f"{req.name} is missing (needs {spec})")
        elif not req.specifier.contains(have, prereleases=True):
            problems.append(f"{req.name} {have} is installed; moetune needs {spec}")
        else:
            found.append(f"{req.name} {have}")
            continue
        wanted.append(f'"{req.name}{req.specifier}"')
    if problems:
        return Check(
            "packages", Status.FAIL, "; ".join(problems), tuple(found), fix=f"pip install {' '.join(wanted)}"
        )
    return Check("packages", Status.OK, ", ".join(found))


# ---- CPU, threads, memory


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


def gemm_tflops(dtype: torch.dtype, m: int = 512, k: int = 2048, n: int = 768, reps: int = 5) -> float:
    """Best-of-``reps`` TFLOP/s of one ``[m, k] x [k, n]`` GEMM in ``dtype`` (an expert projection's shape)."""
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b  # warm-up: first call picks and JITs the kernel
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
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


def check_threads(info: CpuInfo, engine_threads: int, total_cpus: int, cpu_quota: float | None) -> Check:
    """The threads the engine will start against the CPUs the process may actually run on."""
    summary = (
        f"engine starts {engine_threads} threads; {info.logical_cpus} of {total_cpus} CPUs visible, "
        f"{info.physical_cores} physical cores, {info.numa_nodes} NUMA node(s)"
    )
    details = (f"cgroup CPU quota: {'none' if cpu_quota is None else f'{cpu_quota:g} CPUs'}",)
    if cpu_quota is not None and cpu_quota < engine_threads:
        # more busy threads than the quota lets run: they get throttled in turns and every GEMM stalls
        cpus = max(1, math.floor(cpu_quota))
        return Check(
            "threads",
            Status.WARN,
            summary + f", but the CPU quota allows only {cpu_quota:g}",
            details,
            fix=f"raise the container's CPU limit, or run the engine on {cpus} thread(s) "
            f"(`num_threads={cpus}` in load_model, `moetune: {{num_threads: {cpus}}}` in a training config)",
        )
    return Check("threads", Status.OK, summary, details)


def check_memory() -> Check:
    """Host RAM, reported: expert weights, their LoRA and optimizer state live here (no model, no verdict)."""
    ram, swap = psutil.virtual_memory(), psutil.swap_memory()
    return Check(
        "memory",
        Status.OK,
        f"{ram.total / GIB:.1f} GiB RAM, {ram.available / GIB:.1f} GiB available; {swap.total / GIB:.1f} GiB swap",
    )


# ---- GPUs


@dataclass(frozen=True)
class GpuFacts:
    """One visible GPU as torch reports it."""

    index: int
    name: str
    total_bytes: int
    capability: tuple[int, int]


def gpu_facts() -> list[GpuFacts]:
    """The GPUs torch can use (initialises CUDA: call only from the doctor command)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(GpuFacts(i, p.name, p.total_memory, (p.major, p.minor)))
    return out


def check_gpu(torch_version: str, accel_build: str | None, devices: list[GpuFacts]) -> Check:
    """Whether the non-expert layers have a GPU to run on. ``accel_build``: torch's CUDA or ROCm version."""
    if accel_build is None:
        return Check(
            "gpu",
            Status.WARN,
            f"this torch build ({torch_version}) has no CUDA support",
            fix="install a CUDA build of torch: moetune runs everything but the routed experts on a GPU",
        )
    if not devices:
        return Check(
            "gpu",
            Status.WARN,
            f"torch {torch_version} is built for CUDA/ROCm {accel_build} but sees no GPU",
            fix="check `nvidia-smi`, the driver, and CUDA_VISIBLE_DEVICES",
        )
    details = tuple(
        f"cuda:{d.index} {d.name}, {d.total_bytes / GIB:.1f} GiB, compute capability {d.capability[0]}.{d.capability[1]}"
        for d in devices
    )
    old = [f"cuda:{d.index}" for d in devices if d.capability < (8, 0)]
    summary = f"{len(devices)} GPU(s), CUDA/ROCm {accel_build}"
    if old:
        return Check(
            "gpu",
            Status.WARN,
            summary + f"; {', '.join(old)} lack bf16 tensor cores",
            details,
            fix="bf16 training needs compute capability 8.0 or newer (Ampere and later)",
        )
    return Check("gpu", Status.OK, summary, details)


# ---- engine self-test


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


# ---- all checks


def _guarded(name: str, check: Callable[[], Check]) -> Check:
    # a diagnostic must report every check even when one probe breaks (a half-installed CUDA driver
    # raising in get_device_properties, an unreadable /proc): the failure becomes that check's verdict
    try:
        return check()
    except Exception as err:
        return Check(name, Status.FAIL, f"the check raised {type(err).__name__}: {err}", fix=REPORT)


def _engine_check(devices: list[GpuFacts]) -> Check:
    cases = [(torch.float32, "cpu"), (torch.bfloat16, "cpu")]
    if devices:  # activations arrive from the GPU in training: check that path too
        cases.append((torch.bfloat16, "cuda"))
    return check_engine([engine_selftest_case(dtype, device) for dtype, device in cases])


def run_checks(*, selftest: bool = True) -> list[Check]:
    """Every check, in report order; ``selftest=False`` skips the engine self-test."""
    try:
        dist: metadata.Distribution | None = metadata.distribution("moetune")
    except metadata.PackageNotFoundError:
        dist = None
    requires_python = dist.metadata["Requires-Python"] if dist else None
    requirements = (dist.requires or []) if dist else None
    checks = [
        _guarded(
            "install",
            lambda: check_install(
                getattr(moetune, "__version__", None),
                ", ".join(p for p in moetune.__path__ if os.path.isdir(p)),
                dist.version if dist else None,
            ),
        ),
        _guarded("python", lambda: check_python(requires_python)),
        _guarded("packages", lambda: check_packages(requirements)),
        _guarded(
            "cpu",
            lambda: check_cpu(
                cpu_info(),
                platform.machine(),
                torch.backends.cpu.get_cpu_capability(),
                resolve_compute_dtype(torch.bfloat16),
            ),
        ),
        _guarded(
            "threads",
            lambda: check_threads(cpu_info(), default_num_threads(), os.cpu_count() or 1, cgroup_cpu_quota()),
        ),
        _guarded("memory", check_memory),
        _guarded(
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

    checks.append(_guarded("gpu", gpu))
    if selftest:
        checks.append(_guarded("engine", lambda: _engine_check(devices)))
    return checks
