"""NaN/Inf checks side by side: ``moetune.finite.all_finite`` against the two checks it replaced.

    python bench/finite.py [--threads 1 2] [--reps 5] [--shrink 1]

For one ``[2048, 7168]`` weight (DeepSeek-V3's expert gate, a merge's unit of work) and one layer of 16 experts
``[16, 4096, 2048]`` + ``[16, 2048, 2048]`` (what the load-time scan checks at once), in bf16, fp32 and FP8
e4m3fn codes: the milliseconds (best of ``--reps``) and GB/s of
- ``isfinite``: ``torch.isfinite(t).all()`` (the merge's and the engine's check before; torch has none for
  float8),
- ``sum``: an fp32 sum per expert, the load-time scan's check before,
- ``all_finite``: ``moetune.finite.all_finite`` (``torch.aminmax``; float8 codes by their integer maxima),
and ``all_finite``'s speed-up over each. Prints the CPU and its ISA first.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from moetune.finite import all_finite
from moetune.sysinfo import cpu_info


def _isfinite(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


def _sums(t: torch.Tensor) -> bool:
    rows = t if t.dim() > 2 else t[None]
    return all(bool(torch.isfinite(rows[e].sum(dtype=torch.float32))) for e in range(rows.shape[0]))


CHECKS: dict[str, Callable[[torch.Tensor], bool]] = {
    "isfinite": _isfinite,
    "sum": _sums,
    "all_finite": all_finite,
}


def _best(check: Callable[[torch.Tensor], bool], tensors: list[torch.Tensor], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        for t in tensors:
            assert check(t)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--shrink", type=int, default=1, help="divide the row counts by this (the tests' quick run)"
    )
    args = p.parse_args()
    machine = cpu_info()
    print(f"bench/finite.py | {machine.model} ({', '.join(machine.isa) or 'no SIMD flags found'})")
    gen = torch.Generator().manual_seed(0)
    r = args.shrink
    cases = {
        f"weight [{2048 // r}, 7168]": [(2048 // r, 7168)],
        f"layer 16 x ([{4096 // r}, 2048] + [{2048 // r}, 2048])": [
            (16, 4096 // r, 2048),
            (16, 2048 // r, 2048),
        ],
    }
    for threads in args.threads:
        torch.set_num_threads(threads)
        for label, shapes in cases.items():
            for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
                tensors = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
                gb = sum(t.nbytes for t in tensors) / 1e9
                checks = {n: c for n, c in CHECKS.items() if n != "isfinite" or dtype.itemsize > 1}
                times = {name: _best(check, tensors, args.reps) for name, check in checks.items()}
                new = times["all_finite"]
                cells = ", ".join(f"{n} {s * 1e3:.1f} ms ({gb / s:.1f} GB/s)" for n, s in times.items())
                ratios = ", ".join(f"{times[n] / new:.1f}x over {n}" for n in times if n != "all_finite")
                print(f"{threads} thread(s) | {label} {str(dtype).removeprefix('torch.')}: {cells}; {ratios}")


if __name__ == "__main__":
    main()
