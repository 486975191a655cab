"""The data pipeline: local files in every supported format -> input_ids / attention_mask / labels."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import datasets
import pytest

from moetune.config import parse_config
from moetune.errors import DataError
from moetune.train.data import prepare_datasets
from moetune.train.templates import IGNORE_INDEX

datasets.disable_progress_bars()

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = [
    *("system", "user", "assistant", "tool", "be", "brief", "hi", "hello", "how", "are", "you", "fine"),
    *("thanks", "and", "good", "bye", "what", "is", "two", "plus", "three", "five", "encode", "sum", "of"),
    *("the", "numbers", "once", "upon", "time", "story", "end", "a", "b", "c", "d", "e", "f", "g", "h"),
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def word_tokenizer(chat_template: str | None = CHATML) -> Any:
    """A word-level fast tokenizer over WORDS with ChatML special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = chat_template
    return tok


@pytest.fixture(scope="module")
def tok() -> Any:
    return word_tokenizer()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    return tmp_path


def write(path: Path, rows: list[dict[str, Any]]) -> str:
    """Write ``rows`` as JSON (a list) or JSON lines, by suffix; returns the path as a string."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        path.write_text(json.dumps(rows))
    return str(path)


def prepare(tok: Any, dataset: str, **keys: Any) -> Any:
    raw = {"model_name_or_path": "m", "dataset": dataset, "output_dir": "out", **keys}
    cfg = parse_config(raw, check_model_path=False)
    return prepare_datasets(cfg.data, tok, seed=0, cache_dir="hf_cache")


def trained(tok: Any, example: dict[str, list[int]]) -> str:
    """The trained tokens of an example, as text."""
    return " ".join(tok.convert_ids_to_tokens([t for t in example["labels"] if t != IGNORE_INDEX]))


def tokens(tok: Any, example: dict[str, list[int]]) -> str:
    return " ".join(tok.convert_ids_to_tokens(example["input_ids"]))


def test_alpaca_trains_on_the_response_only(workdir: Path, tok: Any) -> None:
    rows = [
        {"instruction": "encode", "input": "a b", "output": "d e", "system": "be brief"},
        {
            "instruction": "what is two plus three",
            "input": "",
            "output": "five",
            "history": [["hi", "hello"], ["how are you", "fine thanks"]],
        },
    ]
    data = prepare(tok, write(workdir / "alpaca.json", rows))
    first, second = data.train[0], data.train[1]
    assert set(data.train.column_names) == {"input_ids", "attention_mask", "labels"}
    assert tokens(tok, first) == (
        "<|im_start|> system be brief <|im_end|> <|im_start|> user encode a b <|im_end|> "
        "<|im_start|> assistant d e <|im_end|>"
    )
    assert trained(tok, first) == "d e <|im_end|>"
    assert trained(tok, second) == "hello <|im_end|> fine thanks <|im_end|> five <|im_end|>"
    assert first["attention_mask"] == [1] * len(first["input_ids"])
    assert data.eval is None


def test_sharegpt_openai_and_label_policies(workdir: Path, tok: Any) -> None:
    conversation = [
        {"from": "system", "value": "be brief"},
        {"from": "human", "value": "hi"},
        {"from": "gpt", "value": "hello"},
        {"from": "human", "value": "how are you"},
        {"from": "gpt", "value": "fine"},
    ]
    sharegpt = write(workdir / "sharegpt.json", [{"conversations": conversation}])
    openai = write(
        workdir / "openai.jsonl",
        [
            {
                "messages": [
                    {
                        "role": m["from"].replace("human", "user").replace("gpt", "assistant"),
                        "content": m["value"],
                    }
                    for m in conversation
                ]
            }
        ],
    )
    for path in (sharegpt, openai):
        assert trained(tok, prepare(tok, path).train[0]) == "hello <|im_end|> fine <|im_end|>"
    assert trained(tok, prepare(tok, sharegpt, mask_history=True).train[0]) == "fine <|im_end|>"
    everything = prepare(tok, sharegpt, train_on_prompt=True).train[0]
    assert everything["labels"] == everything["input_ids"]


def test_dataset_info_columns_and_tags(workdir: Path, tok: Any) -> None:
    rows = [
        {"dialog": [{"speaker": "U", "text": "hi"}, {"speaker": "A", "text": "hello"}], "sys": "be brief"},
        {"dialog": [{"speaker": "U", "text": "hi"}, {"speaker": "A", "text": "bye"}], "sys": None},
    ]
    write(workdir / "data" / "custom.json", rows)
    info = {
        "custom": {
            "file_name": "custom.json",
            "formatting": "sharegpt",
            "columns": {"messages": "dialog", "system": "sys"},
            "tags": {"role_tag": "speaker", "content_tag": "text", "user_tag": "U", "assistant_tag": "A"},
        }
    }
    (workdir / "data" / "dataset_info.json").write_text(json.dumps(info))
    data = prepare(tok, "custom")
    assert tokens(tok, data.train[0]).startswith("<|im_start|> system be brief <|im_end|>")
    assert trained(tok, data.train[1]) == "bye <|im_end|>"


def test_prompt_completion_and_text(workdir: Path, tok: Any) -> None:
    pc = prepare(
        tok, write(workdir / "pc.json", [{"prompt": "what is two plus three ", "completion": "five"}])
    )
    assert tokens(tok, pc.train[0]) == "what is two plus three five </s>"
    assert trained(tok, pc.train[0]) == "five </s>"
    conversational = [
        {
            "prompt": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "how are you"},
            ],
            "completion": [{"role": "assistant", "content": "fine"}],
        }
    ]
    conv = prepare(tok, write(workdir / "pc_chat.json", conversational))
    assert trained(tok, conv.train[0]) == "fine <|im_end|>"  # the assistant turn in the prompt is not trained
    text = prepare(tok, write(workdir / "text.jsonl", [{"text": "once upon a time"}]))
    assert tokens(tok, text.train[0]) == "once upon a time </s>"
    assert text.train[0]["labels"] == text.train[0]["input_ids"]


def test_parquet_and_saved_datasets(workdir: Path, tok: Any) -> None:
    rows = [{"instruction": "encode", "input": "a", "output": "d"}] * 3
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(workdir / "rows.parquet"))
    ds.save_to_disk(str(workdir / "saved"))
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(workdir / "saved_dict"))
    for name in ("rows.parquet", "saved", "saved_dict"):
        assert len(prepare(tok, name).train) == 3
    (workdir / "data" / "dataset_info.json").write_text(
        json.dumps(
            {
                "held": {"file_name": "../saved_dict", "split": "test"},
                "nosplit": {"file_name": "../saved_dict", "split": "dev"},
            }
        )
    )
    assert len(prepare(tok, "held").train) == 1
    with pytest.raises(DataError, match=r"has splits \['test', 'train'\], not 'dev'"):
        prepare(tok, "nosplit")


def test_split_of_a_file_dataset(workdir: Path, tok: Any) -> None:
    """``split`` in dataset_info.json slices a file dataset as ``datasets.load_dataset`` does (LLaMA-Factory passes
    it there); another split name or a slice it cannot read is refused naming the field."""
    words = [*"abcdefgh", "the", "end"]
    write(workdir / "rows.json", [{"instruction": "hi", "output": w} for w in words])
    entries = {
        "head": "train[:4]",
        "tail": "train[70%:]",
        "whole": "train",
        "val": "validation",
        "odd": "train[:x]",
    }
    (workdir / "data" / "dataset_info.json").write_text(
        json.dumps({k: {"file_name": "../rows.json", "split": v} for k, v in entries.items()})
    )
    assert [trained(tok, r) for r in prepare(tok, "head").train] == [f"{w} <|im_end|>" for w in words[:4]]
    assert [trained(tok, r) for r in prepare(tok, "tail").train] == [f"{w} <|im_end|>" for w in words[7:]]
    assert len(prepare(tok, "whole").train) == 10
    with pytest.raises(
        DataError, match=r"split 'validation' in dataset_info.json; a dataset read from files"
    ):
        prepare(tok, "val")
    with pytest.raises(DataError, match=r"split 'train\[:x\]' in dataset_info.json is not a slice"):
        prepare(tok, "odd")


def test_folder_of_files_several_datasets_and_max_samples(workdir: Path, tok: Any) -> None:
    (workdir / "parts").mkdir()
    write(workdir / "parts" / "a.jsonl", [{"text": "once upon a time"}] * 4)
    write(workdir / "parts" / "b.jsonl", [{"text": "the end"}] * 2)
    write(workdir / "more.json", [{"instruction": "hi", "output": "hello"}] * 5)
    assert len(prepare(tok, "parts").train) == 6
    assert len(prepare(tok, "parts, more.json").train) == 11
    assert len(prepare(tok, "parts, more.json", max_samples=3).train) == 6


def test_rows_that_do_not_fit_are_reported_with_index_and_field(workdir: Path, tok: Any) -> None:
    rows = [{"instruction": "hi", "output": "hello"}] * 3
    rows[1] = {"instruction": "hi", "output": None}
    rows.append({"instruction": "hi", "output": "x", "history": [["only one"]]})
    rows.append({"instruction": "", "input": "", "output": "hello"})
    with pytest.raises(DataError) as info:
        prepare(tok, write(workdir / "bad.json", rows))
    text = str(info.value)
    assert "3 of 5 rows do not fit the alpaca format" in text
    assert "row 1: field 'output' is missing" in text
    assert "row 3: history[0] must be a [query, response] pair of strings" in text
    assert "row 4: fields 'instruction' and 'input' are empty" in text
    other = write(workdir / "other.jsonl", [{"text": None}])
    with pytest.raises(DataError) as info:
        prepare(tok, f"bad.json, {other}")  # every dataset's problems, in one error
    assert "row 1: field 'output' is missing" in str(info.value)
    assert "1 of 1 rows do not fit the text format:\n  - row 0: field 'text' is missing" in str(info.value)


def test_many_bad_rows_are_counted(workdir: Path, tok: Any) -> None:
    rows = [{"messages": [{"role": "user", "content": "hi"}]}] * 25  # no assistant turn
    rows += [{"messages": [{"role": "wizard", "content": "hi"}]}]
    with pytest.raises(DataError) as info:
        prepare(tok, write(workdir / "bad.jsonl", rows))
    text = str(info.value)
    assert (
        "26 of 26 rows do not fit the sharegpt format" in text and "... and 14 more" in text
    )  # the first LISTED (12) rows shown
    assert "row 0: field 'messages' has no assistant message to train on" in text
    assert "row 11:" in text and "row 12:" not in text


def test_sharegpt_message_problems(workdir: Path, tok: Any) -> None:
    rows = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "system", "value": "x"}]},
        {"conversations": []},
        {"conversations": [{"from": "gpt", "value": "d e"}, {"from": "human", "value": "encode a b"}]},
        {"conversations": [{"from": "system", "value": "be brief"}, {"from": "gpt", "value": "d"}]},
        {"conversations": [{"from": "gpt", "value": "d"}]},
    ]
    with pytest.raises(DataError) as info:
        prepare(tok, write(workdir / "bad.json", rows))
    text = str(info.value)
    # the template rendered nothing before such a turn (transformers: "empty conversation"), a traceback before
    opens = "field 'conversations' opens with an assistant message; a conversation starts with a user message"
    assert all(f"row {i}: {opens}" in text for i in (4, 5, 6)), text
    assert (
        "row 0: conversations[1].from is 'bot'; allowed: 'human', 'gpt', 'system', 'observation', 'function_call'"
        in text
    )
    assert "row 1: conversations[1].value is missing or not a string" in text
    assert "row 2: conversations[1] is a system message; only the first message may be one" in text
    assert "row 3: field 'conversations' must be a non-empty list of messages" in text


def test_unknown_layout_and_empty_dataset(workdir: Path, tok: Any) -> None:
    with pytest.raises(
        DataError, match=r"columns \['answer', 'question'\] do not fit any format \(alpaca needs"
    ):
        prepare(tok, write(workdir / "qa.json", [{"question": "hi", "answer": "hello"}]))
    for name, content in (("empty.jsonl", ""), ("empty.json", "[]")):
        (workdir / name).write_text(content)
        with pytest.raises(DataError, match=f"dataset '{name}' \\({name}\\) has no rows"):
            prepare(tok, name)


def test_no_rows_left_after_reading(workdir: Path, tok: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.train.data as data_module

    monkeypatch.setattr(
        data_module, "read_dataset", lambda spec, cache_dir: datasets.Dataset.from_dict({"text": []})
    )
    with pytest.raises(DataError, match="has no rows"):
        prepare(tok, write(workdir / "rows.json", [{"text": "hi"}]))


def test_cutoff_len_truncates_drops_and_fails(
    workdir: Path, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """LLaMA-Factory's rule (``infer_seqlen``), worked out by hand on the word tokenizer's ChatML: the long prompt
    is 25 tokens (``<|im_start|> user a*20 <|im_end|> <|im_start|> assistant``) before a 2-token answer (``b
    <|im_end|>``); the short row 6 + 5."""
    long_prompt = {"instruction": " ".join(["a"] * 20), "output": "b"}
    short = {"instruction": "hi", "output": "hello how are you"}
    path = write(workdir / "mixed.json", [long_prompt, short])
    with caplog.at_level(logging.WARNING, logger="moetune.train.data"):
        data = prepare(tok, path, cutoff_len=10)
    # an answer under half the budget is kept whole, the prompt gets the rest (8 of 25)
    assert tokens(tok, data.train[0]) == "<|im_start|> user a a a a a a b <|im_end|>"
    assert trained(tok, data.train[0]) == "b <|im_end|>"
    # neither under half: the answer's share int(10 * 5 / 11) = 4, the prompt whole
    assert (
        tokens(tok, data.train[1])
        == "<|im_start|> user hi <|im_end|> <|im_start|> assistant hello how are you"
    )
    assert "2 of 2 rows are longer than cutoff_len 10 and are cut to it" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moetune.train.data"):
        data = prepare(tok, path, cutoff_len=4)  # the long row's answer share int(4 * 2 / 27) = 0: dropped
    assert len(data.train) == 1 and tokens(tok, data.train[0]) == "<|im_start|> user hi hello"
    assert "dropped 1 of 2 rows whose prompt leaves no trained token within cutoff_len 4" in caplog.text
    with pytest.raises(DataError) as info:
        prepare(tok, path, cutoff_len=2)
    assert "cutoff_len 2 leaves no trained token in any of the 2 rows" in str(info.value)
    assert "cutoff_len 7 keeps one for the row with the shortest prompt" in str(info.value)
    assert len(prepare(tok, path, cutoff_len=7).train) == 2  # the long row's 2-token answer under half of 7


def test_cutoff_len_cuts_turns_in_order_or_latest_first(workdir: Path, tok: Any) -> None:
    """Two turns (6 + 2, then 8 + 3 tokens) in 12: in order, the first turn whole and the second's pair shares
    the 4 left (answer int(4 * 3 / 11) = 1); with mask_history the last turn first (8 + 3) and the first pair gets
    the one token left, its answer none (LLaMA-Factory keeps the latest turns)."""
    turns = [("human", "hi"), ("gpt", "hello"), ("human", "how are you"), ("gpt", "fine thanks")]
    row = {"conversations": [{"from": f, "value": v} for f, v in turns]}
    path = write(workdir / "chat.json", [row])
    whole = prepare(tok, path, cutoff_len=32).train[0]
    assert len(whole["input_ids"]) == 19
    cut = prepare(tok, path, cutoff_len=12).train[0]
    assert tokens(tok, cut) == (
        "<|im_start|> user hi <|im_end|> <|im_start|> assistant hello <|im_end|> <|im_start|> user how fine"
    )
    assert trained(tok, cut) == "hello <|im_end|> fine"
    latest = prepare(tok, path, cutoff_len=12, mask_history=True).train[0]
    assert tokens(tok, latest) == (
        "<|im_start|> <|im_start|> user how are you <|im_end|> <|im_start|> assistant fine thanks <|im_end|>"
    )
    assert trained(tok, latest) == "fine thanks <|im_end|>"
    # plain text keeps its first cutoff_len tokens
    text = prepare(tok, write(workdir / "pt.json", [{"text": "once upon a time the end"}]), cutoff_len=3)
    assert tokens(tok, text.train[0]) == "once upon a"


def test_val_size_holds_out_rows(workdir: Path, tok: Any) -> None:
    path = write(workdir / "rows.json", [{"instruction": "hi", "output": w} for w in "abcdefgh" * 5])
    data = prepare(tok, path, val_size=0.25, eval_strategy="steps")
    assert (len(data.train), len(data.eval)) == (30, 10)
    data = prepare(tok, path, val_size=4, eval_strategy="steps")
    assert (len(data.train), len(data.eval)) == (36, 4)
    with pytest.raises(DataError, match="val_size 40 holds out every one of the 40"):
        prepare(tok, path, val_size=40, eval_strategy="steps")
    # a fraction that datasets rounds up to every row (ceil(0.99 * 40) = 40): its own ValueError before
    with pytest.raises(
        DataError, match="val_size 0.99 holds out every one of the 40 training rows, leaving none"
    ):
        prepare(tok, path, val_size=0.99, eval_strategy="steps")
    assert (
        len(prepare(tok, path, val_size=0.97, eval_strategy="steps").train) == 1
    )  # ceil(38.8) = 39 held out


def test_eval_dataset_is_never_packed(workdir: Path, tok: Any) -> None:
    path = write(workdir / "rows.json", [{"instruction": "hi", "output": "hello"}] * 6)
    data = prepare(tok, path, eval_dataset=path, eval_strategy="epoch", packing=True, cutoff_len=32)
    assert "position_ids" in data.train.column_names and len(data.train) == 2
    assert set(data.eval.column_names) == {"input_ids", "attention_mask", "labels"} and len(data.eval) == 6


def test_default_system_and_template_file(workdir: Path, tok: Any) -> None:
    path = write(workdir / "rows.json", [{"instruction": "hi", "output": "hello"}])
    data = prepare(tok, path, default_system="be brief")
    assert tokens(tok, data.train[0]).startswith("<|im_start|> system be brief <|im_end|>")
    (workdir / "plain.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    data = prepare(word_tokenizer(chat_template=None), path, template="plain.jinja")
    assert tokens(tok, data.train[0]) == "user hi </s> assistant hello </s>"
    assert trained(tok, data.train[0]) == "hello </s>"


def test_conversations_need_a_chat_template(workdir: Path) -> None:
    path = write(workdir / "rows.json", [{"instruction": "hi", "output": "hello"}])
    with pytest.raises(DataError, match="has no chat template") as info:
        prepare(word_tokenizer(chat_template=None), path)
    assert "a LLaMA-Factory name moetune has a built-in format for (" in str(info.value)
    assert "chatml" in str(info.value) and "llama3" in str(info.value)
    assert (
        len(prepare(word_tokenizer(chat_template=None), path, template="chatml").train) == 1
    )  # as it offers
    text = prepare(word_tokenizer(chat_template=None), write(workdir / "t.json", [{"text": "hi"}]))
    assert len(text.train) == 1  # plain text needs none


def test_demo_data(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The shipped demo: every row trains on its four answer letters and the end of turn; held-out letter
    strings never appear in training."""
    from transformers import AutoTokenizer

    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    cfg = parse_config(
        {
            "model_name_or_path": "m",
            "dataset": "demo_train",
            "eval_dataset": "demo_heldout",
            "dataset_dir": "examples/data",
            "output_dir": str(tmp_path / "out"),
            "eval_strategy": "steps",
        },
        check_model_path=False,
    )
    tok = AutoTokenizer.from_pretrained("examples/data/demo_tokenizer")
    data = prepare_datasets(cfg.data, tok, cache_dir=str(tmp_path / "cache"))
    assert len(data.train) >= 1000 and len(data.eval) >= 100
    assert "<unk>" not in tok.convert_ids_to_tokens(data.train["input_ids"][0])
    for split in (data.train, data.eval):
        assert all(sum(t != IGNORE_INDEX for t in labels) == 5 for labels in split["labels"])
    train_inputs = {tuple(ids) for ids in data.train["input_ids"]}
    assert not train_inputs & {tuple(ids) for ids in data.eval["input_ids"]}


