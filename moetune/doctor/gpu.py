"""The GPUs the non-expert layers run on."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetune.doctor.base import GIB, Check, Status


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
