"""Text -> token ids and labels, training only on chosen character spans.

Every example becomes one string plus the character spans to train on; one fast-tokenizer pass with
offsets then labels each token that overlaps a span (``-100`` elsewhere). Conversations are rendered
with a Jinja chat template (``tokenizer.apply_chat_template``), and an assistant turn's span is found
by rendering incrementally: the conversation up to the turn with the generation prompt, then through
the turn. The turn is what the second adds to the first, and both must be prefixes of the whole
conversation's rendering; a template that breaks this (one that rewrites earlier turns, e.g. dropping
their reasoning) is reported instead of producing wrong labels.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.config.chat_templates import NAMED_TEMPLATES, family_problem
from moetune.config.schema import DataConfig
from moetune.errors import DataError

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # the label transformers' cross-entropy skips

Message = Mapping[str, str]  # {"role": system|user|assistant|tool, "content": str}


@dataclass(frozen=True)
class Sample:
    """A validated row: a conversation (``messages``, trained from message ``first_trained``) or a text
    (``text``, trained from character ``trained_from``)."""

    messages: list[dict[str, str]] | None = None
    first_trained: int = 0
    text: str | None = None
    trained_from: int = 0


@dataclass(frozen=True)
class Encoded:
    """One tokenized example: ``input_ids`` and ``labels`` of equal length (-100 where not trained); ``turns``:
    the token ranges ``[start, end)`` of a conversation's assistant turns, in order (what truncation keeps whole
    where it can: ``moetune.train.truncation``), empty for plain text or where they cannot be found."""

    input_ids: list[int]
    labels: list[int]
    turns: tuple[tuple[int, int], ...] = ()

    @property
    def first_label(self) -> int | None:
        """Index of the first trained token, or None when no token is trained."""
        return next((i for i, label in enumerate(self.labels) if label != IGNORE_INDEX), None)


def read_chat_template(path: Path) -> str:
    """The Jinja chat template stored in ``path``."""
    try:
        return path.read_text()
    except OSError as err:
        raise DataError(f"template: cannot read chat template {path}: {err}") from None


def encode_spans(
    tokenizer: Any,
    text: str,
    spans: Sequence[tuple[int, int]],
    *,
    add_special_tokens: bool,
    turns: Sequence[tuple[int, int]] = (),
) -> Encoded:
    """Tokenize ``text``; a token is trained when its characters overlap one of ``spans``.

    ``spans`` are sorted, non-overlapping ``[start, end)`` character ranges; each must yield at least one
    trained token. A token that straddles a span boundary (a merge across it) is trained: it holds span text.
    ``turns`` (character ranges of the assistant turns) become ``Encoded.turns``: the tokens overlapping each.
    """
    enc = tokenizer(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    ids: list[int] = list(enc["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    hits = [0] * len(spans)
    j = 0  # first span that ends after the current token starts
    for t, (a, b) in enumerate(offsets):
        while j < len(spans) and spans[j][1] <= a:
            j += 1
        k = j
        # span k ends after a, so it overlaps [a, b) if it starts before b (a zero-width token: at or before a)
        while k < len(spans) and (spans[k][0] < b or spans[k][0] <= a == b):
            labels[t] = ids[t]
            hits[k] += 1
            k += 1
    empty = [spans[k] for k, n in enumerate(hits) if n == 0 and spans[k][0] < spans[k][1]]
    if empty:
        s, e = empty[0]
        raise DataError(f"the trained text {text[s:e]!r} (characters {s}-{e}) produced no tokens")
    return Encoded(ids, labels, _token_ranges(offsets, turns))


def _token_ranges(
    offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """For each character span, the ``[first, last)`` tokens whose characters overlap it (tokens' offsets rise)."""
    ends, starts = [b for _, b in offsets], [a for a, _ in offsets]
    return tuple((bisect.bisect_right(ends, s), bisect.bisect_left(starts, e)) for s, e in spans)


def append_eos(tokenizer: Any, encoded: Encoded) -> Encoded:
    """``encoded`` with the end-of-sequence token appended and trained (so the model learns to stop),
    unless the tokenizer has none or the sequence already ends with it."""
    eos = tokenizer.eos_token_id
    if eos is None or (encoded.input_ids and encoded.input_ids[-1] == eos):
        return encoded
    return Encoded(encoded.input_ids + [eos], encoded.labels + [eos])


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    return len(os.path.commonprefix([a, b]))


class ChatRenderer:
    """Renders conversations with a chat template and finds the characters of the trained turns.

    ``template`` is Jinja source (None: the tokenizer's own ``chat_template``); ``template_kwargs`` are
    extra template variables (e.g. ``enable_thinking``).
    """

    def __init__(
        self, tokenizer: Any, template: str | None = None, template_kwargs: Mapping[str, Any] | None = None
    ):
        if template is None and not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"the tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template, and "
                f"conversations need one: set `template` to a LLaMA-Factory name moetune has a built-in format for "
                f"({', '.join(n for n, t in NAMED_TEMPLATES.items() if t.fallback)}) or to a Jinja chat-template "
                f"file, or use plain-text or prompt/completion data"
            )
        self.tokenizer = tokenizer
        self.template = template
        self.template_kwargs = dict(template_kwargs or {})

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """The conversation as the template writes it."""
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.template_kwargs,
            )
        except TemplateError as err:
            raise DataError(f"the chat template failed: {err}") from None
        assert isinstance(text, str)
        return text

    def trained_spans(
        self,
        messages: Sequence[Message],
        *,
        first_trained: int = 0,
        train_on_prompt: bool = False,
        mask_history: bool = False,
    ) -> tuple[str, list[tuple[int, int]], dict[int, tuple[int, int]]]:
        """The rendered conversation, the character spans to train on, and the spans of the assistant turns found
        on the way (by message index).

        Trained: the assistant turns at index >= ``first_trained`` (only the last with ``mask_history``),
        each with its end-of-turn text, as they appear in the whole conversation's rendering (the text the
        model sees). With ``train_on_prompt`` a span also covers the turn's prompt: all text since the
        previous assistant turn (or the start).
        """
        full = self.render(messages)
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        trained = [i for i in turns if i >= first_trained][-1 if mask_history else 0 :]
        if not trained:
            raise DataError("the conversation has no assistant turn to train on")
        found: dict[int, tuple[int, int]] = {}

        def turn(i: int) -> tuple[int, int]:
            if i not in found:
                found[i] = self._turn_span(messages, i, full)
            return found[i]

        spans: list[tuple[int, int]] = []
        for i in trained:
            start, end = turn(i)
            if train_on_prompt:
                earlier = [j for j in turns if j < i]
                start = turn(earlier[-1])[1] if earlier else 0
            spans.append((start, end))
        return full, spans, found

    def _all_turns(
        self, messages: Sequence[Message], full: str, found: dict[int, tuple[int, int]]
    ) -> list[tuple[int, int]]:
        """The character spans of every assistant turn (``found``: those known already); none when a turn cannot
        be found (a template that rewrites earlier turns, trained with ``mask_history``): truncation then cuts the
        conversation's end."""
        out = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if i not in found:
                try:
                    found[i] = self._turn_span(messages, i, full)
                except DataError:
                    return []
            out.append(found[i])
        return out

    def _turn_span(self, messages: Sequence[Message], i: int, full: str) -> tuple[int, int]:
        """Where assistant message ``i`` starts (after its header) and ends (after its end-of-turn text) in
        ``full``, the rendering of all ``messages``.

        The turn starts where the rendering of ``messages[:i]`` with the generation prompt stops agreeing
        with ``full``. It ends where its rendering as the last message ends, when ``full`` shows it that way.
        Templates that show earlier turns differently (Qwen3's hybrid template drops their reasoning and gives
        only the last turn an empty reasoning block) show such a turn as a tail of its last-message form: the
        longest tail found where the turn starts is the turn.
        """
        before = self.render(messages[:i])
        prompt = self.render(messages[:i], add_generation_prompt=True)
        start = _common_prefix(full, prompt)
        if not full.startswith(before) or start < len(before):
            raise DataError(
                f"the chat template renders the conversation before assistant message {i} differently once "
                f"later turns follow (it rewrites earlier messages); set mask_history: true to train on the "
                f"last assistant turn only, or give a `template` file that keeps history as written"
            )
        alone = full if i == len(messages) - 1 else self.render(messages[: i + 1])
        if full.startswith(alone):  # the turn shows as it does when it is the last one
            if not alone.startswith(prompt):
                raise DataError(
                    f"the chat template's generation prompt for message {i} is not how it renders that "
                    f"assistant turn (generation prompt ends {prompt[-40:]!r}, the turn starts "
                    f"{alone[len(prompt) - 40 : len(prompt) + 20]!r}); this template cannot mark assistant "
                    f"tokens: give a `template` whose generation prompt matches its assistant turns (or, for "
                    f"an answer holding reasoning while enable_thinking is false, turn thinking on)"
                )
            return start, len(alone)
        turn = alone[_common_prefix(alone, prompt) :]
        # every form of the turn ends with its answer's last word
        last_word = re.split(r"[\s<>]", messages[i]["content"].rstrip())[-1]
        for k in range(len(turn)):
            if last_word not in turn[k:]:
                break
            if full.startswith(turn[k:], start):
                return start, start + len(turn) - k
        raise DataError(
            f"the chat template renders assistant message {i} in a way moetune cannot find in the whole "
            f"conversation (its generation prompt ends {prompt[-40:]!r}, the conversation continues "
            f"{full[start : start + 40]!r}); set mask_history: true to train on the last assistant turn only"
        )

    def encode(self, messages: Sequence[Message], *, turns: bool = False, **options: Any) -> Encoded:
        """Token ids and labels of a conversation (``options`` as for :meth:`trained_spans`); with ``turns``, the
        token ranges of its assistant turns too (what sft's truncation cuts by: finding a turn the trained spans
        did not need renders the conversation again)."""
        text, spans, found = self.trained_spans(messages, **options)
        found_turns = self._all_turns(messages, text, found) if turns else []
        return encode_spans(self.tokenizer, text, spans, add_special_tokens=False, turns=found_turns)


