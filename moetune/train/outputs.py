"""What a run leaves in ``output_dir`` besides the adapter: a loss curve PNG and a run summary JSON."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

from moetune.atomic import write_atomically, write_text_atomically

LOSS_CURVE = "loss_curve.png"
SUMMARY = "run_summary.json"


def peak_ram_gb() -> float:
    """Peak resident memory of this process (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 30) if sys.platform == "darwin" else rss / (1 << 20)


def peak_vram_gb() -> float | None:
    """Peak CUDA memory allocated by torch, or None without CUDA (never initialises CUDA itself)."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated() / (1 << 30)


def write_loss_curve(log_history: list[dict[str, Any]], path: Path) -> Path | None:
    """Plot training (and eval) loss against the step; None when nothing was logged."""
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h]
    if not train and not evals:
        return None
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for points, label in ((train, "train loss"), (evals, "eval loss")):
        if points:
            ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        write_atomically(path, lambda tmp: fig.savefig(tmp, dpi=100, format="png"))
    finally:
        plt.close(fig)
    return path


def write_summary(summary: dict[str, Any], path: Path) -> Path:
    """Write ``summary`` as JSON atomically."""
    return write_text_atomically(path, json.dumps(summary, indent=2, default=str) + "\n")
