"""Stage data: LLaMA-Factory's preference (``ranking``), KTO (``kto_tag``) and pre-training (``columns: {prompt:
text}``) rows -> token ids, on the sft data path; and the config checks that pair each stage with its data."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pytest

from moetune.config import parse_config
from moetune.errors import ConfigError, DataError
from moetune.train.data import TEXT, prepare_datasets
from moetune.train.preference import PAIRED, UNPAIRED
from moetune.train.templates import IGNORE_INDEX
from tests.unit.train.test_data import word_tokenizer

datasets.disable_progress_bars()

PROMPT = "<|im_start|>user\nencode a b<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok() -> Any:
    return word_tokenizer()


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    return tmp_path


def _config(workdir: Path, info: dict[str, Any], rows: dict[str, list], **keys: Any) -> Any:
    for name, entry in info.items():
        data = rows[name]
        path = workdir / "data" / entry["file_name"]
        if path.suffix == ".jsonl":
            path.write_text("".join(json.dumps(r) + "\n" for r in data))
        else:
            path.write_text(json.dumps(data))
    (workdir / "data" / "dataset_info.json").write_text(json.dumps(info))
    raw = {
        "model_name_or_path": "m",
        "dataset": ",".join(info),
        "output_dir": "out",
        "per_device_train_batch_size": 2,
        **keys,
    }
    return parse_config(raw, check_model_path=False)


ALPACA_PAIRS = {
    "file_name": "pairs.json",
    "ranking": True,
    "columns": {"prompt": "instruction", "query": "input"},
}
SHAREGPT_PAIRS = {
    "file_name": "sg.json",
    "ranking": True,
    "formatting": "sharegpt",
    "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"},
}


def test_alpaca_and_sharegpt_pairs_share_the_prompt_and_split_at_the_response(
    workdir: Path, tok: Any
) -> None:
    rows = {
        "pairs": [{"instruction": "encode", "input": "a b", "chosen": "d e", "rejected": "b c f"}],
        "sg": [
            {
                "conversations": [{"from": "human", "value": "encode a b"}],
                "chosen": {"from": "gpt", "value": "d e"},
                "rejected": {"from": "gpt", "value": "b c f"},
            }
        ],
    }
    cfg = _config(workdir, {"pairs": ALPACA_PAIRS, "sg": SHAREGPT_PAIRS}, rows, stage="dpo")
    data = prepare_datasets(cfg.data, tok, codec=PAIRED, cache_dir=str(workdir / "cache"))
    assert data.collator is None and data.train.column_names == ["prompt_ids", "chosen_ids", "rejected_ids"]
    for row in data.train:  # both forms give the same tokens: the prompt rendered with the generation prompt
        assert tok.convert_ids_to_tokens(row["chosen_ids"]) == ["d", "e", "<|im_end|>"]
        assert tok.convert_ids_to_tokens(row["rejected_ids"]) == ["b", "c", "f", "<|im_end|>"]
        assert tok.convert_ids_to_tokens(row["prompt_ids"]) == tok.tokenize(PROMPT)


def test_pairs_are_cut_by_llamafactory_s_rule(workdir: Path, tok: Any) -> None:
    """LLaMA-Factory's rule for a pair (``infer_seqlen`` on the prompt and the longer response), worked out by hand:
    the prompt (8 tokens) before responses of 3 and 4 in 10 keeps 6 (the longer response is under half of 10);
    a 16-token prompt before 2-token responses keeps 8; in 2, both lose their responses (int(2 * 4 / 12) = 0)."""
    rows = {
        "pairs": [
            {"instruction": "encode", "input": "a b", "chosen": "d e", "rejected": "b c f"},
            {"instruction": "encode", "input": "a b c d e f g h a b", "chosen": "d", "rejected": "b"},
        ]
    }
    assert len(tok.tokenize(PROMPT)) == 8
    cfg = _config(workdir, {"pairs": ALPACA_PAIRS}, rows, stage="dpo", cutoff_len=10)
    data = prepare_datasets(cfg.data, tok, codec=PAIRED, cache_dir=str(workdir / "cache"))
    first, second = data.train
    assert tok.convert_ids_to_tokens(first["prompt_ids"]) == tok.tokenize(PROMPT)[:6]
    assert tok.convert_ids_to_tokens(first["rejected_ids"]) == ["b", "c", "f", "<|im_end|>"]
    assert tok.convert_ids_to_tokens(first["chosen_ids"]) == ["d", "e", "<|im_end|>"]
    assert len(second["prompt_ids"]) == 8 and tok.convert_ids_to_tokens(second["chosen_ids"]) == [
        "d",
        "<|im_end|>",
    ]
    cfg = _config(workdir, {"pairs": ALPACA_PAIRS}, rows, stage="dpo", cutoff_len=2)
    with pytest.raises(DataError, match="cutoff_len 2 leaves no trained token"):
        prepare_datasets(cfg.data, tok, codec=PAIRED, cache_dir=str(workdir / "cache"))


def test_bad_preference_rows_are_reported_with_row_and_field(workdir: Path, tok: Any) -> None:
    good = {
        "conversations": [{"from": "human", "value": "encode a b"}],
        "chosen": {"from": "gpt", "value": "d e"},
        "rejected": {"from": "gpt", "value": "b c"},
    }
    rows = {
        "sg": [
            good,
            {**good, "conversations": [*good["conversations"], {"from": "gpt", "value": "d"}]},
            {**good, "chosen": "d e"},
            {**good, "rejected": {"from": "human", "value": "b c"}},
        ]
    }
    cfg = _config(workdir, {"sg": SHAREGPT_PAIRS}, rows, stage="dpo")
    with pytest.raises(DataError) as info:
        prepare_datasets(cfg.data, tok, codec=PAIRED, cache_dir=str(workdir / "cache"))
    text = str(info.value)
    assert "3 of 4 rows do not fit the sharegpt format with chosen/rejected responses (ranking)" in text
    assert "row 1: field 'conversations' must end with a user message" in text
    assert "row 2: field 'chosen' must be one message ('from': 'gpt', 'value': ...)" in text
    assert "row 3: field 'rejected' must be an assistant message, got role 'user'" in text


def test_missing_pair_columns_name_the_roles(workdir: Path, tok: Any) -> None:
    rows = {"pairs": [{"instruction": "encode", "input": "a b", "output": "d e"}]}
    cfg = _config(workdir, {"pairs": ALPACA_PAIRS}, rows, stage="dpo")
    with pytest.raises(DataError, match=r"alpaca needs chosen \(chosen\), rejected \(rejected\)"):
        prepare_datasets(cfg.data, tok, codec=PAIRED, cache_dir=str(workdir / "cache"))


KTO_INFO = {
    "file_name": "kto.json",
    "formatting": "sharegpt",
    "columns": {"messages": "messages", "kto_tag": "label"},
    "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"},
}


def test_kto_rows_split_at_the_last_response_and_keep_their_tag(workdir: Path, tok: Any) -> None:
    def row(answer: str, label: Any) -> dict[str, Any]:
        chat = [{"role": "user", "content": "encode a b"}, {"role": "assistant", "content": answer}]
        return {"messages": chat, "label": label}

    cfg = _config(workdir, {"kto": KTO_INFO}, {"kto": [row("d e", True), row("b c f", False)]}, stage="kto")
    data = prepare_datasets(cfg.data, tok, codec=UNPAIRED, cache_dir=str(workdir / "cache"))
    assert data.train["label"] == [True, False]
    assert [tok.convert_ids_to_tokens(r) for r in data.train["completion_ids"]] == [
        ["d", "e", "<|im_end|>"],
        ["b", "c", "f", "<|im_end|>"],
    ]
    assert all(tok.convert_ids_to_tokens(p) == tok.tokenize(PROMPT) for p in data.train["prompt_ids"])
    # cut by LLaMA-Factory's rule: prompt 8 before 3 in 8: the response under half, whole; the prompt keeps 5
    # (its start); before 4 in 8: neither under half, int(8 * 4 / 12) = 2 to the response
    cfg = _config(
        workdir,
        {"kto": KTO_INFO},
        {"kto": [row("d e", True), row("b c f", False)]},
        stage="kto",
        cutoff_len=8,
    )
    cut = prepare_datasets(cfg.data, tok, codec=UNPAIRED, cache_dir=str(workdir / "cache")).train
    assert [tok.convert_ids_to_tokens(r) for r in cut["completion_ids"]] == [
        ["d", "e", "<|im_end|>"],
        ["b", "c"],
    ]
    assert [tok.convert_ids_to_tokens(r) for r in cut["prompt_ids"]] == [
        tok.tokenize(PROMPT)[:5],
        tok.tokenize(PROMPT)[:6],
    ]
    bad = {"kto": [row("d e", "yes"), {"messages": [{"role": "user", "content": "a"}], "label": "no"}]}
    cfg = _config(workdir, {"kto": KTO_INFO}, bad, stage="kto")
    with pytest.raises(DataError) as info:
        prepare_datasets(cfg.data, tok, codec=UNPAIRED, cache_dir=str(workdir / "cache"))
    assert "row 0: field 'label' (kto_tag) must be true or false, got 'yes'" in str(info.value)
    assert "row 1: field 'messages' has no assistant message" in str(info.value)


def test_pretraining_text_in_llamafactory_form_trains_every_token(workdir: Path, tok: Any) -> None:
    """LLaMA-Factory registers pre-training text as an alpaca entry whose `prompt` column holds the text."""
    info = {"c4": {"file_name": "c4.jsonl", "columns": {"prompt": "content"}}}
    cfg = _config(
        workdir, info, {"c4": [{"content": "once upon a time"}, {"content": "the end"}]}, stage="pt"
    )
    data = prepare_datasets(cfg.data, tok, codec=TEXT, cache_dir=str(workdir / "cache"))
    for ids, labels in zip(data.train["input_ids"], data.train["labels"]):
        assert tok.convert_ids_to_tokens(ids)[-1] == "</s>" and labels == ids  # no template, all trained
        assert "<|im_start|>" not in tok.convert_ids_to_tokens(ids)
    assert IGNORE_INDEX not in sum(data.train["labels"], [])


@pytest.mark.parametrize(
    ("stage", "keys", "message"),
    [
        ("dpo", {"dataset": "plain"}, "dataset 'plain' is not a preference dataset, and stage dpo trains on"),
        ("sft", {"dataset": "pairs"}, "dataset 'pairs' is a preference dataset (ranking: true), which only"),
        ("kto", {"dataset": "pairs"}, "which only stage dpo reads"),
        ("sft", {"dataset": "kto"}, "maps a kto_tag column, which only stage kto reads"),
        (
            "dpo",
            {"dataset": "pairs", "packing": True},
            "packing: is true but stage 'dpo' scores whole responses",
        ),
        ("kto", {"dataset": "kto", "train_on_prompt": True}, "train_on_prompt: is true but stage 'kto'"),
        ("kto", {"dataset": "kto", "per_device_train_batch_size": 1}, "set it to 2 or more"),
        (
            "kto",
            {"dataset": "kto", "pref_ftx": 0.5},
            "pref_ftx: is set but stage is 'kto'; it applies to stage dpo",
        ),
        (
            "dpo",
            {"dataset": "pairs", "kto_rejected_weight": 2},
            "kto_rejected_weight: is set but stage is 'dpo'",
        ),
        ("pt", {"dataset": "sg"}, "has formatting 'sharegpt', and stage pt reads one plain text per row"),
        (
            "pt",
            {"dataset": "plain", "default_system": "be brief"},
            "default_system: is set but stage 'pt' trains",
        ),
    ],
)
def test_stage_and_data_mismatches_are_config_errors(
    workdir: Path, stage: str, keys: dict[str, Any], message: str
) -> None:
    info = {
        "plain": {"file_name": "plain.json", "formatting": "alpaca"},
        "pairs": ALPACA_PAIRS,
        "kto": KTO_INFO,
        "sg": {"file_name": "plain.json", "formatting": "sharegpt"},
    }
    for entry in info.values():
        (workdir / "data" / entry["file_name"]).write_text("[]")
    (workdir / "data" / "dataset_info.json").write_text(json.dumps(info))
    raw = {
        "model_name_or_path": "m",
        "output_dir": "out",
        "stage": stage,
        "per_device_train_batch_size": 2,
        **keys,
    }
    with pytest.raises(ConfigError) as err:
        parse_config(raw, check_model_path=False)
    assert message in str(err.value)
