"""gpt-oss MXFP4 checkpoints (the release's layout) loading as shipped: routed experts stay MXFP4 in the
engine, against transformers' own model on transformers' own dequantization of the same bytes.

The checkpoint comes from ``moetune.testing.mxfp4_checkpoint``: a random tiny gpt-oss (H = 64, I = 96, E = 8,
2 layers) whose experts are written as ``*_blocks`` / ``*_scales`` (uint8) and every other tensor as bf16, plus
the reference: the same model as a float32 checkpoint whose expert weights are
``transformers.integrations.mxfp4.convert_moe_packed_tensors`` of the stored bytes. float32 logits within
1e-5 (the same weights; only the summation order differs), router gradients within 1e-5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from moetune.adapters import attach_lora, save_adapter
from moetune.adapters.apply import expert_modules
from moetune.cli.main import main
from moetune.errors import LoadError, NonFiniteWeightError
from moetune.loading.checkpoint import Checkpoint
from moetune.testing.mxfp4_checkpoint import MXFP4_QUANTIZATION_CONFIG, save_mxfp4_checkpoint
from moetune.testing.tiny import save_tiny_model
from tests.integration.quantized_checks import (
    LOGITS_TOL,
    WEIGHT_ERROR,
    engines,
    hf_model,
    max_logit_diff,
    relative_error,
    token_ids,
)

GRAD_TOL = 1e-5  # as tests/integration/load_checks.py, relative where gradients exceed 1
EXPERTS = "model.layers.0.mlp.experts"
I = 96


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(MXFP4 checkpoint, float32 reference checkpoint)."""
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return save_mxfp4_checkpoint(root / "mxfp4", dequantized_path=root / "ref"), root / "ref"


@pytest.fixture(scope="module")
def reference(checkpoints):
    return hf_model(checkpoints[1])


def _load(path, dtype="float32", **options):
    return moetune.load_model(path, device="cpu", dtype=dtype, progress=False, num_threads=1, **options)


def _engine_layout(runtime: torch.Tensor) -> torch.Tensor:
    """A run-time gpt-oss gate_up ``[E, H, 2I]`` (gate/up interleaved) as the engine holds it: ``[E, 2I, H]``,
    gate rows then up rows."""
    return torch.cat((runtime[..., 0::2], runtime[..., 1::2]), dim=2).transpose(1, 2)


def test_native_mxfp4_matches_transformers_on_its_own_dequantization(checkpoints, reference):
    model = _load(checkpoints[0])  # expert_format="auto": MXFP4 stays MXFP4
    for path, engine in engines(model).items():
        assert engine.weights.name == "mxfp4" and engine.weights.storage_dtype == torch.uint8
        assert engine.weights.bytes_per_param == 0.5 + 1 / 32
        hf = reference.get_submodule(path)
        gate_up, down = engine.weights.dequantize(torch.float32)
        assert torch.equal(gate_up, _engine_layout(hf.gate_up_proj))  # bit for bit
        assert torch.equal(down, hf.down_proj.transpose(1, 2))
    non_expert = dict(reference.named_parameters())
    for name, p in model.named_parameters():  # attention, routers, norms, embeddings: bf16 widened
        assert torch.equal(p, non_expert[name]), name
    assert max_logit_diff(model, reference, token_ids()) <= LOGITS_TOL
    assert getattr(model.config, "quantization_config", None) is None  # the torch model is a float one


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="transformers dequantizes MXFP4 only without GPU kernels"
)
def test_transformers_own_mxfp4_loader_agrees(checkpoints):
    """transformers 5.24 reads the MXFP4 checkpoint itself on a CPU (dequantizing to the load dtype)."""
    assert max_logit_diff(_load(checkpoints[0]), hf_model(checkpoints[0]), token_ids()) <= LOGITS_TOL


def test_expert_bytes_stay_as_shipped(checkpoints):
    mxfp4 = checkpoints[0]
    tensors = load_file(str(mxfp4 / "model.safetensors"))
    model = _load(mxfp4, dtype="bfloat16")
    held = 0
    for path, engine in engines(model).items():
        w = engine.weights
        blocks = tensors[f"{path}.gate_up_proj_blocks"].flatten(2)  # [E, 2I, H/2], gate/up interleaved
        assert torch.equal(w.gate_up, torch.cat((blocks[:, 0::2], blocks[:, 1::2]), dim=1))
        scales = tensors[f"{path}.gate_up_proj_scales"]
        assert torch.equal(w.gate_up_scale, torch.cat((scales[:, 0::2], scales[:, 1::2]), dim=1))
        assert torch.equal(w.down, tensors[f"{path}.down_proj_blocks"].flatten(2))
        assert torch.equal(w.down_scale, tensors[f"{path}.down_proj_scales"])
        bias = tensors[f"{path}.gate_up_proj_bias"]
        assert torch.equal(engine.gate_up_bias, torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1))
        held += w.nbytes + engine.gate_up_bias.nbytes + engine.down_bias.nbytes
    shipped = sum(
        info.nbytes for key, info in Checkpoint.open(mxfp4).tensors.items() if ".mlp.experts." in key
    )
    assert abs(held - shipped) <= 0.03 * shipped, (held, shipped)


