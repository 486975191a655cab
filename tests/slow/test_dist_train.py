"""``moetune train`` as two processes (torchrun, gloo on the CPU) against one process over the same global batches,
with the experts replicated on each rank and with ``expert_parallel: sharded`` (each rank holds half of every MoE
layer's experts; tokens travel to their owners and back): every loss and every LoRA tensor after SGD steps (each
the learning rate times the averaged gradient, expert LoRA included), one writer per file, and resuming a
checkpoint with the other number of processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from moetune.train.demo import make_demo_model
from tests.integration import dist_checks

ROOT = Path(__file__).resolve().parents[2]
CLI = ("-m", "moetune.cli.main", "train")
# plain SGD: every update is lr * gradient, so equal adapters mean equal gradients
SGD = {"optim": "sgd", "learning_rate": 0.5, "lr_scheduler_type": "constant", "max_steps": 4, "save_steps": 2}
# what the two-process runs add to their config, by expert_parallel
MODES: dict[str, dict[str, Any]] = {
    "replicated": {},
    "sharded": {"moetune": {"device": "cpu", "num_threads": 1, "expert_parallel": "sharded"}},
}


def four_runs(tmp: Path, **two: Any) -> dict[str, Path]:
    """Output folders: ``one`` (one process, batch 4), ``two`` (two processes, batch 2 each, ``two`` added to
    their config), ``two_to_one`` (one process resuming ``two``'s checkpoint-2), ``one_to_two`` (two processes,
    ``two`` added, resuming ``one``'s)."""
    model = make_demo_model(tmp / "tiny", ROOT / "examples/data/demo_tokenizer")
    one = dist_checks.config(tmp, model, "one", **SGD)
    pair = {**SGD, **two, "per_device_train_batch_size": 2}
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    result = dist_checks.torchrun(*CLI, str(dist_checks.config(tmp, model, "two", **pair)))
    dist_checks.check(result)
    assert result.stdout.count("adapter written to") == 1  # the main process reports
    back = dist_checks.config(
        tmp, model, "two_to_one", **SGD, resume_from_checkpoint=str(tmp / "two/out/checkpoint-2")
    )
    forth = dist_checks.config(
        tmp, model, "one_to_two", **pair, resume_from_checkpoint=str(tmp / "one/out/checkpoint-2")
    )
    dist_checks.check(dist_checks.single(*CLI, str(back)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(forth)))
    return {name: tmp / name / "out" for name in ("one", "two", "two_to_one", "one_to_two")}


def one_and_two_equal(tmp: Path, model: Path, mode: dict[str, Any], two: dict[str, Any]) -> dict[str, Any]:
    """One process at batch 4 and two at batch 2 (``two`` added to their config) on ``mode``: every loss and adapter
    tensor equal (``dist_checks.assert_same_run``); returns the two processes' adapter."""
    one_cfg = dist_checks.config(tmp, model, "one", **mode)
    two_cfg = dist_checks.config(tmp, model, "two", **mode, **two, per_device_train_batch_size=2)
    dist_checks.check(dist_checks.single(*CLI, str(one_cfg)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two_cfg)))
    dist_checks.assert_same_run(tmp / "two/out", tmp / "one/out")
    return dist_checks.adapter(tmp / "two/out")


@pytest.fixture(scope="module", params=list(MODES))
def runs(request, tmp_path_factory) -> dict[str, Path]:
    return four_runs(tmp_path_factory.mktemp(request.param), **MODES[request.param])


@pytest.mark.slow
def test_two_processes_equal_one(runs, request) -> None:
    dist_checks.assert_same_run(runs["two"], runs["one"])
    adapter = dist_checks.adapter(runs["two"])
    experts = [k for k in adapter if ".experts." in k and "lora_B" in k]
    assert experts and all(adapter[k].abs().max() > 0 for k in experts)  # expert LoRA was trained
    config = [json.loads((runs[n] / "adapter_config.json").read_text()) for n in ("two", "one")]
    assert config[0] == config[1]  # the whole adapter, as one process writes it (stock PEFT loads that one)
    held = [json.loads((runs[n] / "run_summary.json").read_text())["routed_experts"] for n in ("two", "one")]
    mode = request.node.callspec.params["runs"]
    assert held[0]["expert_parallel"] == mode and held[1]["expert_parallel"] == "replicated"
    assert held[1]["experts_per_layer"] == "8 of 8"
    assert held[0]["experts_per_layer"] == ("4 of 8" if mode == "sharded" else "8 of 8")
    share = 2 if mode == "sharded" else 1  # rank 0's engines (GiB, rounded to 6 digits)
    assert held[0]["engines_gb"] == pytest.approx(held[1]["engines_gb"] / share, abs=2e-6)


