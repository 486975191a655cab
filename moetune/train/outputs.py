"""What a run leaves in ``output_dir`` besides the adapter: a loss curve PNG, a run summary JSON, and
``trainer_log.jsonl``, one JSON line per log as LLaMA-Factory writes it."""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from moetune.atomic import write_atomically, write_text_atomically

LOSS_CURVE = "loss_curve.png"
SUMMARY = "run_summary.json"
TRAINER_LOG = "trainer_log.jsonl"


def peak_ram_gb() -> float:
    """Peak resident memory of this process (``moetune.sysinfo.peak_rss_bytes``)."""
    from moetune.sysinfo import peak_rss_bytes

    return peak_rss_bytes() / (1 << 30)


def peak_vram_gb() -> float | None:
    """Peak CUDA memory allocated by torch, or None without CUDA (never initialises CUDA itself)."""
    import torch

    if not torch.cuda.is_initialized():
        return None
    return torch.cuda.max_memory_allocated() / (1 << 30)


def train_losses(log_history: list[dict[str, Any]]) -> list[tuple[int, float]]:
    """(step, loss) of every training log; when no step was logged (``logging_steps`` beyond the run), the
    run's mean loss at its last step, which the Trainer's final log holds."""
    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h]
    if not train:
        train = [(h["step"], h["train_loss"]) for h in log_history if "train_loss" in h][-1:]
    return train


def write_loss_curve(log_history: list[dict[str, Any]], path: Path) -> Path | None:
    """Plot training (and eval) loss against the step; None when nothing was logged."""
    train = train_losses(log_history)
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


def _step_of(line: str) -> int:
    """A trainer_log.jsonl line's ``current_steps`` (0 for a line that is not one of its records: kept)."""
    try:
        step = json.loads(line).get("current_steps", 0)
    except (ValueError, AttributeError):
        return 0
    return step if isinstance(step, int) else 0


class TrainerLog(TrainerCallback):
    """Appends one JSON line per Trainer log to ``output_dir/trainer_log.jsonl`` with LLaMA-Factory's field
    names: ``current_steps``, ``total_steps``, ``loss``, ``eval_loss``, ``lr``, ``epoch``, ``percentage``,
    ``elapsed_time``, ``remaining_time`` (``H:MM:SS``), and ``throughput`` / ``total_tokens`` once tokens are
    counted; absent values are left out. A fresh run starts a fresh file; a resumed one first drops the lines of
    steps past its checkpoint (logged by the run it continues after that checkpoint was written, and logged again
    now), then appends."""

    def __init__(self) -> None:
        self.start = 0.0
        self.start_step = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.start, self.start_step = time.time(), state.global_step
        path = Path(args.output_dir) / TRAINER_LOG
        if args.should_save and state.global_step == 0 and path.exists():
            path.unlink()
        elif args.should_save and path.exists():
            kept = [
                line
                for line in path.read_text(encoding="utf-8").splitlines()
                if _step_of(line) <= state.global_step
            ]
            write_text_atomically(path, "".join(line + "\n" for line in kept))

    def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
        if not args.should_save or not logs:
            return
        elapsed = time.time() - self.start
        done, total = state.global_step, state.max_steps
        per_step = elapsed / max(done - self.start_step, 1)
        record = {
            "current_steps": done,
            "total_steps": total,
            "loss": logs.get("loss"),
            "eval_loss": logs.get("eval_loss"),
            "lr": logs.get("learning_rate"),
            "epoch": logs.get("epoch"),
            "percentage": round(done / total * 100, 2) if total else 100,
            "elapsed_time": str(datetime.timedelta(seconds=int(elapsed))),
            "remaining_time": str(datetime.timedelta(seconds=int((total - done) * per_step))),
        }
        if state.num_input_tokens_seen:
            record["throughput"] = round(state.num_input_tokens_seen / max(elapsed, 1e-9), 2)
            record["total_tokens"] = state.num_input_tokens_seen
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(args.output_dir) / TRAINER_LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps({k: v for k, v in record.items() if v is not None}) + "\n")
