"""Build ``fused_gemm.cpp`` once per source and torch version, lazily, and say why when it cannot be used.

The build is torch's ``cpp_extension.load`` (g++ and ninja; ``pip install moetune`` brings ninja) into
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) under a name keyed by a hash of the source
and the torch version: a changed source or torch never loads a stale build, and torch's builder holds a file
lock, so concurrent processes build it once. First use takes ~30-60 s; later processes load the cached .so.

``MOETUNE_KERNELS=off`` (read here only, whenever an engine resolves its GEMM path) turns the kernels off for
A/B runs; engines built then take the torch path; a value other than on/off/1/0 is a ConfigError. Any other failure (no compiler, a build error, a CPU without AMX-BF16) is logged once,
naming the cause and that the torch path is used, and ``load_fused`` returns None.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path
from types import ModuleType

import torch

from moetune.sysinfo import cpu_info

log = logging.getLogger(__name__)

KERNELS_ENV = "MOETUNE_KERNELS"
SOURCE = Path(__file__).with_name("fused_gemm.cpp")
# -fopenmp: ATen's at::parallel_for is inline OpenMP; without the flag it runs on one thread in the extension
CFLAGS = ["-O3", "-std=c++17", "-fopenmp"]

_lock = threading.Lock()
_state: dict[str, tuple[ModuleType | None, str]] = {}


def _disabled() -> str:
    """Why ``MOETUNE_KERNELS`` turns the kernels off, or "" (unset, "on", "1"); other values are refused."""
    value = os.environ.get(KERNELS_ENV, "on").strip().lower()
    if value in ("on", "1", ""):
        return ""
    if value in ("off", "0"):
        return f"{KERNELS_ENV}={value}"
    from moetune.errors import ConfigError

    raise ConfigError(f"{KERNELS_ENV} must be 'on' or 'off' (or 1 / 0); got {value!r}")


def _build() -> tuple[ModuleType | None, str]:
    """(module, "") or (None, why not)."""
    if os.name != "posix" or "AMX-BF16" not in cpu_info().isa:  # no build where it could not run
        return None, f"the CPU has no AMX-BF16 (found: {', '.join(cpu_info().isa) or 'no SIMD flags'})"
    text = SOURCE.read_bytes()
    key = hashlib.sha256(text + torch.__version__.encode() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    try:
        from torch.utils import cpp_extension

        module = cpp_extension.load(
            name=f"moetune_fused_{key}",
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # noqa: BLE001 - any build failure means: use the torch path, and say why
        first = str(err).strip().splitlines()
        return None, f"building {SOURCE.name} failed ({type(err).__name__}: {first[-1] if first else ''})"
    why = module.unavailable()
    return (None, why) if why else (module, "")


def _resolve() -> tuple[ModuleType | None, str]:
    with _lock:
        if "fused" not in _state:
            module, why = _build()
            if module is None:
                log.warning("moetune fused kernels not used (%s); the engine uses the torch path", why)
            _state["fused"] = (module, why)
        return _state["fused"]


def load_fused() -> ModuleType | None:
    """The built ``fused_gemm`` module, or None (the reason logged once, see ``fused_unavailable``); whatever
    ``MOETUNE_KERNELS`` says (engines ask ``fused_kernels``, which honours it)."""
    return _resolve()[0]


def fused_unavailable() -> str:
    """Why the fused kernels are not used now (``MOETUNE_KERNELS=off``, or why they did not build or load), or
    "" when they are (builds them if needed)."""
    return _disabled() or _resolve()[1]


def check_kernels_env() -> None:
    """Raise the ``ConfigError`` for a ``MOETUNE_KERNELS`` value other than on/off/1/0 now (the preflight calls
    it before the model loads; engines would otherwise meet it at their first GEMM path, mid-load)."""
    _disabled()


def fused_kernels() -> ModuleType | None:
    """``load_fused()`` unless ``MOETUNE_KERNELS`` turns the kernels off now (checked per call; no build)."""
    return None if _disabled() else load_fused()
