"""Facts about the host CPU that the engine and ``moetune doctor`` need.

Read from Linux's /proc and /sys where present; every function degrades to a safe answer elsewhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# ISA features moetune cares about, as /proc/cpuinfo spells them -> the name we print.
ISA_FLAGS: dict[str, str] = {
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
    "avx512_bf16": "AVX512-BF16",
    "avx512f": "AVX512F",
    "avx2": "AVX2",
}


@dataclass(frozen=True)
class CpuInfo:
    """What the process can use: model name, ISA found, cores and NUMA nodes visible to it."""

    model: str
    isa: tuple[str, ...]  # printed names from ISA_FLAGS, in that order
    logical_cpus: int  # CPUs in this process's affinity mask
    physical_cores: int  # distinct (package, core) pairs among those CPUs
    numa_nodes: int  # NUMA nodes holding at least one of those CPUs

    @property
    def native_bf16_gemm(self) -> bool:
        """True when the CPU has bf16 dot-product instructions, so bf16 GEMMs beat fp32 ones."""
        return "AMX-BF16" in self.isa or "AVX512-BF16" in self.isa


def _cpuinfo_fields() -> tuple[str, set[str]]:
    model, flags = "unknown", set[str]()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return model, flags
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and model == "unknown":
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return model, flags


def _visible_cpus() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def _physical_cores(cpus: list[int]) -> int:
    cores = set()
    for cpu in cpus:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            pkg = (topo / "physical_package_id").read_text().strip()
            core = (topo / "core_id").read_text().strip()
        except OSError:
            return len(cpus)  # no topology: count each CPU as a core
        cores.add((pkg, core))
    return max(1, len(cores))


def _numa_nodes(cpus: list[int]) -> int:
    nodes = set[str]()
    for cpu in cpus:
        found = list(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
        nodes.update(p.name for p in found)
    return max(1, len(nodes))


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """The host CPU as this process sees it (cached: topology does not change while we run)."""
    model, flags = _cpuinfo_fields()
    cpus = _visible_cpus()
    isa = tuple(name for flag, name in ISA_FLAGS.items() if flag in flags)
    return CpuInfo(
        model=model,
        isa=isa,
        logical_cpus=len(cpus),
        physical_cores=_physical_cores(cpus),
        numa_nodes=_numa_nodes(cpus),
    )


def default_num_threads() -> int:
    """Physical cores visible to the process: SMT siblings share the GEMM units, so they add little."""
    return cpu_info().physical_cores
