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
