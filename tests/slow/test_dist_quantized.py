"""``moetune train`` with ``expert_parallel: sharded`` on quantized checkpoints as shipped, LoRA on every target,
experts included: a tiny DeepSeek-V3 whose decoder Linears and routed experts are FP8 with 128 x 128 block scales
(``moetune.testing.fp8_checkpoint``), a tiny Kimi-K2-Thinking (compressed-tensors INT4 experts, one shard per
decoder layer) and a tiny gpt-oss (MXFP4 fused experts). Two processes (each reading and holding its 4 of the 8
experts of every MoE layer in the checkpoint's own format, tokens exchanged with their owners) equal one process
over the same global batches: every step's loss and every adapter tensor after plain SGD steps (each update lr
times the gradient); the engines hold the checkpoint's routed-expert bytes, half of them per rank."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from moetune.loading.checkpoint import Checkpoint
from moetune.testing.fp8_checkpoint import save_fp8_checkpoint
from moetune.testing.kimi import save_kimi_thinking
from moetune.testing.mxfp4_checkpoint import save_mxfp4_checkpoint
from tests.integration import dist_checks

ROOT = Path(__file__).resolve().parents[2]
CLI = ("-m", "moetune.cli.main", "train")
SGD = {"optim": "sgd", "learning_rate": 0.5, "lr_scheduler_type": "constant", "max_steps": 4, "save_steps": 4}
SHARDED = {"moetune": {"device": "cpu", "num_threads": 1, "expert_parallel": "sharded"}}
# name -> builder(path, **config overrides)
BUILDERS: dict[str, Callable[..., Path]] = {
    "deepseek_v3_fp8": lambda path, **over: save_fp8_checkpoint("deepseek_v3", path, **over),
    "kimi_k2_thinking_int4": save_kimi_thinking,
    "gpt_oss_mxfp4": save_mxfp4_checkpoint,
}


def quantized_demo_model(name: str, path: Path) -> Path:
    """Checkpoint ``name`` sized for the demo tokenizer (its vocabulary and special ids), the tokenizer beside it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "examples/data/demo_tokenizer"))
    ids = {f"{token}_token_id": getattr(tokenizer, f"{token}_token_id") for token in ("pad", "bos", "eos")}
    out = BUILDERS[name](path, vocab_size=len(tokenizer), **ids)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BUILDERS))
def test_two_sharded_processes_equal_one_on_a_quantized_checkpoint(tmp_path, name) -> None:
    model = quantized_demo_model(name, tmp_path / "model")
    assert json.loads((model / "config.json").read_text())["quantization_config"]
    one = dist_checks.config(tmp_path, model, "one", **SGD)
    two = dist_checks.config(tmp_path, model, "two", **SGD, **SHARDED, per_device_train_batch_size=2)
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two)))
    dist_checks.assert_same_run(tmp_path / "two/out", tmp_path / "one/out")
    adapter = dist_checks.adapter(tmp_path / "two/out")
    assert any(".experts." in k and adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)
    # the experts stayed as shipped (the engines hold the checkpoint's routed-expert codes and scales byte for
    # byte, less compressed-tensors' 8-byte weight_shape per matrix; float experts would be 4-8x as many bytes),
    # and each rank held half of them
    stored = Checkpoint.open(model).tensors
    shipped = sum(
        t.nbytes for k, t in stored.items() if ".mlp.experts." in k and not k.endswith(("_shape", "_bias"))
    )
    held = [
        json.loads((tmp_path / n / "out/run_summary.json").read_text())["routed_experts"]
        for n in ("two", "one")
    ]
    assert held[0]["expert_parallel"] == "sharded" and held[0]["experts_per_layer"] == "4 of 8"
    assert held[1]["experts_per_layer"] == "8 of 8"
    assert held[1]["engines_gb"] == pytest.approx(shipped / 2**30, abs=1e-6)
    assert held[0]["engines_gb"] == pytest.approx(shipped / 2**31, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("residency", ["ram", "disk"])
def test_two_sharded_processes_equal_one_on_a_store(tmp_path, residency) -> None:
    # the FP8 DeepSeek-V3 converted to an int8 store (``moetune convert``): each rank maps and reads its 4 of the 8
    # experts of every layer file (verified by their per-expert hashes); one process reads the whole store. In
    # ``disk`` residency each rank pages its experts' byte ranges in and out within its own budget (the default:
    # two of its shares), one process whole files
    from moetune.loading.convert import convert_checkpoint

    model = quantized_demo_model("deepseek_v3_fp8", tmp_path / "model")
    store = tmp_path / "store"
    manifest = convert_checkpoint(model, store, "int8", num_threads=1, progress=False)
    options = {"device": "cpu", "num_threads": 1, "expert_path": str(store), "expert_residency": residency}
    one = dist_checks.config(tmp_path, model, "one", **SGD, moetune=options)
    two = dist_checks.config(
        tmp_path,
        model,
        "two",
        **SGD,
        moetune={**options, "expert_parallel": "sharded"},
        per_device_train_batch_size=2,
    )
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two)))
    dist_checks.assert_same_run(tmp_path / "two/out", tmp_path / "one/out")
    held = [
        json.loads((tmp_path / n / "out/run_summary.json").read_text())["routed_experts"]
        for n in ("two", "one")
    ]
    assert held[0]["expert_parallel"] == "sharded" and held[0]["experts_per_layer"] == "4 of 8"
    assert held[1]["experts_per_layer"] == "8 of 8"
    if (
        residency == "disk"
    ):  # each rank paged its share within its budget: two of its shares, each tensor's rows
        paged = [
            h["disk_residency"] for h in held
        ]  # page-rounded (so here, tiny layers, more than half of one's)
        assert paged[0]["budget_gb"] < paged[1]["budget_gb"]
        assert all(0 < p["peak_gb"] <= p["budget_gb"] and p["hits"] + p["misses"] > 0 for p in paged)
    else:
        assert all("disk_residency" not in h for h in held)
    # the experts came from the store: the FP8 checkpoint's own experts (held as shipped) train otherwise
    plain = dist_checks.config(tmp_path, model, "plain", **SGD)
    dist_checks.check(dist_checks.single(*CLI, str(plain)))
    assert dist_checks.losses(tmp_path / "plain/out")[1:] != dist_checks.losses(tmp_path / "one/out")[1:]
    # int8 codes [E, 2I, H] + [E, H, I] and their scales: the store's layer files less their headers, half a rank
    assert held[0]["engines_gb"] == pytest.approx(held[1]["engines_gb"] / 2, abs=1e-6)
    assert held[1]["engines_gb"] * 2**30 <= sum(f.size for f in manifest.files.values())
