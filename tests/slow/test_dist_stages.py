"""The dpo and kto stages (TRL's trainers) as two processes (torchrun, gloo, experts replicated; the dense part under
the Trainer's DDP or under FSDP2) against one process over the same global batches: every logged loss and every
LoRA tensor after plain SGD steps (each update the learning rate times the averaged gradient), and each file written
once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moetune.train.demo import make_demo_model
from tests.integration import dist_checks, test_stages

ROOT = Path(__file__).resolve().parents[2]
CLI = ("-m", "moetune.cli.main", "train")
STEPS = 3
# the dense part's sharding over the two processes: the Trainer's DDP, or FSDP2 through accelerate's plugin
SHARDING = {"ddp": {}, "fsdp": {"fsdp": True, "fsdp_config": {"fsdp_version": 2}}}
# run_summary.json's dense_part.sharding on rank 0 (FSDP: DTensor shards)
DENSE = {"ddp": "whole", "fsdp": "fsdp2"}


def _config(tmp: Path, stage: str, model: Path, name: str, batch: int, **extra) -> Path:
    """``test_stages``' shortened shipped example for ``stage`` in ``tmp/name``, SGD at a constant rate for STEPS
    steps, saved at the last; ``extra`` overrides or adds settings."""
    folder = tmp / name
    folder.mkdir()
    run = {"max_steps": STEPS, "save_steps": STEPS, "per_device_train_batch_size": batch, "ddp_timeout": 120}
    sgd = {"optim": "sgd", "learning_rate": 0.5, "lr_scheduler_type": "constant"}
    return test_stages._example(folder, stage, model, **(run | sgd | extra))


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp"])
@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_two_processes_equal_one(tmp_path, stage, sharding) -> None:
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    dist_checks.check(dist_checks.single(*CLI, str(_config(tmp_path, stage, model, "one", batch=8))))
    two_config = _config(tmp_path, stage, model, "two", batch=4, **SHARDING[sharding])
    result = dist_checks.torchrun(*CLI, str(two_config))
    dist_checks.check(result)
    one, two = tmp_path / "one/out", tmp_path / "two/out"
    got, want = dict(dist_checks.losses(two)), dict(dist_checks.losses(one))
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-6), (step, got, want)
    a, b = (load_file(str(out / "adapter_model.safetensors")) for out in (two, one))
    assert a.keys() == b.keys() and any(".experts." in k for k in a)
    # fp32 sums in another order over two processes: ~1e-4 of a tensor's largest value after 3 steps
    for key in a:
        scale = float(b[key].abs().max())
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-3 * scale, msg=key)
    log = [json.loads(line) for line in (two / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in log if "loss" in r] == list(range(1, STEPS + 1))  # one writer
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (two / f"checkpoint-{STEPS}").iterdir()}
    summary = json.loads((two / "run_summary.json").read_text())
    assert summary["dense_part"]["sharding"] == DENSE[sharding]  # FSDP2 in effect under TRL's trainer


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_resumes_across_fsdp_and_ddp(tmp_path, stage) -> None:
    """With AdamW, two processes: the FSDP2 run's checkpoint-2 resumed under DDP and the DDP run's under FSDP2 each
    continue the uninterrupted FSDP2 run (every loss and adapter tensor), as does the DDP run itself: the optimizer
    state converted between kinds (optimizer.bin by name, optimizer.pt by position) under TRL's trainers, as
    `test_dist_fsdp` checks it for sft. Two processes throughout: kto's KL completions pair rows within each
    process's batch (`_rotate_completions`), so one process at batch 8 is another estimate once the policy moves."""
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    adam = {"optim": "adamw_torch", "learning_rate": 1e-2, "adam_epsilon": 1e-3}

    def run(name: str, **extra) -> Path:
        config = _config(tmp_path, stage, model, name, batch=4, max_steps=4, save_steps=2, **adam, **extra)
        dist_checks.check(dist_checks.torchrun(*CLI, str(config)))
        return tmp_path / name / "out"

    fsdp, ddp = run("fsdp", **SHARDING["fsdp"]), run("ddp")
    dist_checks.assert_same_run(ddp, fsdp)
    dist_checks.assert_same_run(run("ddp_from_fsdp", resume_from_checkpoint=str(fsdp / "checkpoint-2")), fsdp)
    from_ddp = {**SHARDING["fsdp"], "resume_from_checkpoint": str(ddp / "checkpoint-2")}
    dist_checks.assert_same_run(run("fsdp_from_ddp", **from_ddp), fsdp)
