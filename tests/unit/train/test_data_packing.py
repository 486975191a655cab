"""Label placement under real tokenizers and templates, packing, and the padding collator."""

from __future__ import annotations

from typing import Any

import datasets
import pytest
import torch

from moetune.errors import DataError
from moetune.train.packing import PACKED_COLUMNS, PadCollator, pack
from moetune.train.templates import IGNORE_INDEX, ChatRenderer, encode_spans

datasets.disable_progress_bars()

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there!"},
    {"role": "assistant", "content": " Hello, friend.\n"},
    {"role": "user", "content": "What is 2+3?"},
    {"role": "assistant", "content": "5"},
]


@pytest.fixture(scope="module")
def bpe() -> Any:
    """A byte-level BPE tokenizer trained on a few strings, with ChatML special tokens (Qwen-like)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = ["system user assistant You are terse. Hi there! Hello, friend. What is 2+3? 5 \n\n"] * 20
    backend.train_from_iterator(text, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    return tok


def trained_text(tok: Any, labels: list[int]) -> list[str]:
    """The trained stretches of a label sequence, each decoded."""
    runs, run = [], []
    for label in [*labels, IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            run.append(label)
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs


def test_byte_level_bpe_labels_are_exactly_the_assistant_turns(bpe: Any) -> None:
    enc = ChatRenderer(bpe).encode(CONVERSATION)
    assert enc.input_ids == bpe.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False)
    assert trained_text(bpe, enc.labels) == [" Hello, friend.\n<|im_end|>\n", "5<|im_end|>\n"]


def test_label_policies(bpe: Any) -> None:
    renderer = ChatRenderer(bpe)
    assert trained_text(bpe, renderer.encode(CONVERSATION, mask_history=True).labels) == ["5<|im_end|>\n"]
    everything = renderer.encode(CONVERSATION, train_on_prompt=True)
    assert everything.labels == everything.input_ids
    last_turn = renderer.encode(CONVERSATION, train_on_prompt=True, mask_history=True)
    assert trained_text(bpe, last_turn.labels) == [
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
    ]
    skip_first = renderer.encode(CONVERSATION, first_trained=3)
    assert trained_text(bpe, skip_first.labels) == ["5<|im_end|>\n"]


def test_template_that_rewrites_history_is_reported(bpe: Any) -> None:
    """Earlier turns render differently once later turns follow, and not as a tail of their last-turn form
    (here: trimmed), so their spans cannot be found; reasoning templates that drop earlier turns' thinking
    are handled (tests/unit/train/test_named_templates.py)."""
    rewriting = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'] | trim }}{% else %}{{ m['content'] }}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    renderer = ChatRenderer(bpe, rewriting)
    with pytest.raises(
        DataError, match="renders assistant message 2 in a way moetune cannot find.*mask_history: true"
    ):
        renderer.encode(CONVERSATION)
    assert trained_text(bpe, renderer.encode(CONVERSATION, mask_history=True).labels) == ["5<|im_end|>\n"]


def test_generation_prompt_that_does_not_match_the_turns_is_reported(bpe: Any) -> None:
    thinking = CHATML.replace(
        "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\nthink\n{% endif %}"
    )
    with pytest.raises(DataError, match="generation prompt for message 2 is not how it renders"):
        ChatRenderer(bpe, thinking).encode(CONVERSATION)


def test_template_errors_and_missing_assistant(bpe: Any) -> None:
    strict = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
        + CHATML
    )
    with pytest.raises(DataError, match="the chat template failed: first must be user"):
        ChatRenderer(bpe, strict).encode(CONVERSATION)
    with pytest.raises(DataError, match="no assistant turn"):
        ChatRenderer(bpe).encode(CONVERSATION[:2])


def test_spans_overlap_rules(bpe: Any) -> None:
    text = "Hello, friend."
    enc = encode_spans(bpe, text, [(3, 5)], add_special_tokens=False)  # "lo" inside a token: it is trained
    assert 1 <= sum(label != IGNORE_INDEX for label in enc.labels) <= 2
    assert encode_spans(bpe, text, [], add_special_tokens=False).labels == [IGNORE_INDEX] * len(enc.labels)
    full = encode_spans(bpe, text, [(0, len(text))], add_special_tokens=False)
    assert full.labels == full.input_ids


def examples(lengths: list[int]) -> datasets.Dataset:
    rows: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for n, length in enumerate(lengths):
        ids = [10 * n + i + 1 for i in range(length)]
        rows["input_ids"].append(ids)
        rows["attention_mask"].append([1] * length)
        rows["labels"].append([IGNORE_INDEX] * (length // 2) + ids[length // 2 :])
    return datasets.Dataset.from_dict(rows)


def test_packing_fills_rows_and_restarts_positions() -> None:
    lengths = [7, 3, 5, 2, 6, 4, 1]
    packed = pack(examples(lengths), cutoff_len=8)
    assert tuple(packed.column_names) == PACKED_COLUMNS
    rows = packed.to_list()
    assert all(len(r["input_ids"]) <= 8 for r in rows)
    assert sum(len(r["input_ids"]) for r in rows) == sum(lengths)
    assert len(rows) == 4  # 28 tokens in rows of 8: the best possible
    seen = []
    for r in rows:
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0]
        for a, b in zip(starts, [*starts[1:], len(r["input_ids"])]):
            assert r["position_ids"][a:b] == list(range(b - a))
            assert r["labels"][a] == IGNORE_INDEX  # never predict an example from the one before it
            seen.append(b - a)
    assert sorted(seen) == sorted(lengths)


def test_collator_pads_unpacked_and_packed_batches() -> None:
    collate = PadCollator(pad_token_id=0, pad_to_multiple_of=4)
    batch = collate(
        [
            {"input_ids": [5, 6, 7], "attention_mask": [1, 1, 1], "labels": [-100, 6, 7]},
            {"input_ids": [8], "attention_mask": [1], "labels": [8]},
        ]
    )
    assert batch["input_ids"].tolist() == [[5, 6, 7, 0], [8, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100], [8, -100, -100, -100]]
    assert batch["input_ids"].dtype == torch.long
    packed = PadCollator(pad_token_id=0)(
        [
            {"input_ids": [1, 2, 3], "labels": [-100, 2, 3], "position_ids": [0, 1, 0]},
            {"input_ids": [4], "labels": [-100], "position_ids": [0]},
        ]
    )
    assert packed["position_ids"].tolist() == [[0, 1, 0], [0, 0, 1]]  # padding is a sequence of its own
    assert "attention_mask" not in packed


def test_packed_examples_do_not_attend_to_each_other() -> None:
    """A packed row (position_ids restarting, no attention_mask, no cache) gives each example the logits
    it has alone: transformers turns the position_ids into a block-diagonal causal mask."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
    )
    model = LlamaForCausalLM(config).eval()
    packed = pack(examples([5, 7, 3]), cutoff_len=16)
    assert len(packed) == 1
    batch = PadCollator(pad_token_id=0)(packed.to_list())
    with torch.no_grad():
        together = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        row = packed[0]
        starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
        for a, b in zip(starts, starts[1:]):
            alone = model(input_ids=torch.tensor([row["input_ids"][a:b]])).logits[0]
            torch.testing.assert_close(together[a:b], alone, rtol=1e-5, atol=1e-5)
