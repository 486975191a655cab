"""Fixtures shared by the config tests."""

import json
from pathlib import Path

import pytest


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory with a model folder and an alpaca dataset registered in data/dataset_info.json."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    data = tmp_path / "data"
    data.mkdir()
    (data / "alpaca.json").write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    (data / "dataset_info.json").write_text(json.dumps({"alpaca_demo": {"file_name": "alpaca.json"}}))
    return tmp_path
