"""Facts about the host CPU that the engine and ``moetune doctor`` need, this process's peak memory, and whether
torch's allocations get transparent huge pages.

Read from Linux's /proc and /sys where present; every function degrades to a safe answer elsewhere.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")

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


def visible_cpus() -> list[int]:
    """The logical CPUs in this process's affinity mask, ascending."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,8,10-11"`` (the kernel's cpulist format) -> ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return cpus


@dataclass(frozen=True)
class Core:
    """One physical core: its NUMA node and its logical CPUs (SMT siblings), ascending."""

    node: int
    cpus: tuple[int, ...]


def read_cores(cpus: list[int], sys_cpu: Path = SYS_CPU, sys_node: Path = SYS_NODE) -> list[Core]:
    """The physical cores among logical ``cpus``, ordered by (node, first CPU); a machine without NUMA or
    topology files is one node and one core per CPU."""
    node_of: dict[int, int] = {}
    for node_dir in sorted(sys_node.glob("node[0-9]*")):
        try:
            for cpu in parse_cpu_list((node_dir / "cpulist").read_text()):
                node_of[cpu] = int(node_dir.name[4:])
        except (OSError, ValueError):
            continue
    siblings: dict[tuple[int, str, str], list[int]] = defaultdict(list)
    for cpu in cpus:
        topo = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            package, core = (
                (topo / "physical_package_id").read_text().strip(),
                (topo / "core_id").read_text().strip(),
            )
        except OSError:
            package, core = "cpu", str(cpu)  # no topology: each CPU is its own core
        siblings[(node_of.get(cpu, 0), package, core)].append(cpu)
    cores = [Core(key[0], tuple(sorted(found))) for key, found in siblings.items()]
    return sorted(cores, key=lambda c: (c.node, c.cpus[0]))


@lru_cache(maxsize=1)
def cpu_info() -> CpuInfo:
    """The host CPU as this process sees it (cached: topology does not change while we run)."""
    model, flags = _cpuinfo_fields()
    cpus = visible_cpus()
    cores = read_cores(cpus)
    isa = tuple(name for flag, name in ISA_FLAGS.items() if flag in flags)
    return CpuInfo(
        model=model,
        isa=isa,
        logical_cpus=len(cpus),
        physical_cores=max(1, len(cores)),
        numa_nodes=max(1, len({c.node for c in cores})),
    )


def parse_cpu_quota(quota: str, period: str) -> float | None:
    """CPUs a CFS quota allows (``quota / period``); None when unlimited (``max`` or ``-1``)."""
    if quota.strip() in ("max", "-1"):
        return None
    return int(quota) / int(period)


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs this process's cgroup may use, or None when unlimited or unknown (cgroup v2, else v1).

    A v2 limit set on any ancestor binds too, so the tightest one along the path counts.
    """
    own = Path()
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):  # the cgroup v2 entry: 0::/path/of/our/cgroup
                own = Path(line[3:].strip().lstrip("/"))
    except OSError:
        pass
    quotas, v2 = [], False
    for rel in (own, *own.parents):
        try:
            quotas.append(parse_cpu_quota(*(root / rel / "cpu.max").read_text().split()))
            v2 = True
        except (OSError, ValueError, TypeError):
            continue
    if not v2:
        try:
            v1 = root / "cpu"
            quotas.append(
                parse_cpu_quota((v1 / "cpu.cfs_quota_us").read_text(), (v1 / "cpu.cfs_period_us").read_text())
            )
        except (OSError, ValueError):
            pass
    limits = [q for q in quotas if q is not None]
    return min(limits) if limits else None


def default_num_threads() -> int:
    """Physical cores visible to the process (SMT siblings share the GEMM units, so they add little),
    capped by the cgroup CPU quota: containers often show every host CPU while a quota throttles the
    process to a few, and threads beyond the quota only stall each other's GEMMs."""
    cores = cpu_info().physical_cores
    quota = cgroup_cpu_quota()
    return cores if quota is None else max(1, min(cores, math.floor(quota)))


def peak_rss_bytes() -> int:
    """The largest resident set size this process's current program image has had.

    On Linux that is ``VmHWM`` of ``/proc/self/status``: ``ru_maxrss`` survives ``execve``, so a child started
    by a large parent (a pytest session that already loaded several models) would report the parent's peak.
    Elsewhere ``ru_maxrss`` (KiB on Linux, bytes on macOS).
    """
    import resource
    import sys

    status = Path("/proc/self/status")
    if status.is_file():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # "VmHWM:  123456 kB"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


# torch's CPU allocator reads this once, at its first allocation: "1" makes it page-align its blocks of 2 MiB or
# more and madvise(MADV_HUGEPAGE) them (off by default; docs/performance.md, "Huge pages for torch's allocations")
THP_ENV = "THP_MEM_ALLOC_ENABLE"
THP_SYSFS = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(path: Path = THP_SYSFS) -> str:
    """The kernel's transparent huge page mode, the bracketed word of ``path`` ("always", "madvise" or "never"),
    or "unknown" where the file is missing or unreadable (not Linux, or a kernel without THP)."""
    try:
        text = path.read_text()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else "unknown"


def torch_advises_huge_pages() -> bool:
    """Whether torch's CPU allocator in this process advises huge pages: ``THP_MEM_ALLOC_ENABLE`` is on (a non-zero
    number) in the environment and was when torch first allocated, which the blocks show: with it, torch aligns
    blocks of 2 MiB or more to a page (then ``madvise``s them), without it to 64 bytes, which glibc's large blocks
    sit 64 bytes past a page with. (An allocator preloaded in glibc's place may page-align large blocks anyway:
    then this reads the environment alone.)"""
    import mmap

    import torch

    value = os.environ.get(THP_ENV, "").strip()
    if not (value.isdigit() and int(value)):  # as torch reads it (atoi: a non-zero number)
        return False
    blocks = [torch.empty(2 << 20, dtype=torch.uint8) for _ in range(4)]  # held together: 4 distinct blocks
    return all(b.data_ptr() % mmap.PAGESIZE == 0 for b in blocks)