@pytest.mark.slow
def test_two_processes_write_each_file_once(runs) -> None:
    out = runs["two"]
    log = [json.loads(line) for line in (out / "trainer_log.jsonl").read_text().splitlines()]
    # one writer: each step's loss logged once, and the Trainer's final log (no loss) once
    assert [r["current_steps"] for r in log if "loss" in r] == [1, 2, 3, 4]
    assert len(log) == 5
    for name in ("adapter_config.json", "tokenizer.json", "run_summary.json", "loss_curve.png"):
        assert (out / name).is_file(), name
    ckpt = out / "checkpoint-4"
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "adapter_model.safetensors"} <= {
        p.name for p in ckpt.iterdir()
    }
    assert not [p.name for p in out.iterdir() if p.name.startswith((".", "tmp-"))]


@pytest.mark.slow
def test_resume_with_another_number_of_processes(runs) -> None:
    for resumed in ("two_to_one", "one_to_two"):
        state = json.loads((runs[resumed] / "trainer_state.json").read_text())
        assert state["global_step"] == 4
        dist_checks.assert_same_run(runs[resumed], runs["one"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_two_processes_equal_one_deepseek_v3(tmp_path, mode) -> None:
    # shared experts (overlapped with the engine, and with the exchange when sharded), grouped routing, MLA
    # attention: one family apart from qwen3_moe; gradient checkpointing: sharded, the recompute repeats every
    # layer's exchange on both ranks
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer", family="deepseek_v3")
    steps = {**SGD, "max_steps": 4, "save_steps": 4, "gradient_checkpointing": True}
    adapter = one_and_two_equal(tmp_path, model, steps, MODES[mode])
    assert any(".experts." in k and adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)


# sgd: the Trainer's optimizer on dense expert gradients; adamw_torch / adamw_8bit with expert_update lazy:
# moetune's expert optimizer on sparse gradients, averaged over the ranks before the step (host_grads.average_sparse)
FREEZE_OPTIMS = {
    "sgd": {},
    "adamw": {"optim": "adamw_torch", "learning_rate": 1e-2, "adam_epsilon": 1e-3},
    "adamw_8bit_lazy": {
        "optim": "adamw_8bit",
        "learning_rate": 1e-2,
        "adam_epsilon": 1e-3,
        "expert_update": "lazy",
    },
}
# adam_epsilon 1e-3: with torch's 1e-8, AdamW turns a gradient of ~1e-9 (an expert with one routed row) into a
# full-size step, so fp32 summation-order differences between one and two processes moved such weights by up to
# 2e-4; with 1e-3 the update is smooth in the gradient and the runs agree to the tolerance below


@pytest.mark.slow
@pytest.mark.parametrize("optim", list(FREEZE_OPTIMS))
def test_two_processes_equal_one_freeze(tmp_path, optim) -> None:
    # the last layer trains fully, its routed experts' weights included (CPU parameters averaged over the ranks);
    # checkpoints are written layer by layer (a second writer there failed inside the staging before the fix)
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    mode = {"finetuning_type": "freeze", "freeze_trainable_layers": 1, "freeze_trainable_modules": "all"}
    mode |= {**SGD, **FREEZE_OPTIMS[optim]}
    one = dist_checks.config(tmp_path, model, "one", **mode)
    two = dist_checks.config(tmp_path, model, "two", **mode, per_device_train_batch_size=2)
    dist_checks.check(dist_checks.single(*CLI, str(one)))
    dist_checks.check(dist_checks.torchrun(*CLI, str(two)))
    got, want = dict(dist_checks.losses(tmp_path / "two/out")), dict(dist_checks.losses(tmp_path / "one/out"))
    assert sorted(got) == [1, 2, 3, 4]
    assert all(got[s] == pytest.approx(want[s], rel=1e-5, abs=1e-6) for s in got)
    a, b = (load_file(str(tmp_path / name / "out/model.safetensors")) for name in ("two", "one"))
    assert a.keys() == b.keys() and any("experts" in k for k in a)
    for key in a:
        if "8bit" not in optim:
            torch.testing.assert_close(
                a[key], b[key], rtol=1e-4, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}"
            )
            continue
        # 8-bit moments: a summation-order difference can flip one code of a block, moving that weight by a
        # fraction of lr (1e-2; seen: one of 1536 by 2.2e-4 on a Zen 4): every weight within lr / 10, and all but
        # 1% of each tensor's within the fp32 tolerance (a wrong average or a missed step moves most of them)
        diff = (a[key] - b[key]).abs()
        assert diff.max() <= 1e-3, (key, diff.max().item())
        off = diff > 1e-6 + 1e-4 * b[key].abs()
        assert off.float().mean() <= 0.01, (key, int(off.sum()), off.numel())
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.index.json"} <= {
        p.name for p in (tmp_path / "two/out/checkpoint-4").iterdir()
    }


