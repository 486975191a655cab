"""Sharded expert LoRA (``expert_parallel: sharded``: each rank holds, trains and steps its experts' LoRA rows only)
against one process over the same global batches, with AdamW (the moments of each rank's rows in a file of its
own in every checkpoint, put together again on resume with any number of processes): 2 and 4 processes, sharded and replicated, resuming a 2-process checkpoint
in 1 and in 4 processes, uneven routing (the first MoE layer's router folded onto experts 0-3, so in a 4-process
sharded run ranks 2 and 3 receive no token there), deepseek_v3, and several nodes on this machine (two torchrun
invocations, ``--nnodes 2``)."""

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
FOLDED = ("tests/integration/dist_checks.py", "train_folded")  # the recipe, first MoE router folded onto 0-3
# AdamW with adam_epsilon 1e-3: smooth in the gradient, so summation-order differences between process counts stay
# within the tolerance (with 1e-8 a gradient of ~1e-9 becomes a full-size step; test_dist_train.py explains)
ADAMW = {
    "optim": "adamw_torch",
    "learning_rate": 1e-2,
    "adam_epsilon": 1e-3,
    "lr_scheduler_type": "constant",
    "max_steps": 4,
    "save_steps": 2,
}
SHARDED = {"moetune": {"device": "cpu", "num_threads": 1, "expert_parallel": "sharded"}}
GLOBAL_BATCH = 4


