"""The wide-checkpoint writer behind the load-memory test and the model benchmark, and the plain-read path
the loader streams experts through (``ShardReader.read``), on a small shape: both against safetensors and
transformers' own loading."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

import moetune
from moetune.loading.checkpoint import Checkpoint, ShardReader
from moetune.testing.wide import WideShape, write_wide_checkpoint

SMALL = WideShape(
    layers=2, experts=8, top_k=2, hidden=64, intermediate=24, heads=4, kv_heads=2, head_dim=16, vocab=96
)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    path = tmp_path_factory.mktemp("wide")
    return write_wide_checkpoint(path, SMALL, dtype=torch.float32, shard_bytes=100_000)


def test_writer_makes_a_checkpoint_transformers_loads(wide):
    from transformers import AutoModelForCausalLM

    index = json.loads((wide / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    ref, info = AutoModelForCausalLM.from_pretrained(wide, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    model = moetune.load_model(wide, device="cpu", dtype="float32", progress=False, num_threads=1)
    ids = torch.randint(0, SMALL.vocab, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - ref.eval()(ids).logits).abs().max().item() <= 1e-5
    experts = model.model.layers[1].mlp.experts.engine.weights
    assert experts.gate_up.shape == (SMALL.experts, 2 * SMALL.intermediate, SMALL.hidden)


def test_shard_reader_reads_what_safetensors_reads(wide):
    ckpt = Checkpoint.open(wide)
    with ShardReader(ckpt, [ckpt.files]) as reader:
        for info in ckpt.tensors.values():
            with safe_open(str(wide / info.file), framework="pt") as f:
                want = f.get_tensor(info.key)
            assert torch.equal(reader.read(info), want), info.key
            if want.dim() >= 2:  # a slice along dim 0, as the loader reads one expert of a fused tensor
                last = want.shape[0] - 1
                assert torch.equal(reader.read(info, last), want[last]), info.key
