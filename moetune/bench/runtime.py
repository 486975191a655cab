"""The runtime tuple a benchmark result is only meaningful with: machine, ISA, cores, threads, library
versions, git commit; the Markdown rendering of ``moetune bench all``'s results; and what the small ``bench/``
scripts share (their first line, their thread sweep's arguments)."""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _onednn_version() -> str:
    """oneDNN's version from torch's build configuration ("unknown" when torch does not say)."""
    import torch

    found = re.search(r"(?:MKL-DNN|oneDNN)\s+v?([\w.]+)", torch.__config__.show())
    return found.group(1) if found else "unknown"


def _git_commit() -> str:
    """The source tree's commit (with ``-dirty`` when it has uncommitted changes), or why it is unknown."""
    try:
        head = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("-dirty" if dirty else "")


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def runtime_info(threads: int) -> dict[str, Any]:
    """Everything about this run's machine and software that changes a benchmark's numbers."""
    import torch

    from moetune.engine import resolve_compute_dtype
    from moetune.sysinfo import cpu_info

    cpu = cpu_info()
    return {
        "cpu": cpu.model,
        "isa": list(cpu.isa),
        "native_bf16_gemm": cpu.native_bf16_gemm,
        "bf16_experts_compute_in": str(resolve_compute_dtype(torch.bfloat16)).removeprefix("torch."),
        "logical_cpus": cpu.logical_cpus,
        "physical_cores": cpu.physical_cores,
        "numa_nodes": cpu.numa_nodes,
        "threads": threads,
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "torch": torch.__version__,
        "onednn": _onednn_version(),
        "mkl": torch.backends.mkl.is_available(),
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "moetune": _version("moetune"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": _git_commit(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
    }


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown(result: dict[str, Any]) -> str:
    """``bench-all.md``: the runtime tuple, one summary row per benchmark, then each one's printed table."""
    rt = result["runtime"]
    lines = [
        f"# moetune bench all ({result['size']})",
        "",
        f"Command: `{result['command']}`",
        "",
        "| runtime | value |",
        "|---|---|",
        *(f"| {k} | {_cell(v)} |" for k, v in rt.items()),
        "",
        "| benchmark | status | seconds | result | shapes |",
        "|---|---|---:|---|---|",
    ]
    for b in result["benchmarks"]:
        what = b["headline"] if b["status"] == "ok" else b["error"].splitlines()[0] if b["error"] else ""
        shapes = ", ".join(
            f"{k}={_cell(v)}" for k, v in b["shapes"].items() if k not in ("timing", "workdir")
        )
        lines.append(
            f"| {b['name']} | {b['status']} | {b['seconds']:.1f} | {_cell(what)} | {_cell(shapes)} |"
        )
    for b in result["benchmarks"]:
        lines += ["", f"## {b['name']}", "", "```text", b["output"].rstrip() or "(no output)", "```"]
        if b["error"]:
            lines += ["", "```text", b["error"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def script_header(script: str) -> str:
    """The first line a ``bench/`` script prints: ``script``, the CPU model and its ISA (a speed claim says
    where it was measured)."""
    from moetune.sysinfo import cpu_info

    cpu = cpu_info()
    return f"{script} | {cpu.model} ({', '.join(cpu.isa) or 'no SIMD flags found'})"


def sweep_args(doc: str, reps: int) -> argparse.Namespace:
    """A micro-benchmark's command line: ``--threads`` (a list, default 1 2), ``--reps`` (default ``reps``) and
    ``--shrink`` (the row counts divided by it: the tests' quick run); ``doc``'s first line is the description."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--reps", type=int, default=reps)
    p.add_argument(
        "--shrink", type=int, default=1, help="divide the row counts by this (the tests' quick run)"
    )
    return p.parse_args()
