"""kill -9 during an adapter save, a convert and a training checkpoint, one of each (``kill_checks``; the slow
suite runs more seeds): the previous state loads whole and a rerun or resume completes."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.train.demo import make_demo_model
from tests.integration import kill_checks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return kill_checks.tiny_model(tmp_path_factory.mktemp("model"))


def test_kill_during_adapter_save(tmp_path, model_dir):
    kill_checks.adapter_save_kill(tmp_path, model_dir, seed=0)


def test_kill_during_convert(tmp_path, model_dir):
    kill_checks.convert_kill(tmp_path, model_dir, seed=0)


def test_kill_during_training_checkpoint(tmp_path):
    demo = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    kill_checks.train_save_kill(tmp_path / "run", demo, seed=0)