def _named_template(tokenizer: Any, name: str) -> str | None:
    """The Jinja source for LLaMA-Factory template ``name`` on ``tokenizer``: None (its own chat template)
    when it has one, else the name's fallback. Raises ``DataError`` when the name is another family's."""
    own = getattr(tokenizer, "chat_template", None)
    own = own if isinstance(own, str) else None  # a dict of named templates: check the vocabulary instead
    problem = family_problem(name, own, set(tokenizer.get_vocab()))
    if problem is not None:
        raise DataError(f"{problem} (tokenizer {getattr(tokenizer, 'name_or_path', '?')!r})")
    if own is not None:
        return None
    fallback = NAMED_TEMPLATES[name].fallback
    if fallback is None:
        raise DataError(
            f"template {name!r}: the tokenizer of {getattr(tokenizer, 'name_or_path', '?')!r} has no chat "
            f"template and moetune has no built-in one for {name!r} (built in: "
            f"{', '.join(n for n, t in NAMED_TEMPLATES.items() if t.fallback)}); give a Jinja template file"
        )
    log.info(
        "template %r: the tokenizer has no chat template; rendering with moetune's %s format", name, name
    )
    return fallback


class ExampleEncoder:
    """Turns validated :class:`Sample` s into token ids and labels with the config's label policy.

    ``config.template_name`` (a LLaMA-Factory name) is checked against the tokenizer's family here, before
    any model loads; it renders with the tokenizer's own chat template, or the name's fallback when the
    tokenizer has none, and supplies ``enable_thinking`` / ``default_system`` unless the config sets them.
    """

    def __init__(self, tokenizer: Any, config: DataConfig) -> None:
        self.tokenizer = tokenizer
        self.config = config
        named = NAMED_TEMPLATES[config.template_name] if config.template_name is not None else None
        # read now, so that `datasets`' cache fingerprint of this encoder covers the template's text
        self.template = (
            read_chat_template(config.template_file)
            if config.template_file is not None
            else _named_template(tokenizer, config.template_name)
            if config.template_name is not None
            else None
        )
        thinking = config.enable_thinking
        if thinking is None and named is not None:
            thinking = named.enable_thinking
        self.template_kwargs = {} if thinking is None else {"enable_thinking": thinking}
        self.default_system = config.default_system
        if self.default_system is None and named is not None:
            self.default_system = named.default_system
        self._renderer: ChatRenderer | None = None

    @property
    def renderer(self) -> ChatRenderer:
        """The chat renderer, built on first use (text-only data needs no chat template)."""
        if self._renderer is None:
            self._renderer = ChatRenderer(self.tokenizer, self.template, self.template_kwargs)
        return self._renderer

    def encode(self, sample: Sample, *, turns: bool = False) -> Encoded:
        """Token ids and labels of one sample, before truncation; ``turns``: a conversation's assistant turns'
        token ranges too (``Encoded.turns``)."""
        if sample.messages is not None:
            messages = sample.messages
            first_trained = sample.first_trained
            if self.default_system is not None and messages[0]["role"] != "system":
                messages = [{"role": "system", "content": self.default_system}, *messages]
                first_trained += 1
            return self.renderer.encode(
                messages,
                turns=turns,
                first_trained=first_trained,
                train_on_prompt=self.config.train_on_prompt,
                mask_history=self.config.mask_history,
            )
        assert sample.text is not None
        start = 0 if self.config.train_on_prompt else sample.trained_from
        spans = [(start, len(sample.text))] if start < len(sample.text) else []
        encoded = encode_spans(self.tokenizer, sample.text, spans, add_special_tokens=True)
        return append_eos(self.tokenizer, encoded)


