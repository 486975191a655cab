"""Greedy answers from a base model plus an optional adapter, and the demo's held-out exact-match metric."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def load_for_inference(
    model_dir: str | Path,
    adapter_dir: str | Path | None = None,
    *,
    trust_remote_code: bool = False,
    **load_kwargs: Any,
):
    """(model, tokenizer): ``moetune.load_model`` (fp32 on CPU unless told otherwise) plus ``adapter_dir`` if given.

    The tokenizer comes from ``adapter_dir`` when it holds one (``moetune train`` saves it there), else from
    ``model_dir``, told moetune's config as ``moetune train`` does (``hf.load_tokenizer``); ``trust_remote_code``
    reaches the tokenizer loader and ``load_model``.
    """
    from transformers import AutoTokenizer

    from moetune.adapters.load import load_model
    from moetune.loading.hf import load_tokenizer

    load_kwargs = {"dtype": "float32", **load_kwargs}
    has_tokenizer = adapter_dir is not None and (Path(adapter_dir) / "tokenizer_config.json").is_file()
    tokenizer = (
        AutoTokenizer.from_pretrained(str(adapter_dir), trust_remote_code=trust_remote_code)
        if has_tokenizer
        else load_tokenizer(model_dir, trust_remote_code)
    )
    model = load_model(model_dir, adapter=adapter_dir, trust_remote_code=trust_remote_code, **load_kwargs)
    return model.eval(), tokenizer


def render(tokenizer: Any, messages: Sequence[dict[str, str]]) -> str:
    """A conversation (``[{"role", "content"}, ...]``, last message the user's) as the prompt text of the
    tokenizer's chat template, ending where the assistant's reply starts."""
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=True)


@torch.no_grad()
def complete(model: Any, tokenizer: Any, texts: Sequence[str], *, max_new_tokens: int = 32) -> list[str]:
    """Greedy continuations of prompt ``texts`` (already rendered: no special tokens are added), batched."""
    tokenizer.padding_side = "left"  # generation appends on the right
    enc = tokenizer(list(texts), return_tensors="pt", padding=True, add_special_tokens=False)
    device = next(p.device for p in model.parameters())
    out = model.generate(
        input_ids=enc["input_ids"].to(device),
        attention_mask=enc["attention_mask"].to(device),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        use_cache=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    new = out[:, enc["input_ids"].shape[1] :]
    return [t.strip() for t in tokenizer.batch_decode(new, skip_special_tokens=True)]


def answer(
    model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int = 32, chat: bool = True
) -> list[str]:
    """Greedy answers to ``prompts`` (each a user message rendered with the chat template when ``chat``; a
    tokenizer without one gets the prompts as written, which a warning says)."""
    use_template = chat and tokenizer.chat_template
    if chat and not use_template:
        log.warning(
            "the tokenizer has no chat template: the prompts go to the model as written, not as user messages "
            "(give an adapter folder whose tokenizer has one, or --raw to ask for the plain prompts)"
        )
    texts = [render(tokenizer, [{"role": "user", "content": p}]) if use_template else p for p in prompts]
    return complete(model, tokenizer, texts, max_new_tokens=max_new_tokens)


def exact_match(model: Any, tokenizer: Any, rows: Sequence[dict[str, str]], *, batch_size: int = 50) -> float:
    """Fraction of alpaca ``rows`` whose greedy answer equals ``output`` exactly (prompt: instruction, input)."""
    hits = 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i : i + batch_size]
        prompts = ["\n".join(x for x in (r["instruction"], r.get("input", "")) if x) for r in batch]
        answers = answer(model, tokenizer, prompts, max_new_tokens=12)
        hits += sum(a == r["output"] for a, r in zip(answers, batch))
    return hits / max(len(rows), 1)
