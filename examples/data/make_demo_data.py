"""Write the demo's tiny task: a letter cipher a tiny random MoE model learns in a few hundred LoRA steps.

Each row asks to ``encode`` four letters from a..h; the answer moves every letter SHIFT places along the
alphabet, wrapping round (``c a f b`` -> ``f d a e``). The model must attend from each answer position to
the matching input letter and map it: learnable from random weights, and the held-out rows use letter
strings the training rows never show, so a falling held-out loss means the rule was learned, not the rows.

Writes, next to this script (deterministic; rerun to regenerate):

* ``demo_train.json`` (TRAIN_ROWS rows) and ``demo_heldout.json`` (HELDOUT_ROWS rows), alpaca format;
* ``dataset_info.json`` registering both as ``demo_train`` / ``demo_heldout``, and the stage examples' data
  in LLaMA-Factory's own forms (docs/stages.md): ``demo_pt`` (plain text, ``columns: {prompt: text}``),
  ``demo_dpo`` (sharegpt pairs, ``ranking: true``: the cipher's answer chosen, the letters shifted by another
  amount rejected) and ``demo_kto`` (OpenAI-style messages with a true/false ``label`` as kto_tag);
  other entries are kept (``lf_chat``, the multi-turn rows of the LLaMA-Factory-form examples);
* ``demo_tokenizer/``: a word-level tokenizer over exactly the words the data uses, with a chat template,
  for the demo's generated model (``AutoTokenizer.from_pretrained("examples/data/demo_tokenizer")``).

Run: ``python examples/data/make_demo_data.py``.
"""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

LETTERS = "abcdefgh"
LENGTH = 4
SHIFT = 3
TRAIN_ROWS = 1500
HELDOUT_ROWS = 100
SEED = 0
INSTRUCTION = "encode"

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
WORDS = ["system", "user", "assistant", ":", INSTRUCTION, *LETTERS]
# role : content </s>, one turn after another; the generation prompt is "assistant : "
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }} : {{ message['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def encode(word: str) -> str:
    """The answer for ``word`` (letters separated by spaces)."""
    return " ".join(LETTERS[(LETTERS.index(ch) + SHIFT) % len(LETTERS)] for ch in word.split())


def rows() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, held-out) alpaca rows over disjoint letter strings."""
    words = [" ".join(w) for w in itertools.product(LETTERS, repeat=LENGTH)]
    random.Random(SEED).shuffle(words)
    make = [{"instruction": INSTRUCTION, "input": w, "output": encode(w)} for w in words]
    return make[:TRAIN_ROWS], make[TRAIN_ROWS : TRAIN_ROWS + HELDOUT_ROWS]


STAGE_ROWS = 64  # rows of each stage example's dataset
WRONG_SHIFT = 1  # the rejected / undesirable answers shift by this instead of SHIFT


def shifted(word: str, shift: int) -> str:
    """``word``'s letters moved ``shift`` places along the alphabet."""
    return " ".join(LETTERS[(LETTERS.index(ch) + shift) % len(LETTERS)] for ch in word.split())


def stage_rows(train: list[dict[str, str]]) -> dict[str, list[dict]]:
    """The pt, dpo and kto example rows, built from the first STAGE_ROWS training words."""
    words = [row["input"] for row in train[:STAGE_ROWS]]
    pt = [{"text": f"{w} {encode(w)}"} for w in words]
    dpo = [
        {
            "conversations": [{"from": "human", "value": f"{INSTRUCTION} {w}"}],
            "chosen": {"from": "gpt", "value": encode(w)},
            "rejected": {"from": "gpt", "value": shifted(w, WRONG_SHIFT)},
        }
        for w in words
    ]
    kto = [
        {
            "messages": [
                {"role": "user", "content": f"{INSTRUCTION} {w}"},
                {"role": "assistant", "content": encode(w) if k % 2 == 0 else shifted(w, WRONG_SHIFT)},
            ],
            "label": k % 2 == 0,
        }
        for k, w in enumerate(words)
    ]
    return {"demo_pt": pt, "demo_dpo": dpo, "demo_kto": kto}


STAGE_INFO = {  # LLaMA-Factory's dataset_info.json entries for the stage examples
    "demo_pt": {"file_name": "demo_pt.jsonl", "columns": {"prompt": "text"}},
    "demo_dpo": {
        "file_name": "demo_dpo.json",
        "ranking": True,
        "formatting": "sharegpt",
        "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
    },
    "demo_kto": {
        "file_name": "demo_kto.json",
        "formatting": "sharegpt",
        "columns": {"messages": "messages", "kto_tag": "label"},
        "tags": {
            "role_tag": "role",
            "content_tag": "content",
            "user_tag": "user",
            "assistant_tag": "assistant",
        },
    },
}


def demo_tokenizer():
    """A word-level tokenizer over the demo's words, with the chat template set."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def main(out: Path = Path(__file__).parent) -> None:
    train, heldout = rows()
    for name, data in (("demo_train", train), ("demo_heldout", heldout)):
        (out / f"{name}.json").write_text("[\n" + ",\n".join(json.dumps(row) for row in data) + "\n]\n")
    for name, data in stage_rows(train).items():
        path = out / STAGE_INFO[name]["file_name"]
        if path.suffix == ".jsonl":
            path.write_text("".join(json.dumps(row) + "\n" for row in data))
        else:
            path.write_text("[\n" + ",\n".join(json.dumps(row) for row in data) + "\n]\n")
    path = out / "dataset_info.json"
    info = json.loads(path.read_text()) if path.is_file() else {}  # keeps other entries (lf_chat)
    info.update(
        {
            name: {"file_name": f"{name}.json", "formatting": "alpaca"}
            for name in ("demo_train", "demo_heldout")
        }
    )
    info.update(STAGE_INFO)
    path.write_text(json.dumps(info, indent=2) + "\n")
    demo_tokenizer().save_pretrained(out / "demo_tokenizer")


if __name__ == "__main__":
    main()
