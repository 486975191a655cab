"""Preference rows -> token ids for the dpo and kto stages, on the data path sft uses (``moetune.train.data``).

Rows are read in LLaMA-Factory's forms (docs/stages.md):

    dpo (``ranking: true``)  alpaca:   instruction / input / system / history, and chosen / rejected strings
                             sharegpt: conversations ending in a user turn, and chosen / rejected messages
    kto (a ``kto_tag``)      alpaca:   instruction / input / output, and a true/false kto_tag
                             sharegpt: conversations ending in an assistant turn, and a true/false kto_tag

A prompt and a response are encoded as sft encodes a conversation whose last assistant turn is trained
(``ExampleEncoder``, so the chat template, ``default_system`` and ``enable_thinking`` apply alike): the
response is the tokens from the first trained one on, the prompt the tokens before it.

Columns (lists of token ids): dpo ``prompt_ids``, ``chosen_ids``, ``rejected_ids`` (what TRL's
``DataCollatorForPreference`` reads); kto ``prompt_ids``, ``completion_ids``, ``label`` (what
``DataCollatorForUnpairedPreference`` reads). Prompt plus response is truncated to ``cutoff_len``; a row whose
prompt fills it is dropped (all of them: an error), as sft drops rows left with no trained token.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from moetune.config.datasets import DataFormat, RowKind
from moetune.errors import DataError
from moetune.train.data import (
    Layout,
    RowCodec,
    RowError,
    _messages,
    alpaca_prompt,
    sharegpt_messages,
    to_sample,
)
from moetune.train.templates import ExampleEncoder, Sample
from moetune.train.truncation import first_label_kept, split_budget

Message = dict[str, str]


@dataclass(frozen=True)
class Pair:
    """A dpo row: the prompt's messages (ending with the user turn) and the two assistant responses."""

    prompt: list[Message]
    chosen: Message
    rejected: Message


@dataclass(frozen=True)
class Feedback:
    """A kto row: the prompt's messages, the assistant response, and whether it is desirable."""

    prompt: list[Message]
    completion: Message
    desirable: bool


def read_pair(row: Mapping[str, Any], layout: Layout) -> Pair:
    """A ``ranking`` row as a :class:`Pair`; ``RowError`` names the field that does not fit."""
    c = layout.columns
    if layout.format is DataFormat.ALPACA:
        prompt = alpaca_prompt(row, layout)
        chosen, rejected = (_text_response(row, c[role]) for role in ("chosen", "rejected"))
    else:
        prompt = sharegpt_messages(row, layout)
        if prompt[-1]["role"] != "user":
            raise RowError(
                f"field {c['messages']!r} must end with a user message (the prompt that chosen and rejected "
                f"answer); it ends with a {prompt[-1]['role']} message"
            )
        chosen, rejected = (_message_response(row, c[role], layout) for role in ("chosen", "rejected"))
    return Pair(prompt, chosen, rejected)


def read_feedback(row: Mapping[str, Any], layout: Layout) -> Feedback:
    """A kto row as :class:`Feedback`: its conversation (read as sft reads it) and its tag."""
    messages = to_sample(row, layout).messages
    assert messages is not None, "alpaca and sharegpt rows are conversations"
    if messages[-1]["role"] != "assistant":
        raise RowError(
            f"the conversation must end with the assistant response the kto_tag judges; it ends with a "
            f"{messages[-1]['role']} message"
        )
    column = layout.columns["kto_tag"]
    tag = row.get(column)
    if not isinstance(tag, bool):
        raise RowError(f"field {column!r} (kto_tag) must be true or false, got {tag!r:.60}")
    return Feedback(messages[:-1], messages[-1], tag)


def _text_response(row: Mapping[str, Any], column: str) -> Message:
    value = row.get(column)
    if not isinstance(value, str) or not value:
        raise RowError(f"field {column!r} must be a non-empty string (a response), got {value!r:.60}")
    return {"role": "assistant", "content": value}


def _message_response(row: Mapping[str, Any], column: str, layout: Layout) -> Message:
    value = row.get(column)
    if not isinstance(value, Mapping):
        raise RowError(
            f"field {column!r} must be one message ({layout.tags['role_tag']!r}: "
            f"{layout.tags['assistant_tag']!r}, {layout.tags['content_tag']!r}: ...), got {value!r:.60}"
        )
    (message,) = _messages([value], layout.tags, column)
    if message["role"] != "assistant":
        raise RowError(f"field {column!r} must be an assistant message, got role {message['role']!r}")
    return message


def _prompt_response(
    encoder: ExampleEncoder, prompt: list[Message], response: Message
) -> tuple[list[int], int]:
    """The token ids of prompt + response and the index where the response's trained tokens start."""
    encoded = encoder.encode(Sample(messages=[*prompt, response], first_trained=len(prompt)))
    first = encoded.first_label
    assert first is not None, "encode_spans raises when a response yields no trained token"
    return encoded.input_ids, first


def encode_pair(pair: Pair, encoder: ExampleEncoder, cutoff: int) -> dict[str, Any]:
    """A dpo example; prompt and responses cut to ``cutoff`` tokens by LLaMA-Factory's rule
    (``moetune.train.truncation.split_budget``, the longer response's length standing for both)."""
    chosen, c_first = _prompt_response(encoder, pair.prompt, pair.chosen)
    rejected, r_first = _prompt_response(encoder, pair.prompt, pair.rejected)
    n = min(c_first, r_first)  # a token merged across the prompt's end belongs to the response
    if chosen[:n] != rejected[:n]:
        raise DataError(
            "the prompt tokenizes differently before the chosen and the rejected response; check the chat template"
        )
    source, target = split_budget(n, max(len(chosen), len(rejected)) - n, cutoff)
    return {
        "prompt_ids": chosen[:source],
        "chosen_ids": chosen[n : n + target],
        "rejected_ids": rejected[n : n + target],
        "_length": max(len(chosen), len(rejected)),
        "_first_label": first_label_kept(source if target else None, n, cutoff),
    }


def encode_feedback(row: Feedback, encoder: ExampleEncoder, cutoff: int) -> dict[str, Any]:
    """A kto example; prompt and response cut to ``cutoff`` tokens by LLaMA-Factory's rule
    (``moetune.train.truncation.split_budget``)."""
    ids, first = _prompt_response(encoder, row.prompt, row.completion)
    source, target = split_budget(first, len(ids) - first, cutoff)
    return {
        "prompt_ids": ids[:source],
        "completion_ids": ids[first : first + target],
        "label": row.desirable,
        "_length": len(ids),
        "_first_label": first_label_kept(source if target else None, first, cutoff),
    }


PAIRED = RowCodec(RowKind.PAIRED, read_pair, encode_pair, packable=False)  # dpo
UNPAIRED = RowCodec(RowKind.UNPAIRED, read_feedback, encode_feedback, packable=False)  # kto