def _config(tmp: Path, model: Path, name: str, processes: int, **over: Any) -> str:
    per = GLOBAL_BATCH // processes
    return str(dist_checks.config(tmp, model, name, **{**ADAMW, "per_device_train_batch_size": per, **over}))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One process; 2 sharded (its checkpoint-2 resumed by 4 sharded and by 1); 4 replicated; all folded."""
    tmp = tmp_path_factory.mktemp("sharded_lora")
    model = make_demo_model(tmp / "tiny", ROOT / "examples/data/demo_tokenizer")
    resume = str(tmp / "two/out/checkpoint-2")
    dist_checks.check(dist_checks.single(*FOLDED, _config(tmp, model, "one", 1), "4"))
    dist_checks.check(dist_checks.torchrun(*FOLDED, _config(tmp, model, "two", 2, **SHARDED), "4"))
    four = _config(tmp, model, "four_replicated", 4)
    dist_checks.check(dist_checks.torchrun(*FOLDED, four, "4", nproc=4, timeout=400))
    to_four = _config(tmp, model, "two_to_four", 4, **SHARDED, resume_from_checkpoint=resume)
    dist_checks.check(dist_checks.torchrun(*FOLDED, to_four, "4", nproc=4, timeout=400))
    to_one = _config(tmp, model, "two_to_one", 1, resume_from_checkpoint=resume)
    dist_checks.check(dist_checks.single(*FOLDED, to_one, "4"))
    return {n: tmp / n / "out" for n in ("one", "two", "four_replicated", "two_to_four", "two_to_one")}


def _assert_same_run(got: Path, want: Path) -> None:
    """``dist_checks.assert_same_run``, and the expert LoRA was trained (some expert lora_B non-zero)."""
    dist_checks.assert_same_run(got, want)
    a = dist_checks.adapter(got)
    assert any(".experts." in k and a[k].abs().max() > 0 for k in a if "lora_B" in k)


@pytest.mark.slow
def test_two_and_four_processes_and_resumes_equal_one(runs) -> None:
    for name in ("two", "four_replicated", "two_to_four", "two_to_one"):
        _assert_same_run(runs[name], runs["one"])
    for name in ("two_to_four", "two_to_one"):
        assert json.loads((runs[name] / "trainer_state.json").read_text())["global_step"] == 4


@pytest.mark.slow
def test_sharded_checkpoint_holds_one_process_state(runs) -> None:
    # the adapter gathered whole: the same keys, shapes and values as one process's; AdamW's moments of the expert
    # LoRA in one file per rank (its experts' rows), which put together are one process's moments
    got, want = runs["two"] / "checkpoint-2", runs["one"] / "checkpoint-2"
    a, b = dist_checks.adapter(got), dist_checks.adapter(want)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-6, msg=key)
    assert json.loads((got / "adapter_config.json").read_text()) == json.loads(
        (want / "adapter_config.json").read_text()
    )
    files = [load_file(str(got / f"expert_lora_optimizer-rank{r}-of-2.safetensors")) for r in range(2)]
    assert files[0].keys() == files[1].keys() and files[0]
    rows: dict[str, Any] = {}
    for key in files[0]:
        name, _, state = key.rpartition("/")
        assert ".experts." in name and state in ("exp_avg", "exp_avg_sq"), key
        if ".lora_A." in name:  # [E r, in]: rank 0's experts' rows first
            rows[key] = torch.cat([f[key] for f in files], dim=0)
        else:  # [out, r E] viewed [out, r, E]: the experts are the last axis
            out, cols = files[0][key].shape
            rows[key] = torch.cat([f[key].view(out, 4, cols // 4) for f in files], dim=2).reshape(out, -1)
    opt = [torch.load(f / "optimizer.pt", weights_only=True) for f in (got, want)]
    assert (
        opt[0]["param_groups"] == opt[1]["param_groups"] and opt[0]["state"].keys() == opt[1]["state"].keys()
    )
    moved = set()  # indices whose moments are in the rows files instead of optimizer.pt
    for i, state in opt[1]["state"].items():
        mine = opt[0]["state"][i]
        if "exp_avg" in mine:
            for key, value in state.items():
                torch.testing.assert_close(mine[key], value, rtol=1e-4, atol=1e-7, msg=f"{i} {key}")
            continue
        moved.add(i)
        # one process's moments of this weight equal exactly one weight's put-together rows
        matches = [
            k
            for k in rows
            if k.endswith("/exp_avg")
            and rows[k].shape == state["exp_avg"].shape
            and torch.allclose(rows[k], state["exp_avg"], rtol=1e-4, atol=1e-7)
        ]
        assert len(matches) == 1, (i, matches)
        sq = matches[0].replace("/exp_avg", "/exp_avg_sq")
        torch.testing.assert_close(rows[sq], state["exp_avg_sq"], rtol=1e-4, atol=1e-7)
    assert len(moved) == len(rows) // 2  # every expert LoRA weight, each once
    # what each rank holds: the main process's summary counts its experts' LoRA rows, half of one process's
    summary = [json.loads((runs[n] / "run_summary.json").read_text()) for n in ("two", "one")]
    assert summary[0]["routed_experts"]["experts_per_layer"] == "4 of 8"
    memory = [s["memory"] for s in summary]
    assert memory[0]["trainable_host_params"] * 2 == memory[1]["trainable_host_params"] > 0
    assert memory[0]["trainable_device_params"] == memory[1]["trainable_device_params"]


@pytest.mark.slow
def test_four_sharded_processes_equal_one_deepseek_v3(tmp_path) -> None:
    # shared experts, grouped routing, MLA attention; 4 ranks x 2 of 8 experts, AdamW, clipping on (max_grad_norm 1)
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer", family="deepseek_v3")
    over = {"save_steps": 4}
    dist_checks.check(dist_checks.single(*CLI, _config(tmp_path, model, "one", 1, **over)))
    four = _config(tmp_path, model, "four", 4, **over, **SHARDED)
    dist_checks.check(dist_checks.torchrun(*CLI, four, nproc=4, timeout=400))
    _assert_same_run(tmp_path / "four/out", tmp_path / "one/out")


@pytest.mark.slow
@pytest.mark.parametrize("per_node", [1, 2])
def test_two_nodes_equal_one_process(tmp_path, per_node) -> None:
    # two torchrun invocations as nodes 0 and 1 (static rendezvous at node 0), sharded experts: RANK is global,
    # LOCAL_RANK restarts on each node; files are written by the global main process only (rank 0 on node 0)
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    over = {"save_steps": 4}
    dist_checks.check(dist_checks.single(*FOLDED, _config(tmp_path, model, "one", 1, **over), "4"))
    cfg = _config(tmp_path, model, "nodes", 2 * per_node, **over, **SHARDED)
    results = dist_checks.nodes(*FOLDED, cfg, "4", nnodes=2, nproc=per_node, timeout=400)
    for result in results:
        dist_checks.check(result)
    ranks = [
        [line for line in r.stdout.splitlines() if line.startswith("rank ") and "trained" in line]
        for r in results
    ]
    world = 2 * per_node
    for node, lines in enumerate(ranks):
        want = {f"rank {node * per_node + i} of {world} (local {i}): trained" for i in range(per_node)}
        assert set(lines) == want, lines
    _assert_same_run(tmp_path / "nodes/out", tmp_path / "one/out")
    log = (tmp_path / "nodes/out/trainer_log.jsonl").read_text().splitlines()
    assert [json.loads(line).get("current_steps") for line in log if "loss" in json.loads(line)] == [
        1,
        2,
        3,
        4,
    ]
    ckpt = tmp_path / "nodes/out/checkpoint-4"
    assert {f"rng_state_{r}.pth" for r in range(world)} <= {p.name for p in ckpt.iterdir()}


@pytest.mark.slow
def test_nodes_without_a_shared_output_dir_are_refused(tmp_path) -> None:
    # node 1 writes to another folder, as a node whose disk is not rank 0's would: refused before the model loads,
    # the cause printed on both nodes
    model = make_demo_model(tmp_path / "tiny", ROOT / "examples/data/demo_tokenizer")
    cfgs = [_config(tmp_path, model, f"node{i}", 2, **SHARDED) for i in range(2)]
    results = dist_checks.nodes(node_args=[(*CLI, c) for c in cfgs], nnodes=2, nproc=1, timeout=120)
    assert all(r.returncode != 0 for r in results)
    cause = "rank 1 failed: DistError: output_dir"
    assert "does not see the file rank 0 wrote there" in results[1].stderr, results[1].stderr[-4000:]
    assert f"moetune rank 0: stopping: {cause}" in results[0].stderr, results[0].stderr[-4000:]
    assert not (tmp_path / "node0/out/adapter_model.safetensors").exists()
