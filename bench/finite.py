"""NaN/Inf checks side by side: ``moetune.finite.all_finite`` against the two checks it replaced.

    python bench/finite.py [--threads 1 2] [--reps 5] [--shrink 1]

For one ``[2048, 7168]`` weight (DeepSeek-V3's expert gate, a merge's unit of work) and one layer of 16 experts
``[16, 4096, 2048]`` + ``[16, 2048, 2048]`` (what the load-time scan checks at once), in bf16, fp32 and FP8
e4m3fn codes: the milliseconds (the best of ``--reps``, each rep running every check in turn) and GB/s of
- ``isfinite``: ``torch.isfinite(t).all()`` (the merge's and the engine's check before; torch has none for
  float8),
- ``sum``: an fp32 sum per expert, the load-time scan's check before,
- ``all_finite``: ``moetune.finite.all_finite`` (``torch.aminmax``; float8 codes by their integer maxima),
and ``all_finite``'s speed-up over each. Prints the CPU and its ISA first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from moetune.bench.runtime import script_header, sweep_args
from moetune.bench.timing import interleaved_min_ms
from moetune.finite import all_finite


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


def _checking(check: Callable[[torch.Tensor], bool], tensors: list[torch.Tensor]) -> Callable[[int], None]:
    def call(i: int) -> None:
        assert check(tensors[i])

    return call


def main() -> None:
    args = sweep_args(__doc__, reps=5)
    print(script_header("bench/finite.py"))
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
                calls = {name: _checking(check, tensors) for name, check in checks.items()}
                per_item = interleaved_min_ms(calls, len(tensors), args.reps)
                times = {name: ms * len(tensors) / 1e3 for name, ms in per_item.items()}  # s for all tensors
                new = times["all_finite"]
                cells = ", ".join(f"{n} {s * 1e3:.1f} ms ({gb / s:.1f} GB/s)" for n, s in times.items())
                ratios = ", ".join(f"{times[n] / new:.1f}x over {n}" for n in times if n != "all_finite")
                print(f"{threads} thread(s) | {label} {str(dtype).removeprefix('torch.')}: {cells}; {ratios}")


if __name__ == "__main__":
    main()
