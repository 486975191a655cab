"""``moetune generate --model DIR [--adapter DIR] --prompt TEXT``: greedy answers with an adapter."""

from __future__ import annotations

import argparse
from typing import Any


def positive_int(text: str) -> int:
    """An argparse type: a whole number >= 1 (argparse names the option and exits 2 otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Options shared by ``generate`` and ``chat``."""
    p.add_argument("--model", required=True, help="base model folder (Hugging Face layout)")
    p.add_argument("--adapter", help="adapter folder written by moetune train (stock PEFT format)")
    p.add_argument("--device", default=None, help="device for the non-expert part (default: cuda if present)")
    p.add_argument("--dtype", default="float32", help="weights dtype (default: %(default)s)")
    p.add_argument(
        "--max-new-tokens", type=positive_int, default=64, help="at least 1 (default: %(default)s)"
    )
    p.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="let the tokenizer run the checkpoint's own code (Kimi's tokenizer needs it); the model never does",
    )
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")


def load_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(model, tokenizer) for the arguments of :func:`add_model_args`. ``--adapter``'s folder is checked on its
    own first, before the tokenizer or model loads (``load_model`` then checks it against the model's config
    before reading any weight)."""
    from moetune.train.generation import load_for_inference

    if args.adapter is not None:
        from moetune.adapters.check import check_adapter_folder

        check_adapter_folder(args.adapter)
    return load_for_inference(
        args.model,
        args.adapter,
        device=args.device,
        dtype=args.dtype,
        progress=False,
        trust_remote_code=args.trust_remote_code,
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="answer prompts greedily with a model and optional adapter")
    add_model_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from moetune.train.generation import answer

    model, tok = load_from_args(args)
    for text in answer(model, tok, args.prompt, max_new_tokens=args.max_new_tokens, chat=not args.raw):
        print(text)
    return 0
