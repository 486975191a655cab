"""``moetune chat --model DIR [--adapter DIR]``: one greedy answer per line read from stdin."""

from __future__ import annotations

import argparse
import sys

from moetune.cli.generate import add_model_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chat", help="answer each line of stdin greedily (single-turn)")
    add_model_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moetune.train.generation import answer, load_for_inference

    model, tok = load_for_inference(
        args.model, args.adapter, device=args.device, dtype=args.dtype, progress=False
    )
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line:
            return 0
        if line.strip():
            print(
                answer(model, tok, [line.strip()], max_new_tokens=args.max_new_tokens, chat=not args.raw)[0]
            )
