"""Two processes under torchrun (gloo on the CPU): an exception on one rank ends both, each printing the cause;
adapter saves called on every rank are written by the main process alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from moetune.train.demo import make_demo_model
from tests.integration import dist_checks

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("m") / "tiny", ROOT / "examples/data/demo_tokenizer")


@pytest.mark.parametrize("failing", [0, 1])
def test_failure_on_one_rank_ends_the_other_with_the_cause(tmp_path, demo_model, failing) -> None:
    # the failing rank raises in its third forward while the other waits in DDP's gradient all-reduce; without
    # the watchdog it would wait there until ddp_timeout (120 s here, above the 90 s this test allows)
    cfg = dist_checks.config(tmp_path, demo_model, "out", max_steps=6, per_device_train_batch_size=2)
    result = dist_checks.torchrun(
        "tests/integration/dist_checks.py", "fail_on_rank", str(cfg), str(failing), timeout=90
    )
    assert result.returncode != 0
    cause = f"RuntimeError: injected failure on rank {failing}"
    lines = result.stderr.splitlines()
    assert any(f"moetune rank {failing}: {cause}" in line for line in lines), result.stderr[-6000:]
    stop = f"moetune rank {1 - failing}: stopping: rank {failing} failed: {cause}"
    assert any(stop in line for line in lines), result.stderr[-6000:]


def test_adapter_saves_from_every_rank_have_one_writer(tmp_path) -> None:
    # before moetune.dist, both ranks staged and renamed the same files and one failed in the other's staging
    result = dist_checks.torchrun(
        "tests/integration/dist_checks.py", "adapter_saves_on_every_rank", str(tmp_path / "a"), timeout=90
    )
    dist_checks.check(result)
    assert "rank 1 refused: rank 1 found an interrupted adapter save" in result.stdout
