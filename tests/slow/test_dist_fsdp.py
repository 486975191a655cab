"""``moetune train`` with the dense part under FSDP2 (``fsdp: true``, or ``deepspeed`` ZeRO-3 read as it) as two
processes (torchrun, gloo on the CPU standing in for the GPUs) against one process over the same global batches:
every step's loss, the final stock-PEFT adapter (gathered whole on the main process and written once), each rank
holding half of the dense weights and all of the routed experts, resuming the FSDP checkpoint, and resuming a
checkpoint of the other kind (converted, with the expert LoRA sharded by rows too)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moetune.train.demo import make_demo_model
from tests.integration import dist_checks
from tests.slow.test_dist_train import CLI, SGD

ROOT = Path(__file__).resolve().parents[2]
# AdamW: the FSDP checkpoint's optimizer state (optimizer.bin) must come back for the resumed run to match;
# adam_epsilon 1e-3 keeps one-vs-two summation-order differences small (tests/slow/test_dist_train.py says why)
ADAM = {**SGD, "optim": "adamw_torch", "learning_rate": 1e-2, "adam_epsilon": 1e-3}
FSDP: dict[str, Any] = {"fsdp": True, "fsdp_config": {"fsdp_version": 2}, "per_device_train_batch_size": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fsdp")
    model = make_demo_model(tmp / "tiny", ROOT / "examples/data/demo_tokenizer")
    one = dist_checks.config(tmp, model, "one", **ADAM)
    two = dist_checks.config(tmp, model, "fsdp", **ADAM, **FSDP)
    resumed = dist_checks.config(
        tmp, model, "resumed", **ADAM, **FSDP, resume_from_checkpoint=str(tmp / "fsdp/out/checkpoint-2")
    )
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    result = dist_checks.torchrun(*CLI, str(two))
    dist_checks.check(result)
    dist_checks.check(dist_checks.torchrun(*CLI, str(resumed)))
    return {"tmp": tmp, "model": model, "stdout": result.stdout} | {
        name: tmp / name / "out" for name in ("one", "fsdp", "resumed")
    }


def _summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "run_summary.json").read_text())


@pytest.mark.slow
def test_fsdp_equals_one_process(runs) -> None:
    dist_checks.assert_same_run(runs["fsdp"], runs["one"])
    adapter = dist_checks.adapter(runs["fsdp"])
    assert any(".experts." in k and adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)
    configs = [json.loads((runs[n] / "adapter_config.json").read_text()) for n in ("fsdp", "one")]
    assert configs[0] == configs[1]


@pytest.mark.slow
def test_each_rank_holds_half_the_dense_part_and_every_expert(runs) -> None:
    sharded, whole = _summary(runs["fsdp"]), _summary(runs["one"])
    assert whole["dense_part"]["sharding"] == "whole" and sharded["dense_part"]["sharding"] == "fsdp2"
    # rank 0's shard: half of every dense tensor (the tiny model's dims are even, so no padding)
    assert sharded["dense_part"]["params_gb"] == pytest.approx(whole["dense_part"]["params_gb"] / 2, abs=2e-6)
    assert sharded["routed_experts"] == whole["routed_experts"]  # the experts are not FSDP's


@pytest.mark.slow
def test_fsdp_files_written_once(runs) -> None:
    out = runs["fsdp"]
    assert runs["stdout"].count("adapter written to") == 1
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert [r["current_steps"] for r in log if "loss" in r] == [1, 2, 3, 4]
    ckpt = {p.name for p in (out / "checkpoint-4").iterdir()}
    assert {"pytorch_model_fsdp.bin", "optimizer.bin", "rng_state_0.pth", "rng_state_1.pth"} <= ckpt
    assert "adapter_model.safetensors" in ckpt and "optimizer.pt" not in ckpt
    assert not [p.name for p in out.iterdir() if p.name.startswith((".", "tmp-"))]


@pytest.mark.slow
def test_resume_fsdp_checkpoint(runs) -> None:
    # AdamW's moments come back from optimizer.bin: without them step 3 differs
    got, want = dict(dist_checks.losses(runs["resumed"])), dict(dist_checks.losses(runs["fsdp"]))
    assert sorted(got) == [1, 2, 3, 4]
    assert all(got[s] == pytest.approx(want[s], rel=1e-6) for s in got)
    a, b = dist_checks.adapter(runs["resumed"]), dist_checks.adapter(runs["fsdp"])
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.slow
def test_resume_across_fsdp_and_ddp(runs) -> None:
    # a checkpoint of the other kind is converted: the stock adapter (the same file in both) cut to shards under
    # FSDP, the optimizer state re-keyed (optimizer.bin by name, optimizer.pt by position); AdamW's moments must
    # come back for step 3 to match. One process, two under DDP and FSDP all compute the same run.
    tmp, model = runs["tmp"], runs["model"]
    fsdp_ckpt, one_ckpt = runs["fsdp"] / "checkpoint-2", runs["one"] / "checkpoint-2"
    resumed = {
        "one_from_fsdp": (False, {"resume_from_checkpoint": str(fsdp_ckpt)}),
        "ddp_from_fsdp": (True, {"per_device_train_batch_size": 2, "resume_from_checkpoint": str(fsdp_ckpt)}),
        "fsdp_from_one": (True, {**FSDP, "resume_from_checkpoint": str(one_ckpt)}),
    }
    for name, (two, over) in resumed.items():
        path = str(dist_checks.config(tmp, model, name, **ADAM, **over))
        dist_checks.check(dist_checks.torchrun(*CLI, path) if two else dist_checks.single(*CLI, path))
        dist_checks.assert_same_run(tmp / name / "out", runs["one"])


@pytest.mark.slow
def test_resume_across_fsdp_and_ddp_with_sharded_expert_lora(runs) -> None:
    # the expert LoRA sharded by rows: each rank's AdamW moments of its rows are in its own rows file, the main
    # process's optimizer file holds only their step; a run of the other kind puts its rows together from those
    # files inside the converted optimizer load. Both kinds' runs and both resumes compute the one-process run.
    tmp, model = runs["tmp"], runs["model"]
    sharded = {"moetune": {"device": "cpu", "num_threads": 1, "expert_parallel": "sharded"}}
    ddp = {"per_device_train_batch_size": 2}
    plans: dict[str, dict[str, Any]] = {
        "fsdp_sharded": {**FSDP, **sharded},
        "ddp_sharded": {**ddp, **sharded},
        "ddp_sharded_from_fsdp": {**ddp, **sharded, "resume_from_checkpoint": "fsdp_sharded"},
        "fsdp_sharded_from_ddp": {**FSDP, **sharded, "resume_from_checkpoint": "ddp_sharded"},
    }
    for name, over in plans.items():
        if "resume_from_checkpoint" in over:
            source = tmp / over["resume_from_checkpoint"] / "out/checkpoint-2"
            files = {p.name for p in source.iterdir()}
            rows = {f"expert_lora_optimizer-rank{r}-of-2.safetensors" for r in range(2)}
            assert rows <= files and {"optimizer.bin", "optimizer.pt"} & files, sorted(files)
            over = {**over, "resume_from_checkpoint": str(source)}
        dist_checks.check(
            dist_checks.torchrun(*CLI, str(dist_checks.config(tmp, model, name, **ADAM, **over)))
        )
        dist_checks.assert_same_run(tmp / name / "out", runs["one"])


@pytest.mark.slow
def test_deepspeed_zero3_runs_as_fsdp2_deepseek_v3(tmp_path) -> None:
    # shared experts, grouped routing, MLA attention; LLaMA-Factory's ds_z3 config read as FSDP2 full shard;
    # gradient checkpointing recomputes under FSDP2's gathers
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer", family="deepseek_v3")
    steps = {**SGD, "save_steps": 4, "gradient_checkpointing": True}
    one = dist_checks.config(tmp_path, model, "one", **steps)
    two = dist_checks.config(
        tmp_path,
        model,
        "two",
        **steps,
        deepspeed=str(ROOT / "examples/deepspeed/ds_z3_config.json"),
        per_device_train_batch_size=2,
    )
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two)))
    dist_checks.assert_same_run(tmp_path / "two/out", tmp_path / "one/out")
    assert _summary(tmp_path / "two/out")["dense_part"]["sharding"] == "fsdp2"


@pytest.mark.slow
def test_fsdp_with_sharded_experts(tmp_path) -> None:
    # each rank half of the dense part (FSDP2) and half of every layer's experts (the exchange's own gloo group)
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    sharded = {"moetune": {"device": "cpu", "num_threads": 1, "expert_parallel": "sharded"}}
    one = dist_checks.config(tmp_path, model, "one", **SGD)
    two = dist_checks.config(tmp_path, model, "two", **SGD, **FSDP, **sharded)
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two)))
    dist_checks.assert_same_run(tmp_path / "two/out", tmp_path / "one/out")
    summary = _summary(tmp_path / "two/out")
    assert summary["dense_part"]["sharding"] == "fsdp2"
    assert summary["routed_experts"]["experts_per_layer"] == "4 of 8"


@pytest.mark.slow
def test_routed_experts_stay_out_of_fsdp(tmp_path) -> None:
    # on the CPU a wrapped expert LoRA would still compute the same numbers (FSDP gathers it before each layer and
    # averages its gradient as host_grads does), so where each tensor ends up is checked directly
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    cfg = dist_checks.config(tmp_path, model, "two", **{**SGD, **FSDP, "max_steps": 1, "save_steps": 1})
    result = dist_checks.torchrun("tests/slow/fsdp_placement.py", str(cfg))
    dist_checks.check(result)
    assert result.stdout.count("placement ok") == 2
