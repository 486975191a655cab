"""Entry point of the ``moetune`` console command.

Each subcommand module exposes ``add_parser(subparsers)`` which registers its parser and sets
``func(args) -> int`` as the handler. Heavy imports happen inside handlers, so ``moetune --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moetune.errors import MoetuneError

# subcommand modules under moetune.cli, in the order --help lists them
SUBCOMMANDS = ("doctor", "bench", "convert", "train", "export", "demo", "generate", "chat")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moetune",
        description="Fine-tune Mixture-of-Experts models with the routed experts on the CPU.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for name in SUBCOMMANDS:
        importlib.import_module(f"moetune.cli.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MoetuneError as err:
        print(f"moetune {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
