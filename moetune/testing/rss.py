"""Host memory of a process: resident now, and the peak it ever reached; ``load_model`` measured in a child.

Peak resident set size is a per-process high-water mark (``VmHWM`` on Linux, ``ru_maxrss`` elsewhere), so every
measurement that must not inherit another's peak runs in a fresh process.
``measure_load`` runs ``python -m moetune.testing.rss PATH ...`` and reads back one JSON line: the resident
size once torch, transformers and moetune are imported (``baseline``; with ``warmup``, once a first, small
checkpoint of the same family is loaded too, so the model's own modules and moetune's code paths are resident
and ``final - baseline`` is the second model's weights alone), the peak while loading, and the resident size
once ``load_model`` returned (``final``, after a garbage collection), all in bytes. Resident
means every page the process maps that is in RAM: anonymous memory and file pages (mapped shards) alike.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from moetune.errors import MoetuneError
from moetune.sysinfo import peak_rss_bytes


def rss_bytes() -> int:
    """Resident set size of this process now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def measure_load(
    path: str | Path,
    *,
    dtype: str = "bfloat16",
    warmup: str | Path | None = None,
    timeout: float = 1800,
) -> dict[str, Any]:
    """Load checkpoint ``path`` with ``moetune.load_model(device="cpu")`` in a fresh Python process (after
    loading ``warmup`` there, when given, and keeping it).

    Returns ``{"baseline", "peak", "final"}`` in bytes and ``"seconds"`` (the load alone); raises
    ``MoetuneError`` with the child's stderr when it fails. The peak is the child program's own high-water
    mark (:func:`peak_rss_bytes`), whatever the parent's size.
    """
    cmd = [sys.executable, "-m", "moetune.testing.rss", str(path), "--dtype", dtype]
    if warmup is not None:
        cmd += ["--warmup", str(warmup)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise MoetuneError(
            f"loading {path} in a child process failed ({done.returncode}):\n{done.stderr[-4000:]}"
        )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    """The child of ``measure_load``: load, then print the measurements as one JSON line."""
    import time

    parser = argparse.ArgumentParser(prog="python -m moetune.testing.rss")
    parser.add_argument("path")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--warmup", help="a checkpoint loaded (and kept) before the baseline")
    args = parser.parse_args(argv)
    from transformers import PreTrainedModel  # noqa: F401  (the libraries are resident before the baseline)

    import moetune

    warm = (
        None
        if args.warmup is None
        else moetune.load_model(args.warmup, device="cpu", dtype=args.dtype, progress=False)
    )
    gc.collect()
    baseline = rss_bytes()
    start = time.perf_counter()
    model = moetune.load_model(args.path, device="cpu", dtype=args.dtype, progress=False)
    seconds = time.perf_counter() - start
    gc.collect()
    out = {"baseline": baseline, "peak": peak_rss_bytes(), "final": rss_bytes(), "seconds": seconds}
    del model, warm
    print(json.dumps(out))


if __name__ == "__main__":
    main()
