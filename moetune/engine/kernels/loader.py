"""Build the best kernel variant this CPU runs, once per source and torch version, lazily, and say why when none can
be used.

Variants (``VARIANTS``, best first) share the weight decoders (``decoders.h``) and the Python entry points
(``entry.h``) and differ in their GEMM loops: ``amx_gemm.cpp`` (AMX-BF16 tiles), ``avx512_gemm.cpp``
(AVX512-BF16 dot products), both computing in bf16, and ``avx2_gemm.cpp`` (AVX2 + FMA, 8 fp32 lanes), computing in
fp32 (``KernelVariant.compute``: the compute dtype a variant takes). The first variant whose ISA flag ``cpu_info()`` reports and that builds and loads is
used (the ones that failed before it are logged at INFO). ``load_variant`` builds one variant by name (tests,
benchmarks, and engines whose ``GemmPath`` names a variant other than the default one).

The build is torch's ``cpp_extension.load`` (g++ and ninja; ``pip install moetune`` brings ninja) into
``TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``) under a name keyed by a hash of the variant's
source, every header it includes and the torch version: a changed source or torch never loads a stale build,
and torch's builder holds a file lock, so concurrent processes build it once (a build finding the lock taken says
so, naming the file: torch's builder waits for it silently, for ever where a killed build left it). First use takes
~30-60 s; later processes load the cached .so.

``MOETUNE_KERNELS=off`` (read here only, whenever an engine resolves its GEMM path) turns the kernels off for
A/B runs; engines built then take the torch path; a value other than on/off/1/0 is a ConfigError. Any other
failure (no compiler, a build error, a CPU with none of the variants' ISAs) is logged once, naming the cause and
that the torch path is used, and ``load_fused`` returns None.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from moetune.sysinfo import cpu_info

log = logging.getLogger(__name__)

KERNELS_ENV = "MOETUNE_KERNELS"
HERE = Path(__file__).parent
# -fopenmp: ATen's at::parallel_for is inline OpenMP; without the flag it runs on one thread in the extension.
# The inlining limits: GCC caps how much inlining may grow a translation unit or a function, so that code added
# for one format stopped inlining another's loops (mxfp4's backward at 8 rows 0.87x after fp8's table was added,
# level with these; docs/performance.md, "fp8_block by table, the forward's sums at once, wider backward bands,
# staged bands").
CFLAGS = [
    "-O3",
    "-std=c++17",
    "-fopenmp",
    "--param=inline-unit-growth=1000",
    "--param=large-function-growth=1000",
]


@dataclass(frozen=True)
class KernelVariant:
    """One build of the fused kernels: its name (the module's ``variant``), its source in this folder, the
    ``cpu_info().isa`` flag the CPU needs for it to run, the dtype its operands and sums are in (the engine's
    compute dtype it serves), the compile flags its source needs (beyond ``CFLAGS``), and the formats
    (``ExpertFormat.name``) whose products it computes with the activations as 16-bit integer rows against the
    codes (``int16_rows.h``, ``avx2_int16.h``) instead of dequantized weights, and those it also offers with 8-bit
    integer rows (``int8_rows.h``, ``avx2_int8.h``: the kernel ``<name>_a8``, the formats' opt-in
    ``int8_activations``)."""

    name: str
    source: str
    isa: str
    compute: torch.dtype = torch.bfloat16
    flags: tuple[str, ...] = ()
    int16_rows: tuple[str, ...] = ()
    int8_rows: tuple[str, ...] = ()

    def sources(self) -> list[Path]:
        """The variant's source and every header it includes from this folder (transitively), in include order."""
        found: list[Path] = []
        todo = [HERE / self.source]
        while todo:
            path = todo.pop(0)
            if path not in found:
                found.append(path)
                todo += [HERE / name for name in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M)]
        return found


# best first: AMX tiles do 16x more bf16 products per instruction than AVX512 dot products
VARIANTS: tuple[KernelVariant, ...] = (
    KernelVariant("AMX-BF16", "amx_gemm.cpp", "AMX-BF16"),
    KernelVariant(
        "AVX512-BF16", "avx512_gemm.cpp", "AVX512-BF16", int16_rows=("int8",), int8_rows=("int8", "int4")
    ),
    # fp32 compute (CPUs without AVX512-BF16 compute in fp32: ``resolve_compute_dtype``)
    KernelVariant(
        "AVX2",
        "avx2_gemm.cpp",
        "AVX2",
        torch.float32,
        ("-mavx2", "-mfma", "-mf16c"),
        int16_rows=("int8",),
        int8_rows=("int4",),
    ),
)


