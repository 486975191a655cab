"""Host RAM and swap, where the expert weights, their LoRA and its optimizer state live, and whether torch's
allocations of it get huge pages."""

from __future__ import annotations

import psutil

from moetune.doctor.base import GIB, Check, Status
from moetune.sysinfo import THP_ENV


def check_memory(thp_mode: str, torch_advises: bool) -> Check:
    """Host RAM, reported (no model, no verdict), and transparent huge pages: ``thp_mode`` the kernel's
    (``sysinfo.thp_mode``), ``torch_advises`` whether torch's allocator in this process asks for them
    (``sysinfo.torch_advises_huge_pages``). Reported, not judged: engine steps measured 0.94-1.27x with them, 1.05x
    in the median (docs/performance.md, "Huge pages for torch's allocations"); ``python bench/huge_pages.py``
    measures a machine."""
    ram, swap = psutil.virtual_memory(), psutil.swap_memory()
    return Check(
        "memory",
        Status.OK,
        f"{ram.total / GIB:.1f} GiB RAM, {ram.available / GIB:.1f} GiB available; {swap.total / GIB:.1f} GiB swap",
        (
            f"transparent huge pages: kernel mode {thp_mode}; torch's allocator advises them: "
            f"{'yes' if torch_advises else 'no'} ({THP_ENV})",
        ),
    )
