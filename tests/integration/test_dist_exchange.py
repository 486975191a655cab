"""Sharded experts over two processes (gloo): tokens exchanged with all_to_all, forward and backward, against
every expert computed in one process (float64, tolerance 1e-12)."""

from __future__ import annotations

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
