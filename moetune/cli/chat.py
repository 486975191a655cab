"""``moetune chat --model DIR [--adapter DIR]``: a multi-turn conversation on stdin, answered greedily.

Each message goes, with the conversation so far, through the tokenizer's chat template. A line ending in a
backslash continues the message on the next line; ``/reset`` forgets the conversation, ``/exit`` (or the end
of input) quits. Answers go to stdout, one per message (a newline inside an answer is printed as is).
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from moetune.cli.generate import add_model_args, load_from_args
from moetune.errors import ConfigError

RESET, EXIT = "/reset", "/exit"
CONTINUATION = "\\"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chat",
        help="chat with a model and adapter on stdin (multi-turn, greedy)",
        description="Read messages from stdin and answer each greedily, with the conversation so far in the "
        "chat template. A line ending in a backslash (\\) continues the message on the next line. Commands "
        f"(alone on a line): {RESET} forgets the conversation, {EXIT} quits (so does the end of input). "
        "With --raw each message is a standalone prompt: no template, no history.",
    )
    add_model_args(p)
    p.set_defaults(func=run)


def read_message(stream: TextIO, interactive: bool) -> str | None:
    """The next message: lines ending in a backslash joined to the next with a newline; None at end of input."""
    lines: list[str] = []
    while True:
        if interactive:
            print("... " if lines else "> ", end="", flush=True)
        line = stream.readline()
        if not line:
            return "\n".join(lines) if lines else None
        line = line.rstrip("\r\n")
        if not line.endswith(CONTINUATION):
            return "\n".join([*lines, line])
        lines.append(line[: -len(CONTINUATION)])


def run(args: argparse.Namespace) -> int:
    from moetune.train.generation import complete, render

    model, tok = load_from_args(args)
    if not args.raw and not tok.chat_template:
        raise ConfigError(
            f"the tokenizer of {args.adapter or args.model} has no chat template, so a conversation cannot be "
            "rendered; add one to its tokenizer_config.json / chat_template.jinja, or pass --raw"
        )
    interactive = sys.stdin.isatty()
    history: list[dict[str, str]] = []
    while (message := read_message(sys.stdin, interactive)) is not None:
        command = message.strip()
        if not command:
            continue
        if command == EXIT:
            break
        if command == RESET:
            history.clear()
            print("(conversation reset)", file=sys.stderr)
            continue
        if args.raw:
            reply = complete(model, tok, [message], max_new_tokens=args.max_new_tokens)[0]
        else:
            history.append({"role": "user", "content": message})
            reply = complete(model, tok, [render(tok, history)], max_new_tokens=args.max_new_tokens)[0]
            history.append({"role": "assistant", "content": reply})
        print(reply, flush=True)
    return 0
