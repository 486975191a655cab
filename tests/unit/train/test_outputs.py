"""What a run writes besides the adapter: LLaMA-Factory's trainer_log.jsonl, the loss of runs shorter than
logging_steps, and log lines that keep small learning rates."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from moetune.train.outputs import TRAINER_LOG, TrainerLog, train_losses, write_loss_curve
from moetune.train.trainer import _shown


def test_trainer_log_lines_have_llamafactorys_fields(tmp_path: Path) -> None:
    (tmp_path / TRAINER_LOG).write_text("from an earlier run\n")
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True)
    state = SimpleNamespace(global_step=0, max_steps=4, num_input_tokens_seen=0)
    callback = TrainerLog()
    callback.on_train_begin(args, state, None)
    assert not (tmp_path / TRAINER_LOG).exists()  # a fresh run starts a fresh file
    for step, logs in ((1, {"loss": 2.5, "learning_rate": 2e-5, "epoch": 0.25}), (2, {"eval_loss": 2.0})):
        state.global_step, state.num_input_tokens_seen = step, 100 * step
        callback.on_log(args, state, None, logs=logs)
    first, second = (json.loads(line) for line in (tmp_path / TRAINER_LOG).read_text().splitlines())
    assert {k: first[k] for k in ("current_steps", "total_steps", "loss", "lr", "epoch", "percentage")} == {
        "current_steps": 1,
        "total_steps": 4,
        "loss": 2.5,
        "lr": 2e-5,
        "epoch": 0.25,
        "percentage": 25.0,
    }
    assert first["elapsed_time"].count(":") == 2 and first["remaining_time"].count(":") == 2
    assert first["total_tokens"] == 100 and "throughput" in first
    assert second["eval_loss"] == 2.0 and "loss" not in second and second["percentage"] == 50.0


def test_a_resumed_run_drops_the_steps_past_its_checkpoint(tmp_path: Path) -> None:
    """A run killed at step 43 after checkpoint-40 logged 41-43, and its resume logged them again (twice in the
    file); the lines past the checkpoint's step go first, the others stay as written."""
    lines = [json.dumps({"current_steps": s, "loss": 1.0 / s}) for s in (10, 20, 30, 40, 41, 42, 43)]
    (tmp_path / TRAINER_LOG).write_text("".join(line + "\n" for line in lines))
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True)
    state = SimpleNamespace(global_step=40, max_steps=50, num_input_tokens_seen=0)
    callback = TrainerLog()
    callback.on_train_begin(args, state, None)
    assert (tmp_path / TRAINER_LOG).read_text().splitlines() == lines[:4]
    state.global_step = 41
    callback.on_log(args, state, None, logs={"loss": 0.5})
    steps = [json.loads(line)["current_steps"] for line in (tmp_path / TRAINER_LOG).read_text().splitlines()]
    assert steps == [10, 20, 30, 40, 41]


def test_a_run_shorter_than_logging_steps_still_has_a_loss_and_a_curve(tmp_path: Path) -> None:
    history = [{"step": 2, "train_runtime": 1.0, "train_loss": 2.75, "epoch": 0.1}]
    assert train_losses(history) == [(2, 2.75)]
    assert write_loss_curve(history, tmp_path / "curve.png") == tmp_path / "curve.png"
    logged = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "train_loss": 2.75}]
    assert train_losses(logged) == [(1, 3.0), (2, 2.5)]


def test_log_lines_keep_small_learning_rates() -> None:
    assert _shown(2e-5) == "2e-05" and _shown(0.123456) == "0.1235" and _shown(7) == "7"