def saved_chat_template(tokenizer: Any, config: DataConfig) -> str | None:
    """The chat template a run rendered its conversations with, for the tokenizer saved beside its adapter
    (``moetune generate`` / ``chat``, vLLM and SGLang render prompts with the saved one), or None where that is
    the tokenizer's own, unchanged. It is the config's template (a Jinja file, or a LLaMA-Factory name's built-in
    format) or the tokenizer's own, with the run's ``enable_thinking`` and ``default_system`` written in as its
    defaults (a caller's ``enable_thinking`` and a conversation's own system message still win), as
    LLaMA-Factory saves its template into the tokenizer."""
    import json

    encoder = ExampleEncoder(tokenizer, config)
    own = getattr(tokenizer, "chat_template", None)
    base = encoder.template if encoder.template is not None else own if isinstance(own, str) else None
    if base is None:
        return None
    prefix = ""
    if "enable_thinking" in encoder.template_kwargs:
        value = "true" if encoder.template_kwargs["enable_thinking"] else "false"
        prefix += (
            f"{{%- if enable_thinking is not defined %}}{{%- set enable_thinking = {value} %}}{{%- endif %}}"
        )
    if encoder.default_system is not None:  # a JSON string is a Jinja string literal
        system = json.dumps(encoder.default_system)
        prefix += (
            "{%- if not messages or messages[0]['role'] != 'system' %}"
            f"{{%- set messages = [{{'role': 'system', 'content': {system}}}] + messages %}}{{%- endif %}}"
        )
    if encoder.template is None and not prefix:
        return None
    return prefix + base
