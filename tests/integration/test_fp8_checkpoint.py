"""FP8 block-scaled checkpoints (DeepSeek-V3's convention) loading natively: routed experts stay FP8 in the
engine, every other FP8 weight is dequantized, against transformers' own model on the dequantized weights.

Checkpoints come from ``moetune.testing.fp8_checkpoint``: a random tiny model whose decoder Linear weights and
expert matrices are quantized to e4m3 with 128 x 128 block scales, and the same model with those weights
dequantized (torch's own fp8 -> fp32 conversion times the block scale) as a plain float32 checkpoint: the
reference. DeepSeek-V3 with H = 256, I = 192, dense MLP 320 (partial edge blocks: 192 = 128 + 64); Qwen3-MoE
with H = 256, I = 128 (whole blocks only, so transformers' own FP8 loader, which dequantizes on a CPU, reads
it correctly and serves as a second reference). float32 logits within 1e-5 (same weights, summation order).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from moetune.engine.formats import dense
from moetune.errors import LoadError, NonFiniteWeightError
from moetune.testing.fp8_checkpoint import dequantize_reference, save_fp8_checkpoint
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

FAMILIES = {
    "deepseek_v3": {"hidden_size": 256, "moe_intermediate_size": 192, "intermediate_size": 320},
    "qwen3_moe": {"hidden_size": 256, "moe_intermediate_size": 128},
}
DS_EXPERTS = "model.layers.1.mlp.experts"  # deepseek_v3's first MoE layer (first_k_dense_replace = 1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (FP8 checkpoint, dequantized float32 reference checkpoint)."""
    out = {}
    for family, sizes in FAMILIES.items():
        root = tmp_path_factory.mktemp(family)
        fp8 = save_fp8_checkpoint(family, root / "fp8", dequantized_path=root / "ref", **sizes)
        out[family] = (fp8, root / "ref")
    return out


@pytest.fixture(scope="module")
def references(checkpoints):
    return {family: hf_model(ref) for family, (_, ref) in checkpoints.items()}


def _load(path, dtype="float32", **options):
    return moetune.load_model(path, device="cpu", dtype=dtype, progress=False, num_threads=1, **options)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_fp8_matches_transformers_on_the_dequantized_weights(checkpoints, references, family):
    fp8, _ = checkpoints[family]
    model = _load(fp8)  # expert_format="auto": FP8 stays FP8
    ref = references[family]
    for path, engine in engines(model).items():
        assert engine.weights.name == "fp8_block"
        assert engine.weights.storage_dtype == torch.float8_e4m3fn
        assert engine.weights.bytes_per_param <= 1.01
        for got, want in zip(engine.weights.dequantize(torch.float32), expert_weights(ref, path)):
            assert torch.equal(got, want), path  # the same numbers: e4m3 value times its block scale, in fp32
    non_expert = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # dequantized attention, dense MLP, shared experts; float rest
        assert torch.equal(p, non_expert[name]), name
    assert max_logit_diff(model, ref, token_ids()) <= LOGITS_TOL
    assert getattr(model.config, "quantization_config", None) is None  # the torch model is a float one


def test_fp8_bytes_stay_fp8(checkpoints):
    fp8, _ = checkpoints["deepseek_v3"]
    tensors = load_file(str(fp8 / "model.safetensors"))
    weights = engines(_load(fp8, expert_format="fp8"))[DS_EXPERTS].weights
    i, gi = 192, 2  # I and its block rows
    for e in (0, 5):
        key = f"{DS_EXPERTS}.{e}"
        stored = {
            "gate": (weights.gate_up[e, :i], weights.gate_up_scale_inv[e, :gi]),
            "up": (weights.gate_up[e, i:], weights.gate_up_scale_inv[e, gi:]),
            "down": (weights.down[e], weights.down_scale_inv[e]),
        }
        for proj, (codes, scale) in stored.items():
            want = tensors[f"{key}.{proj}_proj.weight"]
            assert torch.equal(codes.view(torch.uint8), want.view(torch.uint8))  # byte for byte
            assert torch.equal(scale, tensors[f"{key}.{proj}_proj.weight_scale_inv"])


def test_bfloat16_load_rounds_dequantized_weights_once(checkpoints, references):
    fp8, _ = checkpoints["deepseek_v3"]
    model = _load(fp8, dtype="bfloat16")
    ref = dict(references["deepseek_v3"].named_parameters())
    for name, p in model.named_parameters():  # the dtype transformers picks (fp32-kept routers stay fp32)
        assert torch.equal(p, ref[name].to(p.dtype)), name
    assert model.get_parameter(Q_A).dtype == torch.bfloat16
    assert {e.weights.name for e in engines(model).values()} == {"fp8_block"}


