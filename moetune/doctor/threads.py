"""The threads the engine runs on against the CPUs (and the CPU quota) the process may use."""

from __future__ import annotations

import math

from moetune.doctor.base import Check, Status
from moetune.sysinfo import CpuInfo


def check_threads(info: CpuInfo, engine_threads: int, total_cpus: int, cpu_quota: float | None) -> Check:
    """``engine_threads``, the pool ``load_model`` gives the engine unless told (``default_num_threads``),
    against the CPUs the process may actually run on."""
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
