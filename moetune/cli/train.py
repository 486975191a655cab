"""``moetune train CONFIG.yaml``: LoRA fine-tuning from a LLaMA-Factory-style YAML."""

from __future__ import annotations

import argparse
import json


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
    result = train_run(cfg)
    if not result.trainer.is_world_process_zero():  # several processes (torchrun): the main one reports
        return 0
    keep = (
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
    print(json.dumps({k: result.summary[k] for k in keep}, indent=2))
    what = "adapter" if result.summary["finetuning_type"] == "lora" else "model"
    print(f"{what} written to {cfg.training.output_dir}")
    return 0