def test_bf16_experts_from_fp8_are_dequantized_into_the_engine_layout(checkpoints, monkeypatch):
    """bf16 experts dequantized from an FP8 checkpoint are written straight into the rows the engine holds
    (``DenseExperts.empty``; padding forced onto the tiny rows here: every bf16 row whose bytes are a multiple of
    128, H = 256 and I = 192), the same values and logits as the same load with contiguous rows."""
    fp8, _ = checkpoints["deepseek_v3"]
    models = {}
    for name, alias in (("contiguous", dense.ALIAS_BYTES), ("padded", 128)):
        monkeypatch.setattr(dense, "ALIAS_BYTES", alias)
        models[name] = _load(fp8, dtype="bfloat16", expert_format="bf16")
    held = {name: engines(model) for name, model in models.items()}
    assert held["padded"].keys() == held["contiguous"].keys() and held["padded"]
    for path, engine in held["padded"].items():
        padded, flat = engine.weights, held["contiguous"][path].weights
        assert padded.name == flat.name == "dense" and padded.storage_dtype == torch.bfloat16
        assert (padded.gate_up.stride(1), padded.down.stride(1)) == (
            256 + 32,
            192 + 32,
        )  # one 64-byte line more
        assert flat.gate_up.is_contiguous() and flat.down.is_contiguous()
        assert torch.equal(padded.gate_up, flat.gate_up) and torch.equal(padded.down, flat.down)
    ids = token_ids()
    with torch.no_grad():
        assert torch.equal(models["padded"](ids).logits, models["contiguous"](ids).logits)