def int8_rows_formats() -> tuple[str, ...]:
    """The formats (``ExpertFormat.name``) some variant computes with 8-bit integer activation rows
    (``KernelVariant.int8_rows``), in registry order: what ``int8_activations`` applies to."""
    return tuple(dict.fromkeys(name for v in VARIANTS for name in v.int8_rows))


def a8_kernel(name: str) -> str:
    """A kernel's name (``entry.h``: ``<kernel>`` or its run form ``<kernel>_run``) -> its form with 8-bit integer
    activation rows (``<kernel>_a8`` / ``<kernel>_a8_run``)."""
    run = name.endswith("_run")
    return f"{name.removesuffix('_run')}_a8" + ("_run" if run else "")


_lock = threading.Lock()
_state: dict[str, tuple[ModuleType | None, str]] = {}


def variant_named(name: str) -> KernelVariant | None:
    """The registered variant called ``name``, or None."""
    return next((v for v in VARIANTS if v.name == name), None)


def _built(variant: KernelVariant) -> tuple[ModuleType | None, str]:
    """``_build_variant(variant)``, once per process and variant (the caller holds ``_lock``): the default
    path and ``load_variant`` share the build."""
    if variant.name not in _state:
        _state[variant.name] = _build_variant(variant)
    return _state[variant.name]


def kernels_disabled() -> str:
    """Why ``MOETUNE_KERNELS`` turns the kernels off, or "" (unset, "on", "1"); other values are refused."""
    value = os.environ.get(KERNELS_ENV, "on").strip().lower()
    if value in ("on", "1", ""):
        return ""
    if value in ("off", "0"):
        return f"{KERNELS_ENV}={value}"
    from moetune.errors import ConfigError

    raise ConfigError(f"{KERNELS_ENV} must be 'on' or 'off' (or 1 / 0); got {value!r}")


def build_key(text: bytes, cflags: list[str], folder: Path) -> str:
    """What a kernel build is cached by: its sources' text, torch's version, the compile flags (flags change the
    code as much as sources do), where torch is installed and the folder the sources are compiled from. torch's
    builder writes that torch's include folders and the sources' paths into the build's commands, so two
    environments, or two checkouts of moetune (a clone and a worktree), sharing one build folder (the default
    cache, one per user) rebuilt it in turn whenever the other had run (30-60 s each time)."""
    where = str(Path(torch.__file__).resolve().parent) + "\0" + str(folder.resolve())
    key = text + torch.__version__.encode() + " ".join(cflags).encode() + where.encode()
    return hashlib.sha256(key).hexdigest()[:16]


def _build_variant(variant: KernelVariant) -> tuple[ModuleType | None, str]:
    """(module, "") or (None, why not)."""
    paths = variant.sources()
    cflags = CFLAGS + list(variant.flags)
    name = f"moetune_fused_{build_key(b''.join(p.read_bytes() for p in paths), cflags, HERE)}"
    try:
        from torch.utils import cpp_extension

        folder = _build_folder(cpp_extension, name)
        cached = folder is None or (folder / f"{name}.so").exists()
        if not cached:  # progress, as a bar would show it: why the first engine takes a while
            where = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
            print(
                f"moetune: compiling the {variant.name} kernels for this CPU and torch (once; about 30-60 s, then "
                f"cached under {where})",
                file=sys.stderr,
                flush=True,
            )
        # torch's builder takes the lock on every load, a cached one too (its up-to-date check), and waits for it
        # without a word, for ever if nothing releases it: a cached load's lock is reported once it is stale
        held = _held_lock(folder, _STALE_LOAD_LOCK_S if cached else 0.0) if folder is not None else ""
        if held:
            print(held, file=sys.stderr, flush=True)
        module = cpp_extension.load(
            name=name,
            sources=[str(paths[0])],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # noqa: BLE001 - any build failure means: try the next variant or the torch path
        first = str(err).strip().splitlines()
        return None, f"building {variant.source} failed ({type(err).__name__}: {first[-1] if first else ''})"
    assert module.variant == variant.name, (module.variant, variant)
    why = module.unavailable()
    return (None, f"{variant.name}: {why}") if why else (module, "")


def _build_folder(cpp_extension: ModuleType, name: str) -> Path | None:
    """The folder torch's builder builds ``name`` in, or None where its private helper is gone (then only the
    notices are lost)."""
    try:
        return Path(cpp_extension._get_build_directory(name, False))  # torch's own rule for the folder
    except Exception:  # noqa: BLE001 - a private helper: when it changes, only the notices are lost
        return None


# A cached build's load holds torch's lock for its up-to-date check (well under a second); a lock this old beside a
# built library was left by a killed process
_STALE_LOAD_LOCK_S = 60.0


def _held_lock(folder: Path, older_than_s: float) -> str:
    """What to tell the user where torch's build lock in ``folder`` is held and at least ``older_than_s`` old
    (another process building, or a process killed while it held it: torch's builder then waits for ever,
    silently), else ""."""
    lock = folder / "lock"
    try:
        taken = lock.stat().st_mtime
    except OSError:
        return ""
    if time.time() - taken < older_than_s:
        return ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(taken))
    return (
        f"moetune: waiting for the build lock {lock} (taken {since}): another process is building the same "
        f"kernels; if none is (a build interrupted while it held the lock), delete that file"
    )


