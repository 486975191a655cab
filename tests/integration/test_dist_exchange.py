"""Sharded experts over two processes (gloo): tokens exchanged with all_to_all, forward and backward, against
every expert computed in one process (the exchange in float64, tolerance 1e-12; models in float32, for every way a
family calls its experts)."""

from __future__ import annotations

import pytest

from moetune.testing.tiny import save_tiny_model
from tests.integration import dist_checks


def test_sharded_experts_equal_one_process() -> None:
    result = dist_checks.torchrun("tests/integration/dist_checks.py", "sharded_exchange", timeout=90)
    dist_checks.check(result)
    for rank in (0, 1):
        assert f"rank {rank}: sharded experts equal the reference" in result.stdout


def test_sharded_model_equals_one_process(tmp_path) -> None:
    # the layer in a model: loading (each rank reads its experts), the sharded module, PEFT's expert LoRA sliced
    # per rank, gradient checkpointing's recompute repeating the exchange
    model = save_tiny_model("qwen3_moe", tmp_path / "tiny", tokenizer=False)
    result = dist_checks.torchrun("tests/integration/dist_checks.py", "sharded_model", str(model), timeout=90)
    dist_checks.check(result)
    for rank in (0, 1):
        assert f"rank {rank}: the sharded model equals the reference" in result.stdout


# every other call form (moetune.arch.spec.ExpertsCall) -> lora_target: the routed experts with attention; attention
# only on DBRX (its flat experts take no expert LoRA). LongCat-Flash's gate_up LoRA also has its zero-computation
# experts' unused rows, kept by the last rank (moetune.adapters.expert_rows.share)
CALL_FORMS = {
    "llama4": "q_proj,v_proj,experts",  # PRESCALED_DENSE
    "dbrx": "Wqkv,out_proj",  # TOPK_BATCHED
    "longcat_flash": "q_b_proj,o_proj,experts",  # TOPK_WITH_IDENTITY
    "muse_spark": "q_proj,v_proj,experts",  # TOPK_POST_NORM
}


SLOW_FORMS = ("longcat_flash",)  # its survey model takes about 30 s here (the others 10-15 s)


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FORMS else f for f in CALL_FORMS]
)
def test_sharded_call_forms_equal_one_process(tmp_path, family) -> None:
    # the family's own call form on a shard: loss, logits and every LoRA gradient as with every expert in one
    # process (the sharded expert rows' gradients summed over the ranks), rank 1's experts idle in one layer; the
    # adapter gathered from the ranks equals the one-process file
    from moetune.testing.families import survey_config
    from moetune.testing.survey import _random_model

    config = survey_config(family)
    if family == "llama4":  # its text model: transformers 5.24's Llama4ForConditionalGeneration.forward reads
        config = config.get_text_config()  # image_outputs off the text model's output, which has none
    path = tmp_path / family
    _random_model(config, seed=0).save_pretrained(path)
    result = dist_checks.torchrun(
        "tests/integration/dist_checks.py", "sharded_model", str(path), CALL_FORMS[family], timeout=120
    )
    dist_checks.check(result)
    for rank in (0, 1):
        assert f"rank {rank}: the sharded model equals the reference" in result.stdout
