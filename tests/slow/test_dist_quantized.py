"""``moetune train`` with ``expert_parallel: sharded`` on a quantized checkpoint as shipped: a tiny DeepSeek-V3 whose
decoder Linears and routed experts are FP8 with 128 x 128 block scales (``moetune.testing.fp8_checkpoint``), LoRA
on every target, experts included. Two processes (each reading and holding its 4 of the 8 experts of every MoE
layer in FP8, tokens exchanged with their owners) equal one process over the same global batches: every step's
loss and every adapter tensor after plain SGD steps (each update lr times the gradient)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moetune.loading.checkpoint import Checkpoint
from moetune.testing.fp8_checkpoint import save_fp8_checkpoint
from tests.integration import dist_checks

ROOT = Path(__file__).resolve().parents[2]
CLI = ("-m", "moetune.cli.main", "train")
SGD = {"optim": "sgd", "learning_rate": 0.5, "lr_scheduler_type": "constant", "max_steps": 4, "save_steps": 4}
SHARDED = {"moetune": {"device": "cpu", "num_threads": 1, "expert_parallel": "sharded"}}


def fp8_demo_model(path: Path) -> Path:
    """The tiny DeepSeek-V3 as an FP8 checkpoint, with the demo tokenizer (its vocabulary and special ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "examples/data/demo_tokenizer"))
    ids = {f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("pad", "bos", "eos")}
    out = save_fp8_checkpoint("deepseek_v3", path, vocab_size=len(tokenizer), **ids)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
def test_two_sharded_processes_equal_one_on_fp8_deepseek_v3(tmp_path) -> None:
    model = fp8_demo_model(tmp_path / "fp8")
    assert json.loads((model / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"
    one = dist_checks.config(tmp_path, model, "one", **SGD)
    two = dist_checks.config(tmp_path, model, "two", **SGD, **SHARDED, per_device_train_batch_size=2)
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two)))
    dist_checks.assert_same_run(tmp_path / "two/out", tmp_path / "one/out")
    adapter = dist_checks.adapter(tmp_path / "two/out")
    assert any(".experts." in k and adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)
    # the experts stayed FP8 as shipped (the engines hold the checkpoint's routed-expert codes and fp32 scales
    # byte for byte), and each rank held half of them
    stored = Checkpoint.open(model).tensors
    fp8_bytes = sum(t.nbytes for k, t in stored.items() if ".mlp.experts." in k) / 2**30
    held = [
        json.loads((tmp_path / n / "out/run_summary.json").read_text())["routed_experts"]
        for n in ("two", "one")
    ]
    assert held[0]["expert_parallel"] == "sharded" and held[0]["experts_per_layer"] == "4 of 8"
    assert held[1]["experts_per_layer"] == "8 of 8"
    assert held[1]["engines_gb"] == pytest.approx(fp8_bytes, abs=1e-6)  # fp32 experts: 4x as many bytes
    assert held[0]["engines_gb"] == pytest.approx(fp8_bytes / 2, abs=1e-6)
