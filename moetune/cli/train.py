"""``moetune train CONFIG.yaml``: LoRA fine-tuning from a LLaMA-Factory-style YAML."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "train",
        help="fine-tune with LoRA (attention and routed experts) from a YAML config",
        description="Train LoRA from a YAML config (LLaMA-Factory key names; moetune options under `moetune:`). "
        "Writes a stock PEFT adapter, checkpoints, trainer_state.json, loss_curve.png and run_summary.json "
        "to output_dir.",
    )
    p.add_argument("config", help="path to the YAML config")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moetune.config import load_config
    from moetune.train.recipe import run as train_run

    cfg = load_config(args.config)  # every config problem is reported here, before anything loads
    show_logs(dict(cfg.training.extra_args))
    result = train_run(cfg)
    if not result.trainer.is_world_process_zero():  # several processes (torchrun): the main one reports
        return 0
    keep: tuple[str, ...] = (
        "steps",
        "wall_seconds",
        "tokens_per_second",
        "final_train_loss",
        "final_eval_loss",
        "peak_ram_gb",
        "finetuning_type",
        "memory",
        "routed_experts",
    )
    if result.summary["best_model_checkpoint"] is not None:  # load_best_model_at_end: what the output holds
        keep += ("best_metric", "best_model_checkpoint")
    print(json.dumps({k: result.summary[k] for k in keep}, indent=2))
    what = "adapter" if result.summary["finetuning_type"] == "lora" else "model"
    print(f"{what} written to {cfg.training.output_dir}")
    return 0


def show_logs(extra: dict[str, object], rank: int | None = None) -> None:
    """moetune's own info lines (each rank's CPU pinning, the expert optimizer, ...) on stderr at the YAML's
    ``log_level`` (the main process) or ``log_level_replica`` (the others), the TrainingArguments keys that set
    transformers' own verbosity; at their defaults (passive / warning) only warnings reach the console, as before.
    ``rank``: this process's (default: the launcher's ``RANK``)."""
    main = (int(os.environ.get("RANK", "0")) if rank is None else rank) == 0
    name = str(extra.get("log_level" if main else "log_level_replica", "passive" if main else "warning"))
    level = {"debug": logging.DEBUG, "info": logging.INFO}.get(name.lower())
    if level is None:
        return
    logger = logging.getLogger("moetune")
    if _CONSOLE not in logger.handlers:
        logger.addHandler(_CONSOLE)
    logger.setLevel(level)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """The process's stderr at each record (as logging's own last-resort handler: a replaced sys.stderr too)."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


_CONSOLE = _Stderr()
_CONSOLE.setFormatter(logging.Formatter("%(message)s"))