@pytest.mark.slow
@pytest.mark.parametrize("experts", list(MODES))
def test_lora_on_the_routed_experts_only(tmp_path, experts) -> None:
    # nothing dense trains, so nothing is left for DDP (torch's DDP refuses such a model; refused at start before):
    # the model is not wrapped in DDP and moetune averages (replicated) or scales (sharded) the experts' LoRA
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    adapter = one_and_two_equal(tmp_path, model, {**SGD, "lora_target": "experts"}, MODES[experts])
    assert adapter and all(".experts." in k for k in adapter)
    assert any(adapter[k].abs().max() > 0 for k in adapter if "lora_B" in k)


@pytest.mark.slow
def test_sharded_failure_in_an_expert_layer_ends_the_other_rank(tmp_path) -> None:
    # rank 1 raises after its first MoE layer's third call, so rank 0 waits in the next MoE layer's token exchange
    # (a collective of the exchange's own group, not DDP's): the watchdog ends rank 0 with rank 1's cause
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    cfg = dist_checks.config(
        tmp_path, model, "out", **MODES["sharded"], max_steps=6, per_device_train_batch_size=2
    )
    result = dist_checks.torchrun(
        "tests/integration/dist_checks.py", "fail_on_rank", str(cfg), "1", "experts", timeout=90
    )
    assert result.returncode != 0
    cause = "RuntimeError: injected failure on rank 1"
    assert f"moetune rank 0: stopping: rank 1 failed: {cause}" in result.stderr, result.stderr[-6000:]


@pytest.mark.slow
def test_demo_config_under_torchrun(tmp_path) -> None:
    """The shipped demo config (examples/demo_lora.yaml: AdamW, cosine schedule, evaluation), its paths and length
    changed only, under ``torchrun --nproc-per-node 2`` at half the batch each, against one process: the same
    logged losses and eval loss (AdamW's division by the gradient's moments amplifies the reduction order's
    last-bit differences, hence rel 1e-4) and the same final adapter."""
    import yaml

    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    demo = yaml.safe_load((ROOT / "examples/demo_lora.yaml").read_text())
    demo.update(
        model_name_or_path=str(model),
        dataset_dir=str(ROOT / "examples/data"),
        max_steps=20,
        logging_steps=5,
        eval_steps=10,
        save_steps=10,
        ddp_timeout=120,
    )
    demo["moetune"] = {**demo.get("moetune", {}), "num_threads": 1}
    runs = {}
    for name, procs in (("one", 1), ("two", 2)):
        cfg = {
            **demo,
            "output_dir": str(tmp_path / name / "out"),
            "per_device_train_batch_size": demo["per_device_train_batch_size"] // procs,
        }
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        result = dist_checks.single(*CLI, str(path)) if procs == 1 else dist_checks.torchrun(*CLI, str(path))
        dist_checks.check(result)
        runs[name] = tmp_path / name / "out"
    one, two = dict(dist_checks.losses(runs["one"])), dict(dist_checks.losses(runs["two"]))
    assert sorted(one) == sorted(two) == [5, 10, 15, 20]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step

    def eval_losses(out: Path) -> list[float]:
        history = json.loads((out / "trainer_state.json").read_text())["log_history"]
        return [h["eval_loss"] for h in history if "eval_loss" in h]

    assert eval_losses(runs["two"]) == pytest.approx(eval_losses(runs["one"]), rel=1e-4)
    assert len(eval_losses(runs["one"])) >= 2
    a, b = dist_checks.adapter(runs["two"]), dist_checks.adapter(runs["one"])
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-3, atol=1e-5, msg=key)
