"""``load_model(expert_format=...)``: online quantization at load time from float checkpoints, the options
(keyword arguments and the YAML ``moetune:`` section, one check behind both) and their errors.

Reference: transformers' own float32 model of the same checkpoint with its experts replaced by the weights the
engines compute with (``quantized_checks``): logits within 1e-5. The quantization itself: relative error of
those weights against the checkpoint's, within docs/formats.md's bounds, and the bytes each engine holds.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import moetune
from moetune.config import parse_config
from moetune.engine import ActivationPolicy, DenseExperts
from moetune.errors import ConfigError
from moetune.loading import LoadOptions
from moetune.loading import load as load_module
from moetune.loading.options import ExpertFormatChoice
from moetune.testing.tiny import save_tiny_model
from tests.integration.quantized_checks import (
    LOGITS_TOL,
    WEIGHT_ERROR,
    engines,
    expert_weights,
    hf_model,
    max_logit_diff,
    relative_error,
    token_ids,
    with_engine_weights,
)
from tests.unit.config.test_config import minimal, problems_of, workdir  # noqa: F401  (workdir: a fixture)

# H = 192, I = 64: int4's default group (64) and 32 divide both; H != I and H != 2I (no transposed weight
# passes a shape check); fp8's 128-blocks are partial along H.
SIZES = {"hidden_size": 192, "moe_intermediate_size": 64}

# expert_format, extra options -> registered format, storage dtype, max bytes/parameter at these small sizes
# (scales weigh more than at H = 2048: int8 1 + 4 (2I + H) / (3HI) = 1.035), weight-error bound.
CASES = {
    "int8": ({}, "int8", torch.int8, 1.04, WEIGHT_ERROR["int8"]),
    "int4": ({}, "int4", torch.uint8, 0.54, WEIGHT_ERROR["int4"]),
    "int4-g32-asym": (
        {"int4_group_size": 32, "int4_symmetric": False},
        "int4",
        torch.uint8,
        0.60,
        0.105,  # docs/formats.md: asymmetric g = 64 is within 10.5%; g = 32 has smaller groups
    ),
    "fp8": ({}, "fp8_block", torch.float8_e4m3fn, 1.001, WEIGHT_ERROR["fp8_block"]),
}


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("src"), tokenizer=False, **SIZES)


@pytest.fixture(scope="module")
def original(source):
    return hf_model(source)


def _load(path, **options):
    return moetune.load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1, **options)


@pytest.mark.parametrize("case", list(CASES))
def test_online_quantization_matches_transformers_with_dequantized_experts(source, original, case):
    options, name, storage, max_bytes, max_error = CASES[case]
    fmt = case.split("-")[0]
    model = _load(source, expert_format=fmt, **options)
    for path, engine in engines(model).items():
        weights = engine.weights
        assert (weights.name, weights.storage_dtype) == (name, storage)
        assert weights.bytes_per_param <= max_bytes
        if name == "int4":
            assert weights.group_size == options.get("int4_group_size", 64)
            assert weights.symmetric == options.get("int4_symmetric", True)
        for got, want in zip(weights.dequantize(torch.float32), expert_weights(original, path)):
            assert 0 < relative_error(got, want) <= max_error, path
    reference = with_engine_weights(copy.deepcopy(original), model)
    assert max_logit_diff(model, reference, token_ids()) <= LOGITS_TOL


def test_bf16_means_dense_in_the_load_dtype(source, original):
    model = _load(source, expert_format="bf16")
    for path, engine in engines(model).items():
        assert engine.weights.name == "dense" and engine.weights.storage_dtype == torch.float32
        for got, want in zip(engine.weights.dequantize(torch.float32), expert_weights(original, path)):
            assert torch.equal(got, want)
    bf16 = moetune.load_model(source, device="cpu", progress=False, num_threads=1, expert_format="bf16")
    assert {e.weights.storage_dtype for e in engines(bf16).values()} == {torch.bfloat16}


def test_quantized_from_the_checkpoint_precision(source):
    """A bfloat16 load quantizes the fp32 checkpoint's weights, not their bf16 rounding: the same engines as a
    float32 load (and as ``moetune convert``, which streams the same way)."""
    exact = engines(_load(source, expert_format="int8"))
    model = moetune.load_model(source, device="cpu", progress=False, num_threads=1, expert_format="int8")
    for path, engine in engines(model).items():
        assert engine.weights.name == "int8"
        for got, want in zip(engine.weights.dequantize(), exact[path].weights.dequantize()):
            assert torch.equal(got, want), path


@pytest.mark.parametrize("family", ["gpt_oss", "mixtral"])
def test_online_quantization_of_other_layouts(tmp_path, family):
    """gpt-oss (fused, transposed, interleaved gate/up, biases) and Mixtral (w1/w3/w2): int8 engines equal a
    dense moetune model of the same checkpoint holding their dequantized weights; each layer keeps its biases."""
    path = save_tiny_model(family, tmp_path / family, tokenizer=False)
    dense, model = _load(path, expert_format="bf16"), _load(path, expert_format="int8")
    dense_engines = engines(dense)
    for layer, engine in engines(model).items():
        reference = dense_engines[layer]
        for got, want in zip(engine.weights.dequantize(), reference.weights.dequantize()):
            assert 0 < relative_error(got, want) <= WEIGHT_ERROR["int8"], layer
        for bias in ("gate_up_bias", "down_bias"):
            got_bias, want_bias = getattr(engine, bias), getattr(reference, bias)
            assert (got_bias is None) == (want_bias is None) == (family != "gpt_oss")
            assert got_bias is None or torch.equal(got_bias, want_bias), (layer, bias)
        reference.weights = DenseExperts(*engine.weights.dequantize(torch.float32))
    assert max_logit_diff(model, dense, token_ids()) <= LOGITS_TOL


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"expert_format": "int3"},
            r"expert_format got 'int3'; allowed: auto, dense, fp8_block, int4, int8, mxfp4, bf16, fp8",
        ),
        ({"expert_format": 8}, "expert_format got 8"),
        ({"expert_format": "int4", "int4_group_size": 48}, "int4_group_size got 48; allowed: 32, 64, 128"),
        ({"expert_format": "int4", "int4_group_size": True}, "int4_group_size got True"),
        (
            {"expert_format": "int4", "int4_symmetric": "yes"},
            "int4_symmetric got 'yes'; allowed: true or false",
        ),
        (
            {"expert_format": "int8", "int4_group_size": 32},
            "int4_group_size is set .32. but applies to expert_format int4 only; expert_format is 'int8'",
        ),
        ({"int4_symmetric": False}, "int4_symmetric is set .False. but applies to expert_format int4 only"),
    ],
)
def test_bad_expert_format_options(options, message):
    with pytest.raises(ConfigError, match=message):
        LoadOptions.create(device="cpu", **options)


def test_expert_format_resolution():
    assert LoadOptions.create(device="cpu", expert_format="bf16").experts.expert_format == "dense"
    assert LoadOptions.create(device="cpu", expert_format="fp8").experts.expert_format == "fp8_block"
    fp8, int4_g32 = (
        ExpertFormatChoice("fp8_block"),
        ExpertFormatChoice("int4", (("group_size", 32), ("symmetric", True))),
    )
    auto = LoadOptions.create(device="cpu")
    assert auto.experts.expert_format == "auto"
    assert auto.layer_format(fp8, 256, 128, "x") == fp8  # a quantized layer stays as stored
    assert auto.layer_format(int4_g32, 256, 128, "x") == int4_g32
    assert auto.layer_format(None, 256, 128, "x").name == "dense"
    int4 = LoadOptions.create(device="cpu", expert_format="int4")
    assert int4.layer_format(None, 256, 128, "x").options == (("group_size", 64), ("symmetric", True))
    assert int4.layer_format(fp8, 256, 128, "x").name == "int4"  # FP8 layers: dequantized, then quantized
    assert int4.layer_format(int4_g32, 256, 128, "x") == int4_g32  # an INT4 checkpoint's own groups
    regroup = LoadOptions.create(device="cpu", expert_format="int4", int4_group_size=64)
    assert regroup.layer_format(int4_g32, 256, 128, "x").options == (("group_size", 64), ("symmetric", True))
    with pytest.raises(
        ConfigError,
        match=r"int4_group_size 64 \(the default\) does not divide .*layer 3.*"
        r"H = 256, I = 96.*int4_group_size 32 fits",
    ):
        int4.layer_format(None, 256, 96, "layer 3")
    # float32 / float64 loads compute every format in that dtype; bf16 loads let the machine choose
    assert LoadOptions.create(device="cpu", dtype="float32").engine.compute_dtype == torch.float32
    assert LoadOptions.create(device="cpu").engine.compute_dtype is None


def test_group_size_that_does_not_fit_fails_before_loading(tmp_path, monkeypatch):
    path = save_tiny_model("qwen3_moe", tmp_path / "m", tokenizer=False)  # I = 24: no int4 group divides it

    def forbidden(*args, **kwargs):
        raise AssertionError("heavy work started before the error was raised")

    monkeypatch.setattr(load_module.hf, "load_weights", forbidden)
    monkeypatch.setattr(load_module, "stream_experts", forbidden)
    with pytest.raises(
        ConfigError, match=r"model.layers.0.mlp.experts \(H = 64, I = 24.*use int8 or fp8 instead"
    ):
        _load(path, expert_format="int4")


def test_yaml_expert_options(workdir):  # noqa: F811  (the fixture imported above)
    cfg = parse_config(
        minimal(moetune={"expert_format": "int4", "int4_group_size": 32, "int4_symmetric": False})
    )
    assert (
        cfg.engine.experts.expert_format,
        cfg.engine.experts.int4_group_size,
        cfg.engine.experts.int4_symmetric,
    ) == (
        "int4",
        32,
        False,
    )
    assert (
        parse_config(minimal(moetune={"expert_format": "bf16"})).engine.experts.expert_format == "dense"
    )  # the alias, canonical as in load_model
    text = problems_of(minimal(moetune={"expert_format": "int8", "int4_group_size": 48}))
    assert "moetune.int4_group_size: got 48; allowed: 32, 64, 128" in text
    text = problems_of(minimal(moetune={"expert_format": "int8", "int4_group_size": 64}))
    assert "moetune.int4_group_size: is set (64) but applies to expert_format int4 only" in text


def test_train_config_reaches_load_model(tmp_path, one_thread):
    """``moetune train``'s setup loads the experts as the YAML's ``moetune:`` section says (its thread count
    sizes torch's pool)."""
    from moetune.config import load_config
    from moetune.train.demo import make_demo_model
    from moetune.train.recipe import setup

    root = Path(__file__).resolve().parents[3]
    model_dir = make_demo_model(tmp_path / "tiny", root / "examples/data/demo_tokenizer")
    cfg = {
        "model_name_or_path": str(model_dir),
        "dataset": "demo_train",
        "dataset_dir": str(root / "examples/data"),
        "max_samples": 8,
        "cutoff_len": 32,
        "output_dir": str(tmp_path / "out"),
        "report_to": "none",
        "moetune": {
            "device": "cpu",
            "num_threads": 1,
            "expert_format": "int8",
            "activation_policy": "recompute",
            "check_finite": True,
            "expert_workers": 1,
        },
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    torch.set_num_threads(2)  # not the configured count (one_thread restores it)
    peft_model, _, _ = setup(load_config(tmp_path / "cfg.yaml"), progress=False)
    assert torch.get_num_threads() == 1
    assert {e.weights.name for e in engines(peft_model).values()} == {"int8"}
    assert {
        (e.options.policy, e.options.check_finite, e.options.expert_workers)
        for e in engines(peft_model).values()
    } == {(ActivationPolicy.RECOMPUTE, True, 1)}


# Peak memory: a model whose experts dominate, loaded as int4 in a fresh process after a warm-up load of a small
# model (transformers' imports alone add ~110 MB). Streaming quantizes layer by layer, so anonymous memory (not
# the kernel's page cache) grows by about the int4 engines plus one layer's dense experts;
# holding every dense layer first would add all of them (12 layers here).
_MEMORY_PROBE = r"""
import json, sys, threading, time
import moetune

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

moetune.load_model(sys.argv[2], device="cpu", progress=False, num_threads=1, expert_format="int4")  # warm-up
base, peak, stop = anon(), [0], []

def sample():
    while not stop:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)

thread = threading.Thread(target=sample)
thread.start()
model = moetune.load_model(sys.argv[1], device="cpu", progress=False, num_threads=1, expert_format="int4")
stop.append(1)
thread.join()
held = sum(m.engine.weights.nbytes for m in model.modules() if hasattr(m, "engine"))
print(json.dumps({"growth": max(peak[0], anon()) - base, "held": held}))
"""


@pytest.mark.slow
def test_online_quantization_peak_memory(tmp_path):
    layers, e, h, i = 12, 16, 512, 512
    path = save_tiny_model(
        "qwen3_moe",
        tmp_path / "big",
        tokenizer=False,
        dtype=torch.bfloat16,
        num_hidden_layers=layers,
        mlp_only_layers=[],
        num_experts=e,
        hidden_size=h,
        moe_intermediate_size=i,
    )
    small = save_tiny_model("qwen3_moe", tmp_path / "small", tokenizer=False, moe_intermediate_size=64)
    out = subprocess.run(
        [sys.executable, "-c", _MEMORY_PROBE, str(path), str(small)],
        check=True,
        capture_output=True,
        text=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    one_layer = e * 3 * h * i * 2  # dense bf16 experts of one layer: 25 MB
    non_expert = sum(f.stat().st_size for f in path.glob("*.safetensors")) - layers * one_layer
    # measured: growth 113-126 MB = int4 engines 80 MB + non-expert 3 MB + 30-43 MB (one dense layer: 25 MB;
    # quantization temporaries, transformers' loader); all dense layers would be 302 MB
    assert got["growth"] <= got["held"] + non_expert + 2 * one_layer, got
