"""Kimi-K2.5 / K2.6 as released: a composite ``kimi_k25`` config whose ``text_config`` declares compressed-tensors
INT4 routed experts, loaded as shipped (held as ``int4``, codes and scales the checkpoint's own) and exact against
transformers' own ``Kimi_K25ForConditionalGeneration`` on the dequantized weights (``moetune.testing.kimi_k25``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import moetune
from moetune.layer import CpuExperts
from moetune.testing.kimi_k25 import save_kimi_k25
from moetune.testing.survey import compare


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kimi_k25")
    return save_kimi_k25(root / "release", dequantized_path=root / "reference"), root / "reference"


def _shipped(path: Path, key: str) -> torch.Tensor:
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(path / index[key]), "pt") as f:
        return f.get_tensor(key)


def test_the_builder_writes_the_release_layout(release):
    path, _ = release
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "kimi_k25" and "quantization_config" not in config
    assert config["text_config"]["model_type"] == "kimi_k2"
    assert config["text_config"]["quantization_config"]["quant_method"] == "compressed-tensors"
    keys = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed" in keys
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" not in keys


def test_int4_experts_load_as_shipped_and_exactly(release):
    path, reference = release
    model = moetune.load_model(path, dtype="float64", device="cpu", progress=False, num_threads=1)
    sites = {n: m for n, m in model.named_modules() if isinstance(m, CpuExperts)}
    assert sites
    for site, module in sites.items():
        weights = module.engine.weights
        assert (weights.name, weights.group_size, weights.symmetric) == ("int4", 32, True)
        stored = site.replace("model.language_model.", "language_model.model.", 1)
        i = weights.intermediate_size
        for e in range(weights.num_experts):  # the shipped bf16 scales, held as they are
            assert torch.equal(
                weights.gate_up_scale[e, :i], _shipped(path, f"{stored}.{e}.gate_proj.weight_scale")
            )
            assert torch.equal(weights.down_scale[e], _shipped(path, f"{stored}.{e}.down_proj.weight_scale"))
    ref = type(model).from_pretrained(reference, dtype=torch.float64, experts_implementation="eager").eval()
    assert compare(ref, model) == []  # expert weights equal, logits and every non-expert gradient
