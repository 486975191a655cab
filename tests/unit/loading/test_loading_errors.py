"""Every checkpoint problem a user can cause is a ``LoadError``/``ArchError`` naming what is wrong, raised
before any weight is read (transformers' loader and the expert streaming are never reached)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from moetune.errors import ArchError, ConfigError, LoadError, MoetuneError
from moetune.loading import load as load_module
from moetune.testing.tiny import save_tiny_model

LAYER0 = "model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("src"), tokenizer=False)


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy checkpoint ``src`` to ``dst`` with its tensors passed through ``edit(dict) -> dict``."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(str(dst / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load(path):
    return moetune.load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1)


def test_errors_share_the_root():
    assert issubclass(LoadError, MoetuneError) and issubclass(ArchError, MoetuneError)


def test_model_type_unknown_to_transformers(source, tmp_path, no_heavy_work):
    dst = shutil.copytree(source, tmp_path / "ckpt")
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "model_type": "foo_moe"}))
    with pytest.raises(ArchError, match=r"'foo_moe'.*\n(.|\n)*qwen3_moe(.|\n)*generic"):
        _load(dst)


def test_dense_model_is_not_a_supported_architecture(tmp_path, no_heavy_work):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    with pytest.raises(ArchError, match=r"model_type 'llama'.*not a supported MoE(.|\n)*mixtral"):
        _load(tmp_path / "llama")


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(LoadError, match="does not exist"):
        _load(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match="no config.json"):
        _load(tmp_path / "empty")


def test_not_safetensors(source, tmp_path):
    dst = tmp_path / "bin"
    dst.mkdir()
    shutil.copy(source / "config.json", dst / "config.json")
    torch.save(load_file(str(source / "model.safetensors")), dst / "pytorch_model.bin")
    with pytest.raises(LoadError, match=r"not in safetensors format \(found pytorch_model.bin\)"):
        _load(dst)


def test_missing_shard(tmp_path, no_heavy_work):
    path = save_tiny_model("qwen3_moe", tmp_path / "sharded", max_shard_size="40KB", tokenizer=False)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    with pytest.raises(
        LoadError, match=rf"missing 1 of its {len(shards)} shards.*{shards[1].name} \(\d+ tensors\)"
    ):
        _load(path)


def test_truncated_shard(source, tmp_path):
    dst = shutil.copytree(source, tmp_path / "ckpt")
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match="model.safetensors is truncated"):
        _load(dst)


def test_missing_expert_tensor(source, tmp_path, no_heavy_work):
    key = f"{LAYER0}.3.up_proj.weight"
    dst = _rewrite(source, tmp_path / "ckpt", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(
        LoadError, match=rf"missing {key} \(up of expert 3 of {LAYER0}; .* in model.safetensors\)"
    ):
        _load(dst)


def test_missing_layer_of_experts(source, tmp_path, no_heavy_work):
    dst = _rewrite(
        source, tmp_path / "ckpt", lambda t: {k: v for k, v in t.items() if not k.startswith(LAYER0)}
    )
    with pytest.raises(LoadError, match=rf"{LAYER0}: no expert tensors at all"):
        _load(dst)


@pytest.mark.parametrize(
    ("extra", "why"),
    [
        (f"{LAYER0}.8.gate_proj.weight", "expert index 8 out of range"),
        (f"{LAYER0}.0.fc9.weight", "unknown expert projection 'fc9'"),
        (f"{LAYER0}.0.gate_proj.bias", "not an expert tensor name"),
        (f"{LAYER0}.gate_up_proj", "mixes per-expert keys"),
    ],
)
def test_unexpected_expert_tensor(source, tmp_path, no_heavy_work, extra, why):
    def add(t):
        shape = (8, 48, 64) if extra.endswith("gate_up_proj") else t[f"{LAYER0}.0.gate_proj.weight"].shape
        return {**t, extra: torch.zeros(shape[-1:] if extra.endswith("bias") else shape)}

    dst = _rewrite(source, tmp_path / "ckpt", add)
    with pytest.raises(LoadError, match=why) as err:
        _load(dst)
    if "mixes" not in why:
        assert f"model.safetensors: unexpected expert tensor {extra}" in str(err.value)


def test_wrong_expert_shape(source, tmp_path, no_heavy_work):
    key = f"{LAYER0}.5.down_proj.weight"
    dst = _rewrite(source, tmp_path / "ckpt", lambda t: {**t, key: t[key].t().contiguous()})
    with pytest.raises(LoadError, match=rf"{key} .*shape \(24, 64\), expected \(64, 24\)"):
        _load(dst)


def test_wrong_fused_shape(source, tmp_path, no_heavy_work):
    def fuse(t):
        out = {k: v for k, v in t.items() if not k.startswith(LAYER0)}
        out[f"{LAYER0}.gate_up_proj"] = torch.zeros(8, 48, 60)
        out[f"{LAYER0}.down_proj"] = torch.zeros(8, 64, 24)
        return out

    dst = _rewrite(source, tmp_path / "ckpt", fuse)
    with pytest.raises(
        LoadError, match=r"gate_up_proj.*shape \(8, 48, 60\), expected \(8, 48, 64\) or \(8, 64, 48\)"
    ):
        _load(dst)


def test_quantized_expert_dtype(source, tmp_path, no_heavy_work):
    key = f"{LAYER0}.1.gate_proj.weight"
    dst = _rewrite(source, tmp_path / "ckpt", lambda t: {**t, key: t[key].to(torch.int8)})
    with pytest.raises(LoadError, match=rf"{key} is I8"):
        _load(dst)


def test_wrong_non_expert_shape(source, tmp_path, no_heavy_work):
    key = "model.layers.1.self_attn.q_proj.weight"
    dst = _rewrite(source, tmp_path / "ckpt", lambda t: {**t, key: torch.zeros(3, 64)})
    with pytest.raises(LoadError, match=rf"{key} has shape \(3, 64\)"):
        _load(dst)


def test_missing_non_expert_tensor(source, tmp_path, no_heavy_work):
    key = "model.layers.2.self_attn.k_proj.weight"
    dst = _rewrite(source, tmp_path / "ckpt", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(LoadError, match=rf"no tensor for {key} in any shard"):
        _load(dst)


def test_missing_tensor_caught_by_transformers_loader(source, tmp_path, monkeypatch):
    """The check after transformers' loader, for checkpoints whose keys go through converters."""
    monkeypatch.setattr(load_module.hf, "check_non_expert", lambda *args: None)
    key = "model.layers.2.self_attn.k_proj.weight"
    dst = _rewrite(source, tmp_path / "ckpt", lambda t: {k: v for k, v in t.items() if k != key})
    with pytest.raises(LoadError, match=rf"lacks 1 non-expert tensor\(s\) the model needs: {key}"):
        _load(dst)


def test_quantized_checkpoint(source, tmp_path, no_heavy_work):
    dst = shutil.copytree(source, tmp_path / "ckpt")
    config = json.loads((dst / "config.json").read_text())
    # FP8 checkpoints load (tests/integration/test_fp8_checkpoint.py); other methods do not
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    with pytest.raises(LoadError, match="quantization_config.quant_method is 'gptq'; moetune loads .* fp8"):
        _load(dst)


def test_bad_options(source):
    with pytest.raises(ConfigError, match=r"unknown load_model option\(s\) \['threads'\]"):
        moetune.load_model(source, device="cpu", threads=2)
    with pytest.raises(ConfigError, match="dtype 'int8' is not supported"):
        moetune.load_model(source, device="cpu", dtype="int8")