def test_router_gradients_equal(checkpoints, reference):
    model = _load(checkpoints[0])
    ids = token_ids(1)
    for m in (reference, model):
        m.train()
        m.zero_grad()
        m(input_ids=ids, labels=ids, output_router_logits=True).loss.backward()
        m.eval()
    ref = dict(reference.named_parameters())
    compared = 0
    for name, p in model.named_parameters():
        assert p.grad is not None and ref[name].grad is not None, name
        scale = max(1.0, ref[name].grad.abs().max().item())
        assert (p.grad - ref[name].grad).abs().max().item() <= GRAD_TOL * scale, name
        compared += ".mlp.router." in name
    assert compared == 4  # weight and bias of both layers' routers
    reference.zero_grad()


def test_expert_lora_trains_saves_and_reloads(checkpoints, tmp_path):
    torch.manual_seed(0)
    model = attach_lora(_load(checkpoints[0]), rank=4, alpha=8, targets=("q_proj", "v_proj", "experts"))
    experts = expert_modules(model)
    assert set(experts) == {EXPERTS, "model.layers.1.mlp.experts"}
    assert {m.experts.engine.weights.name for m in experts.values()} == {"mxfp4"}
    ids = token_ids(2, batch=4, seq=16)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(6):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    model.eval()
    assert losses[-1] < losses[0] - 0.05, losses
    learned = [p for m in experts.values() for n, p in m.named_parameters() if ".lora_B." in f".{n}"]
    assert len(learned) == 2 * len(experts) and all(
        p.abs().max() > 0 for p in learned
    )  # the expert LoRA learned
    out = save_adapter(model, tmp_path / "adapter")
    reloaded = _load(checkpoints[0], adapter=out)
    assert {m.experts.engine.weights.name for m in expert_modules(reloaded).values()} == {"mxfp4"}
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)


def test_bf16_expert_format_dequantizes_exactly(checkpoints, reference):
    model = _load(checkpoints[0], dtype="bfloat16", expert_format="bf16")
    for path, engine in engines(model).items():
        assert engine.weights.name == "dense" and engine.weights.storage_dtype == torch.bfloat16
        hf = reference.get_submodule(path)
        want = (_engine_layout(hf.gate_up_proj), hf.down_proj.transpose(1, 2))
        for got, exact in zip(engine.weights.dequantize(torch.float32), want):
            assert torch.equal(got, exact), path  # every MXFP4 value is a bf16 number


@pytest.mark.parametrize("fmt", ["int8", "fp8_block"])
def test_other_formats_quantize_the_dequantized_experts(checkpoints, reference, fmt):
    model = _load(checkpoints[0], expert_format=fmt)
    for path, engine in engines(model).items():
        assert engine.weights.name == fmt
        hf = reference.get_submodule(path)
        want = (_engine_layout(hf.gate_up_proj), hf.down_proj.transpose(1, 2))
        for got, exact in zip(engine.weights.dequantize(torch.float32), want):
            assert 0 < relative_error(got, exact) <= WEIGHT_ERROR[fmt], path


def test_converted_store_keeps_the_shipped_bytes(checkpoints, tmp_path):
    src, store = checkpoints[0], tmp_path / "store"
    assert main(["convert", str(src), str(store), "--format", "mxfp4", "--quiet", "--threads", "1"]) == 0
    assert json.loads((store / "manifest.json").read_text())["format"] == "mxfp4"
    stored, native = _load(src, expert_path=store), _load(src)
    for path, engine in engines(stored).items():
        want = engines(native)[path].weights.state_tensors()
        assert all(torch.equal(t, want[k]) for k, t in engine.weights.state_tensors().items()), path
    with torch.no_grad():
        assert torch.equal(stored(token_ids()).logits, native(token_ids()).logits)


def test_a_nan_scale_byte_names_the_tensor(checkpoints, tmp_path):
    dst = _copy(checkpoints[0], tmp_path, lambda t: {**t, DOWN_SCALES: torch.full_like(t[DOWN_SCALES], 255)})
    with pytest.raises(
        NonFiniteWeightError,
        match=r"experts \(read from model.safetensors\): mxfp4: down_scale\[0\] holds the e8m0 NaN byte 255",
    ):
        _load(dst)


# --- errors: raised from config.json and the headers, before any weight is read ----------------------


def _copy(src: Path, tmp_path: Path, edit_tensors=None, edit_quant=None) -> Path:
    dst = shutil.copytree(src, tmp_path / "ckpt")
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


