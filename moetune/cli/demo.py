"""``moetune demo``: generate a tiny MoE model, train LoRA on the shipped cipher task, show held-out accuracy."""

from __future__ import annotations

import argparse


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train the embedded demo (tiny MoE, cipher task) and print held-out accuracy before/after",
        description="Run from the repository root: writes a tiny model to out/demo, trains "
        "examples/demo_lora.yaml, prints held-out exact match before and after training.",
    )
    p.add_argument("--config", default="examples/demo_lora.yaml", help="demo config (default: %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moetune.train.demo import run_demo

    run_demo(args.config)
    return 0
