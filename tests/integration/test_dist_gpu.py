"""Two processes with a GPU each (NCCL for the device parameters' DDP, gloo for the expert gradients averaged
outside it: moetune.train.host_grads) against one process on one GPU over the same global batches. Needs two
CUDA devices; skipped elsewhere (the same split runs on the CPU in tests/slow/test_dist_train.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moetune.train.demo import make_demo_model
from tests.integration import dist_checks

ROOT = Path(__file__).resolve().parents[2]
CLI = ("-m", "moetune.cli.main", "train")
SGD = {"optim": "sgd", "learning_rate": 0.5, "lr_scheduler_type": "constant", "max_steps": 3, "save_steps": 3}
ON_GPU = {"moetune": {"device": "cuda", "num_threads": 1}}


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpu_processes_equal_one(tmp_path) -> None:
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    one = dist_checks.config(tmp_path, model, "one", **SGD, **ON_GPU)
    two = dist_checks.config(tmp_path, model, "two", **SGD, **ON_GPU, per_device_train_batch_size=2)
    dist_checks.check(dist_checks.single(*CLI, str(one), gpus=True))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two), gpus=True))
    got, want = dict(dist_checks.losses(tmp_path / "two/out")), dict(dist_checks.losses(tmp_path / "one/out"))
    assert sorted(got) == [1, 2, 3]
    assert all(got[s] == pytest.approx(want[s], rel=1e-4) for s in got), (got, want)
    a, b = (load_file(str(tmp_path / n / "out/adapter_model.safetensors")) for n in ("two", "one"))
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-5, msg=key)
