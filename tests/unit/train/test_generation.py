"""``moetune.train.generation.answer``: prompts rendered as user messages with the chat template, or, for a
tokenizer without one, given as written with a warning (it was silent)."""

from __future__ import annotations

import logging

import pytest

from moetune.train import generation
from tests.unit.train.test_data import word_tokenizer


@pytest.mark.parametrize("template", [True, False])
def test_prompts_without_a_chat_template_are_said(monkeypatch, caplog, template) -> None:
    tok = word_tokenizer() if template else word_tokenizer(chat_template=None)
    monkeypatch.setattr(generation, "complete", lambda model, tokenizer, texts, max_new_tokens: list(texts))
    with caplog.at_level(logging.WARNING, logger="moetune.train.generation"):
        got = generation.answer(None, tok, ["hi", "how are you"])
        raw = generation.answer(None, tok, ["hi"], chat=False)
    warned = [r for r in caplog.records if "has no chat template" in r.getMessage()]
    assert raw == ["hi"]
    if template:
        assert (
            got
            == [
                "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
                generation.render(tok, [{"role": "user", "content": "how are you"}]),
            ]
            and not warned
        )
    else:
        assert got == ["hi", "how are you"] and len(warned) == 1  # once per call; --raw asks for it, so none
