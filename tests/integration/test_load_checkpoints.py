"""Every on-disk experts layout, and sharded checkpoints, load to the same logits as transformers.

The reference is transformers' float32 model loaded from the ``save_pretrained`` checkpoint; the other
layouts are written by hand from its runtime (fused) state dict with safetensors, then loaded by moetune
only (transformers reads some of them itself, some not: Qwen3-VL's transposed layout on a Qwen3-MoE).
One engine thread: tiny GEMMs on a shared 2-core machine (see ``load_checks``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import moetune
from moetune.loading.checkpoint import Checkpoint
from moetune.testing.tiny import EXPERT_INTERMEDIATE as I
from moetune.testing.tiny import NUM_EXPERTS as E
from moetune.testing.tiny import save_tiny_model

TOL = 1e-5


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> (checkpoint dir, transformers model, its runtime state dict), built on first use."""
    cache: dict[str, tuple[Path, torch.nn.Module, dict[str, torch.Tensor]]] = {}

    def get(family: str):
        if family not in cache:
            path = save_tiny_model(family, tmp_path_factory.mktemp(family), tokenizer=False)
            ref = _hf(path)
            cache[family] = (path, ref, {k: v.detach().clone() for k, v in ref.state_dict().items()})
        return cache[family]

    return get


def _write(dst: Path, src: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(dst / "model.safetensors"),
        metadata={"format": "pt"},
    )
    return dst


def _per_expert(state: dict, names=("gate_proj", "up_proj", "down_proj"), container=None) -> dict:
    """Runtime ``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` -> one ``[out, in]`` matrix per expert."""
    out = {}
    for key, t in state.items():
        stem, _, leaf = key.rpartition(".")
        if container:
            stem = stem.replace(".mlp.", f".{container}.")
        if leaf == "gate_up_proj":
            for e in range(t.shape[0]):
                out[f"{stem}.{e}.{names[0]}.weight"] = t[e, :I]
                out[f"{stem}.{e}.{names[1]}.weight"] = t[e, I:]
        elif leaf == "down_proj" and stem.endswith("experts"):
            for e in range(t.shape[0]):
                out[f"{stem}.{e}.{names[2]}.weight"] = t[e]
        else:
            out[key.replace(".mlp.", f".{container}.") if container else key] = t
    return out


def _transposed(state: dict) -> dict:
    """Fused expert tensors with their last two dimensions swapped (Qwen3-VL's ``[E, H, 2I]``)."""
    return {
        k: v.transpose(1, 2) if k.endswith(("experts.gate_up_proj", "experts.down_proj")) else v
        for k, v in state.items()
    }


LAYOUTS = {
    "fused": ("qwen3_moe", lambda s: s),
    "fused_transposed": ("qwen3_moe", _transposed),
    "per_expert": ("qwen3_moe", _per_expert),
    "per_expert_w1_w3_w2": ("mixtral", lambda s: _per_expert(s, ("w1", "w3", "w2"), "block_sparse_moe")),
    "gpt_oss_untransposed": ("gpt_oss", _transposed),  # [E, 2I, H] interleaved, swapped vs the module
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_loads_exactly(layout, saved, tmp_path):
    family, rewrite = LAYOUTS[layout]
    path, ref, state = saved(family)
    written = _write(tmp_path / layout, path, rewrite(state))
    model = moetune.load_model(written, device="cpu", dtype="float32", progress=False, num_threads=1)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max().item() <= TOL


def test_sharded_bf16_checkpoint(tmp_path):
    path = save_tiny_model(
        "qwen2_moe", tmp_path / "sharded", dtype=torch.bfloat16, max_shard_size="40KB", tokenizer=False
    )
    ckpt = Checkpoint.open(path)
    assert len(ckpt.files) >= 3
    by_layer: dict[str, set[str]] = {}
    for info in ckpt.tensors.values():
        if ".experts." in info.key:
            by_layer.setdefault(info.key.split(".experts.")[0], set()).add(info.file)
    assert any(len(files) > 1 for files in by_layer.values()), "no experts layer spans two shards"
    ref = _hf(path)
    model = moetune.load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1)
    ids = torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max().item() <= TOL
    engine = model.model.layers[1].mlp.experts.engine
    assert engine.weights.gate_up.dtype == torch.float32 and engine.weights.gate_up.shape == (E, 2 * I, 64)


def test_tokenizer_and_generation_config_round_trip(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig

    path = save_tiny_model("olmoe", tmp_path / "olmoe")
    GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0).save_pretrained(path)
    model = moetune.load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("w1 w2 w3", return_tensors="pt").input_ids
    assert model.generation_config.max_new_tokens == 3
    assert model.generate(ids).shape == (1, ids.shape[1] + 3)
