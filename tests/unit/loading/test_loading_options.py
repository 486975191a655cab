"""``LoadOptions`` parsing, the layer summary in load logs, and the safetensors header reader."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from moetune.errors import ConfigError, LoadError
from moetune.loading import LoadOptions
from moetune.loading.checkpoint import Checkpoint, ShardReader, read_header
from moetune.loading.load import layer_summary


def test_defaults():
    opts = LoadOptions.create()
    assert opts.dtype == torch.bfloat16 and opts.progress and opts.experts.num_threads is None
    assert opts.device == torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("dtype", ["float32", "torch.float32", torch.float32])
def test_dtype_spellings(dtype):
    assert LoadOptions.create(device="cpu", dtype=dtype).dtype == torch.float32


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "fp8"}, "dtype 'fp8' is not supported"),
        ({"dtype": torch.int8}, "is not supported"),
        ({"device": "gpu"}, "device 'gpu' is not a torch device"),
        ({"device": "meta"}, "holds no weights"),
        ({"num_threads": 0}, "num_threads got 0; must be a positive integer"),
        ({"num_threads": True}, "num_threads got True; must be a positive integer"),
        ({"progress": "yes"}, "progress must be True or False"),
        (
            {"lora": {}},
            r"unknown load_model option\(s\) \['lora'\]; known: device, dtype, activation_policy, "
            r"check_finite, expert_format, .*experts, .*num_threads, progress",
        ),
        (
            {"activation_policy": "keep"},
            r"activation_policy got 'keep'; allowed: retain, recompute",
        ),
        ({"check_finite": 1}, "check_finite got 1; allowed: true or false"),
    ],
)
def test_invalid(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LoadOptions.create(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_without_cuda():
    with pytest.raises(ConfigError, match="torch sees no CUDA device"):
        LoadOptions.create(device="cuda:0")


def test_layer_summary():
    paths = [f"model.layers.{i}.mlp.experts" for i in (1, 2, 3, 5, 7, 8)]
    assert layer_summary(paths) == "model.layers.{1-3,5,7-8}.mlp.experts"
    assert layer_summary(["experts"]) == "experts"


def test_header_reader_and_shard_reader(tmp_path):
    save_file(
        {"a": torch.zeros(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)},
        str(tmp_path / "model.safetensors"),
    )
    infos = read_header(tmp_path / "model.safetensors")
    assert (infos["a"].shape, infos["a"].dtype, infos["a"].nbytes) == ((2, 3), "F32", 24)
    assert (infos["b"].dtype, infos["b"].nbytes) == ("BF16", 8)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    ckpt = Checkpoint.open(tmp_path)
    with ShardReader(ckpt, [["model.safetensors"], []]) as reader:
        assert torch.equal(
            reader.file("model.safetensors").get_tensor("b"), torch.ones(4, dtype=torch.bfloat16)
        )
        reader.done(0)  # its last planned read: closed
        assert not reader._open


def test_index_disagreeing_with_shards(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "part-1.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    index = '{"weight_map": {"a": "part-1.safetensors", "b": "part-1.safetensors"}}'
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(LoadError, match="maps 'b' to part-1.safetensors, but it is in no shard"):
        Checkpoint.open(tmp_path)


def test_unindexed_shards(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "config.json").write_text('{"model_type": "qwen3_moe"}')
    with pytest.raises(LoadError, match="neither model.safetensors nor model.safetensors.index.json"):
        Checkpoint.open(tmp_path)


def test_import_stays_cheap():
    import subprocess
    import sys

    code = (
        "import sys, moetune; assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
        "from moetune.adapters.load import load_model; assert moetune.load_model is load_model"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_adapter_must_be_an_adapter_directory(tmp_path, no_heavy_work):
    import moetune
    from moetune.errors import AdapterError, ConfigError

    with pytest.raises(AdapterError, match="lacks adapter_config.json and adapter_model.safetensors"):
        moetune.load_model(tmp_path / "model", device="cpu", adapter=tmp_path)  # before the model is read
    with pytest.raises(ConfigError, match="adapter_trainable must be True or False"):
        moetune.load_model(tmp_path / "model", device="cpu", adapter=tmp_path, adapter_trainable="yes")
