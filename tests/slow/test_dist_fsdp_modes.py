"""FSDP2 for the dense part with ``finetuning_type`` full and freeze, and with ``lora_experts``, as two processes
(torchrun, gloo on the CPU standing in for the GPUs) against one process over the same global batches: every
step's loss, every tensor of the final model (or adapter and LoRA experts) and of a checkpoint's layer files
(weights and AdamW's moments) equal; the same files as one process; resuming the FSDP checkpoint with FSDP, and
(full/freeze: the files hold whole tensors) with one process, and one process's checkpoint with FSDP. The routed
experts' full-mode weights and the LoRA experts stay whole on every rank (``fsdp_placement.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from moetune.train.demo import make_demo_model
from tests.integration import dist_checks
from tests.slow.test_dist_fsdp import ADAM, FSDP
from tests.slow.test_dist_train import CLI

ROOT = Path(__file__).resolve().parents[2]
FULL = {**ADAM, "finetuning_type": "full"}
# the last layer with its routed experts; LLaMA-Factory's full-SFT DeepSpeed config read as FSDP2 full shard
FREEZE = {
    **ADAM,
    "finetuning_type": "freeze",
    "freeze_trainable_layers": 1,
    "freeze_trainable_modules": "all",
}
Z3 = {"deepspeed": str(ROOT / "examples/deepspeed/ds_z3_config.json"), "per_device_train_batch_size": 2}
LORA_EXPERTS = {**ADAM, "lora_experts": 2, "lora_expert_intermediate_size": 8}


def _runs(
    tmp: Path, family: str, mode: dict[str, Any], sharded: dict[str, Any], *, cross: bool
) -> dict[str, Path]:
    """Output folders: ``one`` (one process, batch 4), ``fsdp`` (two processes, batch 2 each, ``sharded`` added),
    ``resumed`` (``fsdp`` resumed from its checkpoint-2 with FSDP); with ``cross``: ``one_from_fsdp`` (one
    process resuming ``fsdp``'s checkpoint-2) and ``fsdp_from_one`` (FSDP resuming ``one``'s)."""
    model = make_demo_model(tmp / "tiny", ROOT / "examples/data/demo_tokenizer", family=family)
    ckpt = {name: str(tmp / name / "out/checkpoint-2") for name in ("one", "fsdp")}
    configs = {
        "one": (False, {}),
        "fsdp": (True, sharded),
        "resumed": (True, {**sharded, "resume_from_checkpoint": ckpt["fsdp"]}),
    }
    if cross:
        configs |= {
            "one_from_fsdp": (False, {"resume_from_checkpoint": ckpt["fsdp"]}),
            "fsdp_from_one": (True, {**sharded, "resume_from_checkpoint": ckpt["one"]}),
        }
    for name, (two, over) in configs.items():
        path = str(dist_checks.config(tmp, model, name, **mode, **over))
        dist_checks.check(dist_checks.torchrun(*CLI, path) if two else dist_checks.single(*CLI, path))
    return {name: tmp / name / "out" for name in configs}


@pytest.fixture(scope="module", params=["full_qwen3_moe", "freeze_deepseek_v3_zero3"])
def runs(request, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "full_qwen3_moe":
        return _runs(tmp, "qwen3_moe", FULL, FSDP, cross=True)
    # shared experts, grouped routing, MLA; gradient checkpointing recomputes under FSDP2's gathers
    return _runs(tmp, "deepseek_v3", {**FREEZE, "gradient_checkpointing": True}, Z3, cross=False)


def _names(folder: Path) -> set[str]:
    """The file names in ``folder`` but the RNG states (one process writes ``rng_state.pth``, rank R its own
    ``rng_state_R.pth``)."""
    return {p.name for p in folder.iterdir() if not p.name.startswith("rng_state")}


def assert_same_tensors(got: Path, want: Path) -> int:
    """Every safetensors file of ``want`` has the same keys and tensors in ``got`` (float32: rtol 1e-5, atol 1e-6:
    one and two processes sum in another order); returns how many tensors were compared."""
    count = 0
    for file in sorted(want.glob("*.safetensors")):
        a, b = load_file(str(got / file.name)), load_file(str(file))
        assert a.keys() == b.keys(), (file.name, sorted(a.keys() ^ b.keys())[:4])
        for key in b:
            torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6, msg=f"{got / file.name}: {key}")
        count += len(b)
    return count


def assert_same_model(got: Path, want: Path) -> None:
    """Every step's loss (rel 1e-5) and every tensor of the final model and of checkpoint-4's layer files."""
    got_losses, want_losses = dict(dist_checks.losses(got)), dict(dist_checks.losses(want))
    assert sorted(got_losses) == [1, 2, 3, 4]
    for step in got_losses:
        assert got_losses[step] == pytest.approx(want_losses[step], rel=1e-5, abs=1e-6), (got, step)
    assert assert_same_tensors(got, want) > 0
    assert assert_same_tensors(got / "checkpoint-4", want / "checkpoint-4") > 0


@pytest.mark.slow
def test_fsdp_full_and_freeze_equal_one_process(runs) -> None:
    fsdp, one = runs["fsdp"], runs["one"]
    assert_same_model(fsdp, one)
    model = load_file(str(fsdp / "model.safetensors"))
    assert any(".experts." in k for k in model)  # the routed experts' trained weights are in the model
    # the same files as one process, written once: the final model and the layer-by-layer checkpoint
    assert _names(fsdp) == _names(one)
    assert _names(fsdp / "checkpoint-4") == _names(one / "checkpoint-4")
    assert "pytorch_model_fsdp.bin" not in _names(fsdp / "checkpoint-4")
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= {p.name for p in (fsdp / "checkpoint-4").iterdir()}
    for name in ("config.json", "model.safetensors.index.json"):  # the base model's layout
        if (one / name).exists():
            assert json.loads((fsdp / name).read_text()) == json.loads((one / name).read_text()), name
    got, want = (json.loads((r / "checkpoint-4/optimizer.index.json").read_text()) for r in (fsdp, one))
    assert got["files"] == want["files"] and got["param_groups"] == want["param_groups"]


@pytest.mark.slow
def test_fsdp_full_and_freeze_shard_the_dense_part_only(runs) -> None:
    sharded, whole = (json.loads((runs[n] / "run_summary.json").read_text()) for n in ("fsdp", "one"))
    assert sharded["dense_part"]["sharding"] == "fsdp2" and whole["dense_part"]["sharding"] == "whole"
    assert sharded["dense_part"]["params_gb"] == pytest.approx(whole["dense_part"]["params_gb"] / 2, abs=2e-6)
    assert sharded["routed_experts"] == whole["routed_experts"]
    # the routed experts' trained weights (host, their own optimizer) are held whole by every rank
    assert sharded["memory"]["trainable_host_params"] == whole["memory"]["trainable_host_params"] > 0


@pytest.mark.slow
def test_fsdp_full_and_freeze_resume(runs) -> None:
    # AdamW's moments come back from the layer files, cut to each rank's shards
    assert_same_model(runs["resumed"], runs["fsdp"])
    if "one_from_fsdp" in runs:  # the files hold whole tensors: one process resumes FSDP's, and the reverse
        assert_same_model(runs["one_from_fsdp"], runs["one"])
        assert_same_model(runs["fsdp_from_one"], runs["fsdp"])


@pytest.fixture(scope="module")
def lora_experts_runs(tmp_path_factory) -> dict[str, Path]:
    return _runs(tmp_path_factory.mktemp("lora_experts"), "qwen3_moe", LORA_EXPERTS, FSDP, cross=False)


@pytest.mark.slow
def test_fsdp_lora_experts_equal_one_process(lora_experts_runs) -> None:
    runs = lora_experts_runs
    dist_checks.assert_same_run(runs["fsdp"], runs["one"])
    assert assert_same_tensors(runs["fsdp"], runs["one"]) > 0  # moetune_lora_experts.safetensors included
    lora_experts = load_file(str(runs["fsdp"] / "moetune_lora_experts.safetensors"))
    assert any(k.endswith("down_proj") and t.abs().max() > 0 for k, t in lora_experts.items())  # trained
    dist_checks.assert_same_run(runs["resumed"], runs["fsdp"])
    assert assert_same_tensors(runs["resumed"], runs["fsdp"]) > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full", "lora_experts"])
def test_host_and_lora_experts_stay_out_of_fsdp(tmp_path, mode) -> None:
    # on the CPU a sharded tensor would compute the same numbers, so where each one ends up is checked directly
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    keys = FULL if mode == "full" else LORA_EXPERTS
    cfg = dist_checks.config(tmp_path, model, "two", **{**keys, **FSDP, "max_steps": 1, "save_steps": 1})
    result = dist_checks.torchrun("tests/slow/fsdp_placement.py", str(cfg))
    dist_checks.check(result)
    assert result.stdout.count("placement ok") == 2
