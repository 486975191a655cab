"""``moetune train`` as two processes with ``expert_parallel: sharded`` (each rank holds half of every MoE layer's
routed experts; tokens travel to their owners and back) against one process holding every expert, over the same
global batches with plain SGD: every step's loss and every adapter tensor (attention and expert LoRA) equal; the
adapter is whole (the keys and config of the one-process adapter); a sharded checkpoint resumes in one process
and a one-process checkpoint in two sharded processes, the loss continuing as uninterrupted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetune.train.demo import make_demo_model
from tests.integration import dist_checks
from tests.slow.test_dist_train import CLI, ROOT, SGD, _adapter, _assert_same_run

SHARDED = {"moetune": {"device": "cpu", "num_threads": 1, "expert_parallel": "sharded"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """Output folders: ``one`` (one process, every expert, batch 4), ``two`` (two sharded processes, batch 2
    each), ``two_to_one`` (one process resuming ``two``'s checkpoint-2), ``one_to_two`` (two sharded processes
    resuming ``one``'s)."""
    tmp = tmp_path_factory.mktemp("sharded")
    model = make_demo_model(tmp / "tiny", ROOT / "examples/data/demo_tokenizer")
    one = dist_checks.config(tmp, model, "one", **SGD)
    two = dist_checks.config(tmp, model, "two", **SGD, **SHARDED, per_device_train_batch_size=2)
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    result = dist_checks.torchrun(*CLI, str(two))
    dist_checks.check(result)
    assert result.stdout.count("adapter written to") == 1
    back = dist_checks.config(
        tmp, model, "two_to_one", **SGD, resume_from_checkpoint=str(tmp / "two/out/checkpoint-2")
    )
    forth = dist_checks.config(
        tmp,
        model,
        "one_to_two",
        **SGD,
        **SHARDED,
        per_device_train_batch_size=2,
        resume_from_checkpoint=str(tmp / "one/out/checkpoint-2"),
    )
    dist_checks.check(dist_checks.single(*CLI, str(back)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(forth)))
    return {name: tmp / name / "out" for name in ("one", "two", "two_to_one", "one_to_two")}


@pytest.mark.slow
def test_two_sharded_processes_equal_one(runs) -> None:
    _assert_same_run(runs["two"], runs["one"])
    adapter = _adapter(runs["two"])
    experts = [k for k in adapter if ".experts." in k and "lora_B" in k]
    assert experts and all(adapter[k].abs().max() > 0 for k in experts)  # expert LoRA was trained
    config = [json.loads((runs[n] / "adapter_config.json").read_text()) for n in ("two", "one")]
    assert config[0] == config[1]  # the whole adapter, as one process writes it (stock PEFT loads that one)
    held = [json.loads((runs[n] / "run_summary.json").read_text())["routed_experts"] for n in ("two", "one")]
    assert held[0]["expert_parallel"] == "sharded" and held[0]["experts_per_layer"] == "4 of 8"
    assert held[1]["expert_parallel"] == "replicated" and held[1]["experts_per_layer"] == "8 of 8"
    assert held[0]["engines_gb"] == pytest.approx(
        held[1]["engines_gb"] / 2, abs=2e-6
    )  # rank 0 holds half (GiB, 6 digits)


@pytest.mark.slow
def test_sharded_resume_with_another_number_of_processes(runs) -> None:
    for resumed in ("two_to_one", "one_to_two"):
        state = json.loads((runs[resumed] / "trainer_state.json").read_text())
        assert state["global_step"] == 4
        _assert_same_run(runs[resumed], runs["one"])


@pytest.mark.slow
def test_two_sharded_processes_equal_one_deepseek_v3(tmp_path) -> None:
    # shared experts overlapped with the exchange, grouped routing, MLA attention; gradient checkpointing: the
    # recompute repeats every layer's exchange on both ranks
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer", family="deepseek_v3")
    steps = {**SGD, "max_steps": 4, "save_steps": 4, "gradient_checkpointing": True}
    one = dist_checks.config(tmp_path, model, "one", **steps)
    two = dist_checks.config(tmp_path, model, "two", **steps, **SHARDED, per_device_train_batch_size=2)
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two)))
    _assert_same_run(tmp_path / "two/out", tmp_path / "one/out")
    adapter = _adapter(tmp_path / "two/out")
    assert any(".experts." in k and adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)
