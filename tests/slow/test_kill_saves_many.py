"""kill -9 at random points, six seeds of each kind (``tests/integration/kill_checks``): during an adapter save,
a convert, and a training run's checkpoint writing. Each time the previous state loads whole (an adapter's
config goes with its weights; a store is the old one, the new one, or refused naming the one moved aside;
every checkpoint-N is complete) and a rerun or resume completes."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.train.demo import make_demo_model
from tests.integration import kill_checks

ROOT = Path(__file__).resolve().parents[2]
SEEDS = range(1, 7)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return kill_checks.tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("demo") / "tiny", ROOT / "examples/data/demo_tokenizer")


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_kill_during_adapter_save(tmp_path, model_dir, seed):
    kill_checks.adapter_save_kill(tmp_path, model_dir, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_kill_during_convert(tmp_path, model_dir, seed):
    kill_checks.convert_kill(tmp_path, model_dir, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_kill_during_training_checkpoint(tmp_path, demo, seed):
    kill_checks.train_save_kill(tmp_path, demo, seed)
