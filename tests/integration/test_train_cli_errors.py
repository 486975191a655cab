"""``moetune train`` with bad input fails before the model loads, naming the field, in-process through the CLI.

Every case the training issue lists: unknown key, wrong type, missing file, empty dataset, a row that does not
fit its format, cutoff_len too small for the template, lora_rank <= 0, an output_dir that holds another run.
``moetune.loading.load_model`` is replaced by a function that fails the test if it is ever called.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from moetune.cli.main import main
from moetune.train.demo import make_demo_model

ROOT = Path(__file__).resolve().parents[2]
GOOD_ROWS = [{"instruction": "encode", "input": "b c", "output": "e f"}] * 4


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("m") / "tiny", ROOT / "examples/data/demo_tokenizer")


@pytest.fixture(autouse=True)
def no_model_load(monkeypatch):
    def load_model(*args, **kwargs):
        raise AssertionError("load_model was called: the bad input was not caught before the model loads")

    monkeypatch.setattr("moetune.loading.load_model", load_model)


def write_json(path: Path, rows: list) -> Path:
    path.write_text(json.dumps(rows))
    return path


def train(tmp_path: Path, demo_model: Path, capsys, **over) -> str:
    """Run ``moetune train`` on a valid config with ``over`` applied (None deletes a key); returns stderr."""
    cfg = {
        "model_name_or_path": str(demo_model),
        "dataset": str(write_json(tmp_path / "good.json", GOOD_ROWS)),
        "cutoff_len": 32,
        "lora_rank": 4,
        "output_dir": str(tmp_path / "out"),
        "max_steps": 1,
        "report_to": "none",
        "moetune": {"device": "cpu"},
    }
    cfg.update(over)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump({k: v for k, v in cfg.items() if v is not None}))
    assert main(["train", str(path)]) == 2
    return capsys.readouterr().err


def test_unknown_key(tmp_path, demo_model, capsys) -> None:
    err = train(tmp_path, demo_model, capsys, lora_rnak=8)
    assert (
        "lora_rnak: is not a moetune, supported LLaMA-Factory or transformers TrainingArguments key; did you mean 'lora_rank'?"
        in err
    )


def test_wrong_type(tmp_path, demo_model, capsys) -> None:
    err = train(tmp_path, demo_model, capsys, learning_rate="fast")
    assert "learning_rate: got 'fast'; expected a number" in err


@pytest.mark.parametrize("key", ["model_name_or_path", "dataset"])
def test_missing_file(tmp_path, demo_model, capsys, key) -> None:
    err = train(tmp_path, demo_model, capsys, **{key: str(tmp_path / "nowhere")})
    assert f"  - {key}: " in err and "nowhere" in err and "give a" in err  # says what to give instead


def test_empty_dataset(tmp_path, demo_model, capsys) -> None:
    err = train(tmp_path, demo_model, capsys, dataset=str(write_json(tmp_path / "empty.json", [])))
    assert "empty.json" in err and "has no rows" in err


def test_row_that_does_not_fit_its_format(tmp_path, demo_model, capsys) -> None:
    rows = [*GOOD_ROWS, {"instruction": "encode", "input": "b"}]
    err = train(tmp_path, demo_model, capsys, dataset=str(write_json(tmp_path / "bad.json", rows)))
    assert "row 4: field 'output' is missing" in err


def test_cutoff_len_too_small_for_the_template(tmp_path, demo_model, capsys) -> None:
    err = train(tmp_path, demo_model, capsys, cutoff_len=2)
    assert (
        "cutoff_len 2 leaves no trained token" in err
        and "keeps one for the row with the shortest prompt" in err
    )


@pytest.mark.parametrize("rank", [0, -4])
def test_lora_rank_not_positive(tmp_path, demo_model, capsys, rank) -> None:
    err = train(tmp_path, demo_model, capsys, lora_rank=rank)
    assert f"lora_rank: got {rank}; must be > 0" in err


def test_output_dir_holding_another_run(tmp_path, demo_model, capsys) -> None:
    (tmp_path / "out" / "checkpoint-10").mkdir(parents=True)
    err = train(tmp_path, demo_model, capsys)
    assert "output_dir" in err and "already holds a training run (checkpoint-10)" in err
    assert "overwrite_output_dir" in err


def test_the_guard_catches_a_model_load(tmp_path, demo_model, capsys) -> None:
    """A valid config does reach load_model, so every case above really stopped before it."""
    with pytest.raises(AssertionError, match="load_model was called"):
        train(tmp_path, demo_model, capsys)