def test_pretraining_rows_under_sft_are_explained(
    workdir: Path, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """LLaMA-Factory's pre-training layout (`columns: {prompt: text}`) is never read silently as something else."""
    write(workdir / "data" / "pt.json", [{"text": "once upon a time"}])
    (workdir / "data" / "dataset_info.json").write_text(
        json.dumps({"pt": {"file_name": "pt.json", "columns": {"prompt": "text"}}})
    )
    with pytest.raises(DataError, match=r"text reads no prompt column.*pre-training layout \(stage pt\)"):
        prepare(tok, "pt")
    with caplog.at_level(logging.WARNING):
        prepare(tok, write(workdir / "t.json", [{"text": "once upon a time"}]))
    assert "every token is trained, as in pre-training" in caplog.text


def test_media_columns_are_refused_and_media_knobs_logged(
    workdir: Path, tok: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [
        {
            "messages": [{"role": "user", "content": "<image> hi"}, {"role": "assistant", "content": "a"}],
            "images": ["x.png"],
        }
    ]
    with pytest.raises(DataError, match="has 'images' data: multimodal training is not supported"):
        prepare(tok, write(workdir / "mm.json", rows))
    with caplog.at_level(logging.WARNING):
        prepare(tok, write(workdir / "t.json", [{"text": "hi"}]), image_max_pixels=262144)
    assert "image_max_pixels: 262144 has no effect: moetune trains on text rows only" in caplog.text