GATE_UP_BLOCKS, GATE_UP_SCALES = f"{EXPERTS}.gate_up_proj_blocks", f"{EXPERTS}.gate_up_proj_scales"
DOWN_BLOCKS, DOWN_SCALES = f"{EXPERTS}.down_proj_blocks", f"{EXPERTS}.down_proj_scales"
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
ATTN_GATE_UP = "model.layers.0.self_attn.gate_up_proj"


def _without(t: dict, *keys: str) -> dict:
    return {k: v for k, v in t.items() if k not in keys}


@pytest.mark.parametrize(
    ("edit_tensors", "edit_quant", "message"),
    [
        (
            None,
            lambda q: {**q, "group_size": 16},
            r"has field\(s\) \['group_size'\] \(group_size=16\); an MXFP4",
        ),
        (
            None,
            lambda q: {**q, "modules_to_not_convert": "lm_head"},
            "modules_to_not_convert is 'lm_head'; it must",
        ),
        (
            None,
            lambda q: None,
            rf"{GATE_UP_BLOCKS} is an MXFP4 blocks tensor, but config.json has no quantization",
        ),
        (
            None,
            lambda q: {**q, "quant_method": "awq"},
            "quant_method is 'awq'; moetune loads .* fp8 .* mxfp4",
        ),
        (
            lambda t: _without(t, DOWN_SCALES),
            None,
            rf"MXFP4 blocks {DOWN_BLOCKS} have no {DOWN_SCALES} in any",
        ),
        (
            lambda t: _without(t, DOWN_BLOCKS),
            None,
            rf"{DOWN_SCALES} scales {DOWN_BLOCKS}, which no shard holds",
        ),
        (
            lambda t: {**t, DOWN_SCALES: t[DOWN_SCALES][:, :, :2].contiguous()},
            None,
            rf"{DOWN_SCALES} is U8 \(8, 64, 2\); the scales of {DOWN_BLOCKS} \(8, 64, 3, 16\) must be U8 \(8, 64, 3\)",
        ),
        (
            lambda t: {**t, DOWN_BLOCKS: t[DOWN_BLOCKS].view(torch.int8)},
            None,
            rf"{DOWN_BLOCKS} is I8 \(8, 64, 3, 16\); MXFP4 blocks are U8",
        ),
        (
            lambda t: {
                **t,
                GATE_UP_BLOCKS: t[GATE_UP_BLOCKS].reshape(8, 64, 6, 16),  # [E, H, 2I/32, 16]: the transpose
                GATE_UP_SCALES: t[GATE_UP_SCALES].reshape(8, 64, 6),
            },
            None,
            rf"unexpected expert tensor {GATE_UP_BLOCKS} .*shape \(8, 64, 6, 16\), expected \(8, 192, 2, 16\)",
        ),
        (
            lambda t: {
                **_without(t, DOWN_BLOCKS, DOWN_SCALES),
                f"{EXPERTS}.down_proj": torch.zeros(8, I, 64),
            },
            None,
            rf"{EXPERTS}: mixes MXFP4 expert tensors \({GATE_UP_BLOCKS}\) with float ones \({EXPERTS}.down_proj\)",
        ),
        (
            lambda t: {
                **t,
                f"{Q_PROJ}_blocks": t[GATE_UP_BLOCKS][0].clone(),
                f"{Q_PROJ}_scales": t[GATE_UP_SCALES][0].clone(),
            },
            None,
            rf"{Q_PROJ}_blocks is MXFP4 but not part of a routed-experts module",
        ),
        (
            lambda t: {
                **t,
                f"{ATTN_GATE_UP}_blocks": t[GATE_UP_BLOCKS].clone(),  # a fused name, but no experts module's
                f"{ATTN_GATE_UP}_scales": t[GATE_UP_SCALES].clone(),
            },
            None,
            rf"{ATTN_GATE_UP}_blocks is MXFP4 but not part of a routed-experts module",
        ),
    ],
    ids=[
        "unknown-field",
        "modules-not-a-list",
        "no-quantization-config",
        "quant-method",
        "scales-missing",
        "blocks-missing",
        "scales-shape",
        "blocks-dtype",
        "blocks-transposed",
        "mixed-layer",
        "outside-experts",
        "outside-experts-fused-name",
    ],
)
def test_mxfp4_checkpoint_errors(checkpoints, tmp_path, no_heavy_work, edit_tensors, edit_quant, message):
    dst = _copy(checkpoints[0], tmp_path, edit_tensors, edit_quant)
    with pytest.raises(LoadError, match=message):
        _load(dst)


def test_mxfp4_config_on_another_architecture_is_refused(tmp_path, no_heavy_work):
    path = save_tiny_model("qwen3_moe", tmp_path / "m", tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**config, "quantization_config": MXFP4_QUANTIZATION_CONFIG})
    )
    with pytest.raises(
        LoadError, match="quant_method is 'mxfp4' but model_type is 'qwen3_moe'; .* gpt_oss only"
    ):
        _load(path)