def _build() -> tuple[ModuleType | None, str]:
    """(the best variant's module that builds and runs here, "") or (None, why none does)."""
    isa = cpu_info().isa
    fits = [v for v in VARIANTS if v.isa in isa] if os.name == "posix" else []
    if not fits:  # no build where it could not run
        wanted = ", ".join(v.isa for v in VARIANTS)
        return None, f"the CPU has none of {wanted} (found: {', '.join(isa) or 'no SIMD flags'})"
    reasons: list[str] = []
    for variant in fits:
        module, why = _built(variant)
        if module is not None:
            if reasons:  # a better variant the CPU has did not build or run: slower kernels, so said loudly
                log.warning("moetune fused kernels: %s used (%s)", variant.name, "; ".join(reasons))
            return module, ""
        reasons.append(why)
    return None, "; ".join(reasons)


def _resolve() -> tuple[ModuleType | None, str]:
    with _lock:
        if "fused" not in _state:
            module, why = _build()
            if module is None:
                log.warning("moetune fused kernels not used (%s); the engine uses the torch path", why)
            _state["fused"] = (module, why)
        return _state["fused"]


def load_variant(name: str) -> ModuleType:
    """The built module of the variant named ``name`` (``VARIANTS``), built once per process; raises
    ``EngineError`` naming the variants when there is none of that name, or why it does not build or run here."""
    from moetune.errors import EngineError

    variant = variant_named(name)
    if variant is None:
        raise EngineError(
            f"no kernel variant {name!r}; the variants are {', '.join(v.name for v in VARIANTS)}"
        )
    with _lock:
        module, why = _built(variant)
    if module is None:
        raise EngineError(f"the fused kernel variant {name} does not run here: {why}")
    return module


def load_fused() -> ModuleType | None:
    """The built module of the best variant that runs here (its ``variant`` names it), or None (the reason
    logged once, see ``fused_unavailable``); whatever ``MOETUNE_KERNELS`` says (engines ask ``fused_kernels``,
    which honours it)."""
    return _resolve()[0]


def fused_unavailable() -> str:
    """Why the fused kernels are not used now (``MOETUNE_KERNELS=off``, or why they did not build or load), or
    "" when they are (builds them if needed)."""
    return kernels_disabled() or _resolve()[1]


def check_kernels_env() -> None:
    """Raise the ``ConfigError`` for a ``MOETUNE_KERNELS`` value other than on/off/1/0 now (the preflight calls
    it before the model loads; engines would otherwise meet it at their first GEMM path, mid-load)."""
    kernels_disabled()


def fused_variant() -> str:
    """The name of the variant ``load_fused()`` returns (``KernelVariant.name``), or "" when none loads."""
    module = load_fused()
    return "" if module is None else str(module.variant)


def fused_kernels() -> ModuleType | None:
    """``load_fused()`` unless ``MOETUNE_KERNELS`` turns the kernels off now (checked per call; no build)."""
    return None if kernels_disabled() else load_fused()