def test_bf16_scales_are_widened_exactly(checkpoints, tmp_path):
    def to_bf16(tensors):
        return {k: v.bfloat16() if k.endswith("_scale_inv") else v for k, v in tensors.items()}

    dst = _copy(checkpoints, tmp_path, to_bf16)
    tensors = load_file(str(dst / "model.safetensors"))
    model = _load(dst)

    def want(key):
        return dequantize_reference(tensors[key], tensors[f"{key}_scale_inv"].float())

    assert torch.equal(model.get_parameter(Q_A), want(Q_A))
    gate_up, down = engines(model)[DS_EXPERTS].weights.dequantize(torch.float32)
    assert torch.equal(gate_up[2, 192:], want(f"{DS_EXPERTS}.2.up_proj.weight"))
    assert torch.equal(down[7], want(f"{DS_EXPERTS}.7.down_proj.weight"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="transformers dequantizes FP8 only without a GPU")
def test_transformers_own_fp8_loader_agrees(checkpoints):
    """Whole 128-blocks only: there transformers 5.24's own CPU dequantization of FP8 checkpoints is right."""
    fp8, _ = checkpoints["qwen3_moe"]
    assert max_logit_diff(_load(fp8), hf_model(fp8), token_ids()) <= LOGITS_TOL


@pytest.mark.parametrize(("fmt", "name"), [("bf16", "dense"), ("int8", "int8"), ("int4", "int4")])
def test_other_formats_dequantize_the_fp8_experts(checkpoints, references, fmt, name):
    fp8, _ = checkpoints["deepseek_v3"]
    model = _load(fp8, expert_format=fmt)
    ref = references["deepseek_v3"]
    for path, engine in engines(model).items():
        assert engine.weights.name == name
        for got, want in zip(engine.weights.dequantize(torch.float32), expert_weights(ref, path)):
            error = relative_error(got, want)
            assert error <= WEIGHT_ERROR[name] and (error == 0) == (name == "dense"), (path, error)
    reference = with_engine_weights(hf_model(checkpoints["deepseek_v3"][1]), model)
    assert max_logit_diff(model, reference, token_ids()) <= LOGITS_TOL


# --- errors: raised from the headers, before any weight is read ------------------------------------------


def _copy(checkpoints, tmp_path, edit_tensors=None, edit_quant=None) -> Path:
    dst = shutil.copytree(checkpoints["deepseek_v3"][0], tmp_path / "ckpt")
    if edit_tensors is not None:
        tensors = edit_tensors(load_file(str(dst / "model.safetensors")))
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    if edit_quant is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = edit_quant(config["quantization_config"])
        if config["quantization_config"] is None:
            del config["quantization_config"]
        (dst / "config.json").write_text(json.dumps(config))
    return dst


EXPERT_UP = f"{DS_EXPERTS}.3.up_proj.weight"
Q_A = "model.layers.0.self_attn.q_a_proj.weight"  # [24, 256]: grid (1, 2)


@pytest.mark.parametrize(
    ("edit_tensors", "edit_quant", "message"),
    [
        (
            lambda t: {k: v for k, v in t.items() if k != f"{EXPERT_UP}_scale_inv"},
            None,
            rf"model.safetensors: FP8 weight {EXPERT_UP} has no {EXPERT_UP}_scale_inv in any shard",
        ),
        (
            lambda t: {**t, f"{Q_A}_scale_inv": t[f"{Q_A}_scale_inv"].t().contiguous()},
            None,
            rf"{Q_A}_scale_inv is F32 \(2, 1\); the scales of {Q_A} \(24, 256\) must be F32/BF16/F16 \(1, 2\)",
        ),
        (
            lambda t: {**t, f"{Q_A}_scale_inv": t[f"{Q_A}_scale_inv"].double()},
            None,
            rf"{Q_A}_scale_inv is F64 \(1, 2\); the scales of {Q_A} \(24, 256\) must be F32/BF16/F16",
        ),
        (
            lambda t: {k: v for k, v in t.items() if k != Q_A},
            None,
            rf"{Q_A}_scale_inv scales {Q_A}, which no shard holds",
        ),
        (
            lambda t: {**t, Q_A: dequantize_reference(t[Q_A], t[f"{Q_A}_scale_inv"])},
            None,
            rf"{Q_A}_scale_inv scales {Q_A}, which is F32, not F8_E4M3",
        ),
        (
            lambda t: {
                **{k: v for k, v in t.items() if k != f"{EXPERT_UP}_scale_inv"},
                EXPERT_UP: dequantize_reference(t[EXPERT_UP], t[f"{EXPERT_UP}_scale_inv"]),
            },
            None,
            rf"{DS_EXPERTS}: mixes FP8 expert tensors .* with float ones \({EXPERT_UP}\)",
        ),
        (None, lambda q: None, rf"{Q_A} is F8_E4M3, but config.json has no quantization_config"),
        (None, lambda q: {**q, "quant_method": "awq"}, "quant_method is 'awq'; moetune loads .* fp8"),
        (None, lambda q: {**q, "weight_block_size": [64, 64]}, r"weight_block_size is \[64, 64\]"),
        (None, lambda q: {**q, "activation_scheme": "static"}, "activation_scheme is 'static'"),
        (None, lambda q: {**q, "fmt": "e5m2"}, "fmt is 'e5m2'"),
    ],
    ids=[
        "expert-scale-missing",
        "scale-shape",
        "scale-dtype",
        "scale-without-weight",
        "scale-of-float-weight",
        "mixed-layer",
        "no-quantization-config",
        "quant-method",
        "block-size",
        "static-activations",
        "fp8-encoding",
    ],
)
def test_fp8_checkpoint_errors(checkpoints, tmp_path, no_heavy_work, edit_tensors, edit_quant, message):
    dst = _copy(checkpoints, tmp_path, edit_tensors, edit_quant)
    with pytest.raises(LoadError, match=message):
        _load(dst)


def _nan_code(t: dict[str, torch.Tensor], key: str, code: int) -> dict[str, torch.Tensor]:
    codes = t[key].clone()
    codes.view(torch.uint8)[5, 7] = code  # e4m3fn's NaN codes: 0x7F and 0xFF
    return {**t, key: codes}


@pytest.mark.parametrize("code", [0x7F, 0xFF])
def test_a_nan_code_in_a_routed_expert_is_refused_by_name(checkpoints, tmp_path, code):
    """A damaged FP8 release (a NaN code in expert 3's up_proj) is a NonFiniteWeightError naming the layer, its
    file and the expert, whether the experts stay FP8 or are dequantized to bf16 (both read the codes into the
    FP8 format first, which refuses them)."""
    dst = _copy(checkpoints, tmp_path, lambda t: _nan_code(t, EXPERT_UP, code))
    for fmt in ("auto", "bf16"):
        with pytest.raises(
            NonFiniteWeightError,
            match=rf"{DS_EXPERTS} \(read from model.safetensors\): fp8_block: gate_up\[3\] holds NaN codes",
        ):
            _load(dst, expert_format=fmt)


def test_a_nan_code_in_a_dequantized_weight_stays_nan(checkpoints, tmp_path):
    """A NaN code outside the experts (q_a_proj, dequantized at load) gives NaN in the loaded weight, as torch's
    own conversion does (the fast decoding would make it finite), so the model's NaN checks can see it."""
    dst = _copy(checkpoints, tmp_path, lambda t: _nan_code(t, Q_A, 0xFF))
    weight = dict(_load(dst).named_parameters())[Q_A]
    assert bool(weight[5, 7].isnan()) and int(weight.isnan().sum()) == 1
