"""Host RAM and swap, where the expert weights, their LoRA and its optimizer state live."""

from __future__ import annotations

import psutil

from moetune.doctor.base import GIB, Check, Status


def check_memory() -> Check:
    """Host RAM, reported: expert weights, their LoRA and optimizer state live here (no model, no verdict)."""
    ram, swap = psutil.virtual_memory(), psutil.swap_memory()
    return Check(
        "memory",
        Status.OK,
        f"{ram.total / GIB:.1f} GiB RAM, {ram.available / GIB:.1f} GiB available; {swap.total / GIB:.1f} GiB swap",
    )
