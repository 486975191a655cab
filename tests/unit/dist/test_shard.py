"""``expert_parallel`` in one process: the option's checks, which experts a rank holds, and loading only them
(``stream_experts(..., experts=...)``) against the whole engine's slice, for per-expert and fused checkpoint
layouts (quantized checkpoints: ``test_shard_quantized.py``); what sharding does not run is refused from
headers, before any expert is read."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from moetune.config import parse_config
from moetune.config.experts import ExpertParallel, expert_option_problems
from moetune.dist.shard import ExpertShard, expert_shard
from moetune.errors import ConfigError
from moetune.loading.load import plan_load, shard_slices
from moetune.loading.options import LoadOptions
from moetune.loading.stream import stream_experts
from moetune.testing.fp8_checkpoint import save_fp8_checkpoint
from moetune.testing.tiny import save_tiny_model

ROOT = Path(__file__).resolve().parents[3]


def _raw(tmp_path, **over):
    data = {"dataset": "demo_train", "dataset_dir": str(ROOT / "examples/data")}
    return {"model_name_or_path": "m", **data, "output_dir": str(tmp_path / "o"), **over}


def test_option_values_and_conflicts(tmp_path) -> None:
    assert expert_option_problems({"expert_parallel": "sharded"}) == []
    assert LoadOptions.create(expert_parallel="sharded").experts.expert_parallel is ExpertParallel.SHARDED
    with pytest.raises(ConfigError, match="expert_parallel got 'spread'; allowed: replicated, sharded"):
        LoadOptions.create(expert_parallel="spread")
    with pytest.raises(ConfigError, match="expert_parallel is 'sharded' but gpu_experts is set"):
        LoadOptions.create(expert_parallel="sharded", gpu_experts=2)
    with pytest.raises(
        ConfigError, match=r"moetune\.expert_parallel: is 'sharded' with finetuning_type full"
    ):
        parse_config(
            _raw(tmp_path, finetuning_type="full", moetune={"expert_parallel": "sharded"}),
            check_model_path=False,
        )
    cfg = parse_config(_raw(tmp_path, moetune={"expert_parallel": "sharded"}), check_model_path=False)
    assert cfg.engine.experts.expert_parallel is ExpertParallel.SHARDED
    # the sharded expert LoRA is gathered by rows to the global main process: no per-node saves, row-shaped state
    sharded = {"moetune": {"expert_parallel": "sharded"}}
    with pytest.raises(ConfigError, match=r"optim: is 'adamw_8bit' with expert_parallel: sharded"):
        parse_config(_raw(tmp_path, optim="adamw_8bit", **sharded), check_model_path=False)
    with pytest.raises(ConfigError, match=r"save_on_each_node: is true with expert_parallel: sharded"):
        parse_config(_raw(tmp_path, save_on_each_node=True, **sharded), check_model_path=False)
    # replicated: both fine (adamw_8bit under LoRA is bitsandbytes', which config validation asks for when absent)
    bnb = importlib.util.find_spec("bitsandbytes") is not None
    parse_config(
        _raw(tmp_path, optim="adamw_torch" if not bnb else "adamw_8bit", save_on_each_node=True),
        check_model_path=False,
    )


def test_which_experts_a_rank_holds() -> None:
    assert [ExpertShard(r, 4, None).experts(16) for r in range(4)] == [
        range(0, 4),
        range(4, 8),
        range(8, 12),
        range(12, 16),
    ]
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.experts has E = 8 experts and 3 processes"):
        ExpertShard(0, 3, None).owners(8, "model.layers.0.mlp.experts")


def test_one_process_holds_every_expert(caplog) -> None:
    assert expert_shard(ExpertParallel.REPLICATED) is None
    with caplog.at_level(logging.INFO, logger="moetune.dist.shard"):
        assert expert_shard(ExpertParallel.SHARDED) is None
    assert "sharded with one process: this process holds every expert" in caplog.text


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])  # per-expert keys; fused, interleaved, biases
def test_a_rank_reads_only_its_experts(tmp_path, family) -> None:
    path = save_tiny_model(family, tmp_path / family, tokenizer=False)
    opts = LoadOptions.create(device="cpu", dtype="float32", progress=False)
    planned = plan_load(path, opts)
    shard = ExpertShard(1, 2, None)
    slices = shard_slices(shard, planned)
    assert slices is not None and len(slices) == len(planned.plan.layers)
    whole = list(
        stream_experts(
            planned.checkpoint, planned.plan.layers, planned.formats, opts.dtype, opts.engine, progress=False
        )
    )
    part = list(
        stream_experts(
            planned.checkpoint,
            planned.plan.layers,
            planned.formats,
            opts.dtype,
            opts.engine,
            progress=False,
            experts=slices,
        )
    )
    for (layer, full), (_, mine), held in zip(whole, part, slices):
        e = layer.site.layout.num_experts
        assert held == range(e // 2, e) and mine.num_experts == e // 2
        rows = slice(held.start, held.stop)
        torch.testing.assert_close(mine.weights.gate_up, full.weights.gate_up[rows], rtol=0, atol=0)
        torch.testing.assert_close(mine.weights.down, full.weights.down[rows], rtol=0, atol=0)
        for bias in ("gate_up_bias", "down_bias"):
            got, want = getattr(mine, bias), getattr(full, bias)
            assert (got is None) == (want is None)
            if want is not None:
                torch.testing.assert_close(got, want[rows], rtol=0, atol=0)


def test_refused_before_any_expert_is_read(tmp_path) -> None:
    opts = LoadOptions.create(device="cpu", dtype="float32", progress=False)
    planned = plan_load(save_tiny_model("qwen3_moe", tmp_path / "q", tokenizer=False), opts)
    with pytest.raises(ConfigError, match="E = 8 experts and 3 processes were launched"):
        shard_slices(ExpertShard(0, 3, None), planned)
    fp8 = plan_load(save_fp8_checkpoint("deepseek_v3", tmp_path / "fp8"), opts)  # quantized: the same check
    with pytest.raises(ConfigError, match="E = 8 experts and 3 processes were launched"):
        shard_slices(ExpertShard(0, 3, None), fp8)
