"""Checkpoint problems of the experts variants (non-gated NemotronH, flat DBRX, Kimi-K2.5's text-config
quantization) are ``LoadError``s naming the key and what was expected, raised before any weight is read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import moetune
from moetune.errors import LoadError
from moetune.testing.families import survey_config
from moetune.testing.survey import _random_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """model type -> a tiny survey checkpoint of it (single safetensors file)."""
    out = {}
    for model_type in ("nemotron_h", "dbrx"):
        path = tmp_path_factory.mktemp(model_type) / "m"
        _random_model(survey_config(model_type), seed=0).save_pretrained(path)
        out[model_type] = path
    return out


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = edit(load_file(str(dst / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load(path: Path):
    return moetune.load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1)


NEMOTRON_EXPERT = "backbone.layers.1.mixer.experts.3"


def test_non_gated_experts_with_a_gate_tensor(saved, tmp_path, no_heavy_work):
    def add_gate(t):
        return {**t, f"{NEMOTRON_EXPERT}.gate_proj.weight": t[f"{NEMOTRON_EXPERT}.up_proj.weight"].clone()}

    with pytest.raises(LoadError, match=r"experts\.3\.gate_proj\.weight(.|\n)*not gated"):
        _load(_rewrite(saved["nemotron_h"], tmp_path / "c", add_gate))


def test_non_gated_experts_missing_up(saved, tmp_path, no_heavy_work):
    def drop_up(t):
        return {k: v for k, v in t.items() if k != f"{NEMOTRON_EXPERT}.up_proj.weight"}

    with pytest.raises(LoadError, match=r"missing backbone\.layers\.1\.mixer\.experts\.3\.up_proj\.weight"):
        _load(_rewrite(saved["nemotron_h"], tmp_path / "c", drop_up))


DBRX_MLP = "transformer.blocks.0.ffn.experts.mlp"


def test_flat_experts_with_a_wrong_shape(saved, tmp_path, no_heavy_work):
    def cut(t):
        return {**t, f"{DBRX_MLP}.w2": t[f"{DBRX_MLP}.w2"][:-8].clone()}

    with pytest.raises(LoadError, match=r"mlp\.w2(.|\n)*shape \(184, 64\), expected \(192, 64\) \(flat"):
        _load(_rewrite(saved["dbrx"], tmp_path / "c", cut))


def test_flat_experts_missing_one(saved, tmp_path, no_heavy_work):
    def drop(t):
        return {k: v for k, v in t.items() if k != f"{DBRX_MLP}.v1"}

    with pytest.raises(
        LoadError, match=r"1 problem(.|\n)*missing transformer\.blocks\.0\.ffn\.experts\.mlp\.v1"
    ) as e:
        _load(_rewrite(saved["dbrx"], tmp_path / "c", drop))
    assert "mlp.w1" not in str(e.value) and "mlp.w2" not in str(e.value)  # only what is missing


def test_text_config_quantization_is_checked(tmp_path, no_heavy_work):
    from moetune.testing.kimi_k25 import save_kimi_k25

    path = save_kimi_k25(tmp_path / "k25")
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["quantization_config"]["format"] = "int-quantized"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=r"text_config\.quantization_config\.format"):
        _load(path)
