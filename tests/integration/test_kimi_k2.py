"""Kimi-K2 checkpoints as released (``model_type: kimi_k2``, DeepSeek-V3 remote code in ``auto_map``) load into
transformers' own DeepSeek-V3 classes without running any code of the checkpoint, and Kimi-K2-Instruct's FP8
128 x 128 block experts stay FP8.

References: transformers' own ``AutoConfig`` / ``DeepseekV3ForCausalLM`` on the same files renamed to
``model_type: deepseek_v3`` (the renaming Moonshot documents), with the FP8 weights dequantized by torch's own
e4m3 conversion times the block scale (``moetune.testing.kimi``). float32 logits within ``LOGITS_TOL``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import moetune
from moetune.errors import ArchError, ConfigError
from moetune.loading import hf
from moetune.loading.checkpoint import Checkpoint
from moetune.testing.kimi import reference_config, save_kimi_instruct
from tests.integration.quantized_checks import (
    LOGITS_TOL,
    engines,
    expert_weights,
    hf_model,
    max_logit_diff,
    token_ids,
)

REMOTE_FILES = ("configuration_deepseek.py", "modeling_deepseek.py")
REMOTE_CONFIG = """from transformers import PretrainedConfig


class DeepseekV3Config(PretrainedConfig):
    model_type = "kimi_k2"

    def __init__(self, max_position_embeddings=4096, **kwargs):
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)
"""  # a stand-in for the release's configuration_deepseek.py, enough for the tokenizer loader
EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def instruct(tmp_path_factory) -> tuple[Path, Path]:
    """(tiny Kimi-K2-Instruct, its dequantized float32 reference). The checkpoint carries remote-code files that
    raise when imported: loading must never run them."""
    root = tmp_path_factory.mktemp("kimi")
    path = save_kimi_instruct(root / "instruct", dequantized_path=root / "ref")
    for name in REMOTE_FILES:
        (path / name).write_text("raise RuntimeError('the checkpoint's remote code ran')\n")
    return path, root / "ref"


def _load(path, **options):
    return moetune.load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1, **options)


def _edit_config(src: Path, dst: Path, **fields) -> Path:
    dst = shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in fields.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_release_config_fields(instruct):
    config = json.loads((instruct[0] / "config.json").read_text())
    assert config["model_type"] == "kimi_k2" and config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekV3ForCausalLM"
    assert (config["scoring_func"], config["topk_method"], config["n_group"], config["topk_group"]) == (
        "sigmoid",
        "noaux_tc",
        1,
        1,
    )
    assert config["routed_scaling_factor"] == 2.827 and config["rope_scaling"]["type"] == "yarn"
    index = json.loads((instruct[0] / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [
        f"model-{i:05d}-of-000004.safetensors" for i in (1, 2, 3, 4)
    ]


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_config_is_transformers_deepseek_v3(instruct, tmp_path, trust_remote_code):
    """The config equals what transformers' AutoConfig builds from the renamed file; the model is its own class."""
    from transformers import AutoConfig, DeepseekV3Config

    path, _ = instruct
    config = hf.load_config(Checkpoint.open(path), trust_remote_code)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    (renamed / "config.json").write_text(
        json.dumps(reference_config(json.loads((path / "config.json").read_text())))
    )
    want = AutoConfig.from_pretrained(renamed).to_dict()
    got = config.to_dict()
    assert type(config) is DeepseekV3Config and got.pop("_name_or_path") == ""
    assert got == {k: v for k, v in want.items() if k != "_name_or_path"}
    assert config.rope_parameters["rope_type"] == "yarn" and config.routed_scaling_factor == 2.827
    model = _load(path, trust_remote_code=trust_remote_code)
    assert type(model).__name__ == "DeepseekV3ForCausalLM" and type(model).__module__.startswith(
        "transformers."
    )


def test_fp8_instruct_matches_transformers_on_the_dequantized_weights(instruct):
    path, ref_path = instruct
    model, ref = _load(path), hf_model(ref_path)
    for name, engine in engines(model).items():
        assert engine.weights.name == "fp8_block" and engine.weights.storage_dtype == torch.float8_e4m3fn
        for got, want in zip(engine.weights.dequantize(torch.float32), expert_weights(ref, name)):
            assert torch.equal(got, want), name
    reference = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # attention, dense MLP, shared experts dequantized; bf16 rest
        assert torch.equal(p, reference[name]), name
    assert max_logit_diff(model, ref, token_ids()) <= LOGITS_TOL


