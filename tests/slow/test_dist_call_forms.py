"""``moetune train`` end to end with ``expert_parallel: sharded`` on a family whose block calls its experts other
than with top-k ids (Llama 4: ``experts(routed_in [E*T, H])``, rows pre-scaled by the router): two processes
under torchrun against one process over the same global batches, LoRA on every target (the routed experts'
rows sharded), AdamW, a checkpoint, the adapter gathered whole. The model-level checks of every call form are in
``tests/integration/test_dist_exchange.py``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.integration import dist_checks
from tests.slow.test_dist_sharded_lora import ADAMW, CLI  # AdamW with adam_epsilon 1e-3: see there

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_llama4_sharded_training_equals_one_process(tmp_path) -> None:
    from moetune.testing.families import survey_config
    from moetune.testing.survey import _random_model

    model = tmp_path / "llama4"  # the text model (see test_dist_exchange.py), with the demo tokenizer
    _random_model(survey_config("llama4").get_text_config(), seed=0).save_pretrained(model)
    for f in (ROOT / "examples/data/demo_tokenizer").iterdir():
        shutil.copy(f, model / f.name)
    one = dist_checks.config(tmp_path, model, "one", **ADAMW, per_device_train_batch_size=4)
    sharded = {"moetune": {"device": "cpu", "num_threads": 1, "expert_parallel": "sharded"}}
    two = dist_checks.config(tmp_path, model, "two", **ADAMW, per_device_train_batch_size=2, **sharded)
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two)))
    dist_checks.assert_same_run(tmp_path / "two" / "out", tmp_path / "one" / "out")
    adapter = dist_checks.adapter(tmp_path / "two" / "out")
    assert any(".experts." in k and adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)
    summary = json.loads((tmp_path / "two" / "out" / "run_summary.json").read_text())
    assert summary["routed_experts"]["experts_per_layer"] == "4 of 8"  # each rank held half the experts


@pytest.mark.slow
def test_longcat_flash_sharded_expert_lora_trains_and_resumes_as_one_process(tmp_path) -> None:
    # LongCat-Flash's gate_up LoRA has rows for its zero-computation experts too ([E + Z] experts' rows, never
    # used in compute), kept by the last rank: with weight decay AdamW shrinks them in one process, so it must in
    # two; a checkpoint of two processes resumes in one and one of one process in two (the rows cut again)
    from moetune.testing.families import survey_config
    from moetune.testing.survey import _random_model

    model = tmp_path / "longcat"
    _random_model(survey_config("longcat_flash"), seed=0).save_pretrained(model)
    for f in (ROOT / "examples/data/demo_tokenizer").iterdir():
        shutil.copy(f, model / f.name)
    sharded = {"moetune": {"device": "cpu", "num_threads": 1, "expert_parallel": "sharded"}}
    decay = {**ADAMW, "weight_decay": 0.1}

    def config(name: str, processes: int, **over: object) -> str:
        per = 4 // processes
        return str(
            dist_checks.config(tmp_path, model, name, **decay, per_device_train_batch_size=per, **over)
        )

    dist_checks.check(dist_checks.single(*CLI, config("one", 1)))
    dist_checks.check(dist_checks.torchrun(*CLI, config("two", 2, **sharded)))
    from_two = str(tmp_path / "two" / "out" / "checkpoint-2")
    dist_checks.check(dist_checks.single(*CLI, config("two_to_one", 1, resume_from_checkpoint=from_two)))
    from_one = str(tmp_path / "one" / "out" / "checkpoint-2")
    dist_checks.check(
        dist_checks.torchrun(*CLI, config("one_to_two", 2, **sharded, resume_from_checkpoint=from_one))
    )
    for name in ("two", "two_to_one", "one_to_two"):
        dist_checks.assert_same_run(tmp_path / name / "out", tmp_path / "one" / "out")
    adapter = dist_checks.adapter(tmp_path / "two" / "out")
    r = json.loads((tmp_path / "two" / "out" / "adapter_config.json").read_text())["r"]
    survey = survey_config("longcat_flash")
    experts, extra = survey.n_routed_experts, survey.zero_expert_num
    gate_up_a = [k for k in adapter if ".experts." in k and adapter[k].shape[0] == r * (experts + extra)]
    assert gate_up_a and extra > 0  # stock PEFT's gate_up lora_A: [(E + Z) r, H]
    for key in gate_up_a:  # the Z rows: drawn at random, then only shrunk by the decay, as in one process
        assert adapter[key][experts * r :].abs().max() > 0