def test_fp8_expert_bytes_stay_fp8(instruct):
    from safetensors import safe_open

    path, _ = instruct
    weights = engines(_load(path))[EXPERTS].weights
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    key = f"{EXPERTS}.5.down_proj.weight"
    with safe_open(str(path / index[key]), framework="pt") as f:
        codes, scale_inv = f.get_tensor(key), f.get_tensor(f"{key}_scale_inv")
    assert torch.equal(weights.down[5].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(weights.down_scale_inv[5], scale_inv)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"scoring_func": "softmax"},
            r"scoring_func is 'softmax'; transformers' deepseek_v3 implements scoring_func 'sigmoid'",
        ),
        (
            {"topk_method": "group_limited_greedy"},
            r"topk_method is 'group_limited_greedy'; .* topk_method 'noaux_tc'",
        ),
        ({"moe_layer_freq": 2}, r"moe_layer_freq is 2; .* moe_layer_freq 1 only"),
        (
            {"architectures": ["KimiK2ForCausalLM"]},
            r"architectures is \['KimiK2ForCausalLM'\]; expected \['DeepseekV3",
        ),
        ({"norm_topk_prob": "yes"}, r"norm_topk_prob is 'yes'; it must be true or false"),
        ({"n_group": 3}, r"n_group 3 and topk_group 1 with n_routed_experts 8: n_group must divide"),
    ],
    ids=["scoring_func", "topk_method", "moe_layer_freq", "architectures", "norm_topk_prob", "n_group"],
)
def test_fields_transformers_would_not_reproduce_are_refused(
    instruct, tmp_path, no_heavy_work, fields, message
):
    dst = _edit_config(instruct[0], tmp_path / "ckpt", **fields)
    with pytest.raises(ArchError, match=rf"config.json: model_type 'kimi_k2' .*\n  {message}"):
        _load(dst)


def test_absent_routing_fields_take_deepseek_v3_defaults(instruct, tmp_path):
    """The remote configuration class's defaults are the values transformers implements."""
    dst = _edit_config(
        instruct[0], tmp_path / "ckpt", scoring_func=None, topk_method=None, moe_layer_freq=None
    )
    assert type(hf.load_config(Checkpoint.open(dst))).__name__ == "DeepseekV3Config"


def test_unknown_model_type_with_remote_code_is_refused(instruct, tmp_path, no_heavy_work):
    dst = _edit_config(instruct[0], tmp_path / "ckpt", model_type="kimi_k9")
    for trust in (False, True):
        with pytest.raises(
            ArchError,
            match=r"model_type 'kimi_k9' .* nor one moetune maps onto one \(kimi_k2\)\. Its config.json names "
            r"remote code \(auto_map .*moetune never runs a checkpoint's code, whatever trust_remote_code says",
        ):
            _load(dst, trust_remote_code=trust)


def test_trust_remote_code_must_be_a_bool(instruct):
    with pytest.raises(ConfigError, match="trust_remote_code must be True or False; got 'yes'"):
        _load(instruct[0], trust_remote_code="yes")


def test_yaml_trust_remote_code_reaches_the_config_loader(instruct, tmp_path, monkeypatch):
    """``model.trust_remote_code`` in a training YAML goes to the tokenizer and to load_model's config loader."""
    from moetune.config import load_config
    from moetune.train.recipe import setup

    root = Path(__file__).resolve().parents[2]
    # With trust_remote_code the tokenizer loader imports the checkpoint's configuration code (as it would
    # Kimi's tokenization_kimi.py), which is what the flag permits: give it a harmless one. The model loader
    # never runs it (the tests above keep files that raise).
    path = shutil.copytree(instruct[0], tmp_path / "model", ignore=shutil.ignore_patterns(*REMOTE_FILES))
    (path / REMOTE_FILES[0]).write_text(REMOTE_CONFIG)
    for f in (root / "examples/data/demo_tokenizer").iterdir():  # 17 words: ids within the tiny vocabulary
        shutil.copy(f, path)
    seen = []
    real = hf.load_config
    monkeypatch.setattr(
        hf, "load_config", lambda checkpoint, trust: seen.append(trust) or real(checkpoint, trust)
    )
    cfg = {
        "model_name_or_path": str(path),
        "trust_remote_code": True,
        "dataset": "demo_train",
        "dataset_dir": str(root / "examples/data"),
        "max_samples": 4,
        "cutoff_len": 32,
        "output_dir": str(tmp_path / "out"),
        "report_to": "none",
        "moetune": {"device": "cpu", "num_threads": 1},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    peft_model, _, _ = setup(load_config(tmp_path / "cfg.yaml"), progress=False)
    # the preflight's meta-device plan (which the model load then fills) and the tokenizer (told moetune's config:
    # hf.load_tokenizer)
    assert seen == [True, True]
    assert {e.weights.name for e in engines(peft_model).values()} == {"fp8_block"}
