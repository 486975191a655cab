"""compressed-tensors INT4 checkpoints (Kimi-K2-Thinking's layout) load as shipped: the routed experts' codes
and bf16 scales go into the engine's ``int4`` format without a float round trip, everything else loads as
bf16 (or, if quantized too, dequantized), and the result is transformers' own DeepSeek-V3.

References, independent of moetune's loader: compressed-tensors' own ``PackedQuantizationCompressor`` (the
code that wrote the release's tensors) decompresses every quantized weight; transformers'
``DeepseekV3ForCausalLM`` holding those weights gives the reference logits (float32, within ``LOGITS_TOL``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from moetune.errors import LoadError
from moetune.layer import CpuExperts
from moetune.testing.kimi import dequantize_int4, reference_config, save_kimi_thinking
from tests.integration.quantized_checks import (
    LOGITS_TOL,
    WEIGHT_ERROR,
    engines,
    expert_weights,
    hf_model,
    max_logit_diff,
    relative_error,
    token_ids,
)

pytest.importorskip("compressed_tensors")  # a dev dependency (pyproject's dev extra)
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32  # noqa: E402

from tests.unit.loading.test_compressed_int4 import scheme  # noqa: E402

EXPERTS = "model.layers.1.mlp.experts"
Q_A = "model.layers.0.self_attn.q_a_proj"


def shipped(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the sharded checkpoint at ``path``."""
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index.values())):
        out.update(load_file(str(path / name)))
    return out


def decompressed(tensors: dict[str, torch.Tensor], scales_dtype: torch.dtype = torch.float32) -> dict:
    """Module name -> its weight decompressed by compressed-tensors, with the scales cast to ``scales_dtype``
    (fp32: ``q * s`` exact; bf16: as shipped, the decompressor rounds the product to bf16)."""
    out = {}
    for key in tensors:
        if key.endswith(".weight_packed"):
            name = key.removesuffix(".weight_packed")
            parts = {
                "weight_packed": tensors[key],
                "weight_scale": tensors[f"{name}.weight_scale"].to(scales_dtype),
                "weight_shape": tensors[f"{name}.weight_shape"],
            }
            out[name] = PackedQuantizationCompressor.decompress(parts, scheme())["weight"]
    return out


def write_reference(src: Path, dst: Path) -> Path:
    """``src`` with every quantized weight decompressed by compressed-tensors (fp32), as a plain DeepSeek-V3
    checkpoint transformers loads itself."""
    tensors = shipped(src)
    weights = {f"{name}.weight": w for name, w in decompressed(tensors).items()}
    parts = (".weight_packed", ".weight_scale", ".weight_shape")
    plain = {k: v for k, v in tensors.items() if not k.endswith(parts)}
    dst.mkdir(parents=True)
    save_file({**plain, **weights}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = reference_config(json.loads((src / "config.json").read_text()))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def thinking(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """variant -> (checkpoint, compressed-tensors-decompressed reference): ``release`` quantizes the routed
    experts only (Kimi-K2-Thinking's ignore list); ``all`` quantizes attention, dense MLPs and shared experts
    too (ignore: lm_head)."""
    root = tmp_path_factory.mktemp("thinking")
    out = {}
    for variant, ignore in (("release", None), ("all", ["lm_head"])):
        path = save_kimi_thinking(root / variant, ignore=ignore, dequantized_path=root / f"{variant}-own")
        out[variant] = (path, write_reference(path, root / f"{variant}-ref"))
    return out


def _load(path, dtype="float32", **options):
    return moetune.load_model(path, device="cpu", dtype=dtype, progress=False, num_threads=1, **options)


def _codes(weights, e: int, role: str) -> torch.Tensor:
    """Expert ``e``'s ``role`` codes ``[O, D]`` as the int4 format holds them (byte j: codes j and j + D/2)."""
    i = weights.intermediate_size
    packed = {"gate": weights.gate_up[e, :i], "up": weights.gate_up[e, i:], "down": weights.down[e]}[role]
    return torch.cat((packed & 0x0F, packed >> 4), dim=1)


def _scale(weights, e: int, role: str) -> torch.Tensor:
    i = weights.intermediate_size
    return {
        "gate": weights.gate_up_scale[e, :i],
        "up": weights.gate_up_scale[e, i:],
        "down": weights.down_scale[e],
    }[role]


def test_experts_hold_the_shipped_codes_and_scales(thinking):
    path, _ = thinking["release"]
    tensors = shipped(path)
    for site, engine in engines(_load(path)).items():
        weights = engine.weights
        assert (weights.name, weights.group_size, weights.symmetric) == ("int4", 32, True)
        for e in range(weights.num_experts):
            for role in ("gate", "up", "down"):
                name = f"{site}.{e}.{role}_proj"
                shape = torch.Size(tensors[f"{name}.weight_shape"].tolist())
                q = unpack_from_int32(
                    tensors[f"{name}.weight_packed"], 4, shape
                )  # compressed-tensors' reader
                assert torch.equal(_codes(weights, e, role), (q + 8).to(torch.uint8)), name
                assert torch.equal(_scale(weights, e, role), tensors[f"{name}.weight_scale"]), name


def test_dequantized_experts_are_compressed_tensors_decompression(thinking):
    """The format's own definition, ``(u - 8) * s`` in fp32, is the decompressor's ``q * s``: exactly with fp32
    scales, and rounded to bf16 it is the decompressor's bf16 output from the scales as shipped."""
    path, _ = thinking["release"]
    tensors = shipped(path)
    exact, as_shipped = decompressed(tensors), decompressed(tensors, torch.bfloat16)
    for site, engine in engines(_load(path)).items():
        gate_up, down = engine.weights.dequantize(torch.float32)
        i = engine.weights.intermediate_size
        for e in range(engine.weights.num_experts):
            for role, got in (("gate", gate_up[e, :i]), ("up", gate_up[e, i:]), ("down", down[e])):
                name = f"{site}.{e}.{role}_proj"
                assert torch.equal(got, exact[name]), name
                assert torch.equal(got.bfloat16(), as_shipped[name]), name


def test_builder_reference_is_compressed_tensors_decompression(thinking):
    """``save_kimi_thinking``'s own dequantized reference equals compressed-tensors' (so both serve)."""
    for path, ref in thinking.values():
        own, theirs = (
            load_file(str(path.parent / f"{path.name}-own" / "model.safetensors")),
            load_file(str(ref / "model.safetensors")),
        )
        assert own.keys() == theirs.keys() and all(torch.equal(own[k], theirs[k]) for k in own)


@pytest.mark.parametrize("variant", ["release", "all"])
def test_logits_match_transformers_on_the_decompressed_weights(thinking, variant):
    path, ref_path = thinking[variant]
    model, ref = _load(path), hf_model(ref_path)
    assert type(model) is type(ref) and getattr(model.config, "quantization_config", None) is None
    for site, engine in engines(model).items():
        for got, want in zip(engine.weights.dequantize(torch.float32), expert_weights(ref, site)):
            assert torch.equal(got, want), site
    reference = dict(ref.named_parameters())
    for name, p in model.named_parameters():  # bf16 as shipped, or (variant "all") dequantized by moetune
        assert torch.equal(p, reference[name]), name
    assert max_logit_diff(model, ref, token_ids()) <= LOGITS_TOL


def test_quantized_attention_is_dequantized(thinking):
    path, _ = thinking["all"]
    tensors = shipped(path)
    assert f"{Q_A}.weight_packed" in tensors and f"{Q_A}.weight" not in tensors
    want = dequantize_int4(tensors[f"{Q_A}.weight_packed"], tensors[f"{Q_A}.weight_scale"])
    assert torch.equal(_load(path).get_parameter(f"{Q_A}.weight"), want)
    assert torch.equal(_load(path, dtype="bfloat16").get_parameter(f"{Q_A}.weight"), want.bfloat16())


def test_expert_memory_is_the_shipped_bytes(thinking):
    """The engines hold what the checkpoint ships for the experts: the codes and scales (the 8-byte
    ``weight_shape`` per matrix is read and checked, not kept), each in storage of exactly its own size."""
    path, _ = thinking["release"]
    tensors = shipped(path)
    shipped_bytes = sum(t.nbytes for k, t in tensors.items() if ".mlp.experts." in k)
    held = 0
    for engine in engines(_load(path)).values():
        for t in engine.weights.state_tensors().values():
            assert t.untyped_storage().nbytes() == t.nbytes  # no hidden larger buffer behind a view
            held += t.nbytes
    assert 0.97 * shipped_bytes <= held <= shipped_bytes
    matrices = sum(1 for k in tensors if k.endswith(".weight_shape") and ".mlp.experts." in k)
    assert held == shipped_bytes - 8 * matrices


def test_lora_trains_on_int4_experts_and_the_adapter_round_trips(thinking, tmp_path):
    path, _ = thinking["release"]
    model = moetune.attach_lora(_load(path), rank=4, alpha=8, targets=("q_a_proj", "experts"))
    ids = token_ids(seed=3, batch=4, seq=10)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(trainable, lr=2e-2)
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses
    experts = [m for m in model.modules() if isinstance(m, CpuExperts)]
    assert experts and all(m.engine.weights.name == "int4" for m in experts)
    expert_b = [p for n, p in model.named_parameters() if ".mlp.experts." in n and ".lora_B." in n]
    assert len(expert_b) == 2 * len(experts) and all(p.abs().max() > 0 for p in expert_b)  # trained
    out = moetune.save_adapter(model, tmp_path / "adapter")
    reloaded = _load(path, adapter=out)
    model.eval()
    assert max_logit_diff(model, reloaded, ids) <= LOGITS_TOL


@pytest.mark.parametrize(("fmt", "name"), [("bf16", "dense"), ("int8", "int8"), ("fp8", "fp8_block")])
def test_other_formats_dequantize_the_int4_experts(thinking, fmt, name):
    path, ref_path = thinking["release"]
    ref = hf_model(ref_path)
    for site, engine in engines(_load(path, expert_format=fmt)).items():
        assert engine.weights.name == name
        for got, want in zip(engine.weights.dequantize(torch.float32), expert_weights(ref, site)):
            error = relative_error(got, want)
            assert error <= WEIGHT_ERROR[name] and (error == 0) == (name == "dense"), (site, error)


def test_int4_with_other_options_requantizes(thinking):
    """int4 options other than the checkpoint's (here zero points) are an explicit request: quantized again."""
    path, ref_path = thinking["release"]
    weights = engines(_load(path, expert_format="int4", int4_symmetric=False))[EXPERTS].weights
    assert (weights.group_size, weights.symmetric) == (32, False)
    error = relative_error(
        weights.dequantize(torch.float32)[1], expert_weights(hf_model(ref_path), EXPERTS)[1]
    )
    assert 0 < error <= WEIGHT_ERROR["int4"]


def test_int4_store_holds_the_checkpoint_bytes(thinking, tmp_path):
    """``moetune convert --format int4`` of an INT4 checkpoint writes its own codes and scales (its groups are
    the defaults), and a load from that store equals the native load bit for bit."""
    from moetune.loading.convert import convert_checkpoint

    path, _ = thinking["release"]
    manifest = convert_checkpoint(path, tmp_path / "store", "int4", progress=False)
    assert (manifest.format, manifest.params) == ("int4", {"group_size": 32, "symmetric": True})
    native, stored = engines(_load(path)), engines(_load(path, expert_path=tmp_path / "store"))
    for site, engine in native.items():
        mine, theirs = engine.weights.state_tensors(), stored[site].weights.state_tensors()
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), site


# --- refused before any weight is read: config fields, then tensors against the config -------------------------


def _edit(thinking, tmp_path, quant=None, tensors=None) -> Path:
    dst = shutil.copytree(thinking["release"][0], tmp_path / "ckpt")
    if quant is not None:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = quant(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        index = json.loads((dst / "model.safetensors.index.json").read_text())
        shard = index["weight_map"][f"{EXPERTS}.0.up_proj.weight_packed"]
        edited = tensors(load_file(str(dst / shard)))
        save_file(edited, str(dst / shard), metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard or k in edited}
        index["weight_map"].update(dict.fromkeys(edited, shard))
        (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst


def _weights(**fields):
    def edit(quant):
        group = quant["config_groups"]["group_0"]
        return {**quant, "config_groups": {"group_0": {**group, "weights": {**group["weights"], **fields}}}}

    return edit


WHERE = r"quantization_config\.config_groups\.group_0\.weights"
UP = f"{EXPERTS}.0.up_proj"


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        (_weights(num_bits=8), rf"{WHERE}\.num_bits is 8; .* only with num_bits 4 \(symmetric int4"),
        (_weights(symmetric=False), rf"{WHERE}\.symmetric is False; .* only with symmetric True"),
        (_weights(actorder="group"), rf"{WHERE}\.actorder is 'group'; .* only with actorder None or False"),
        (_weights(type="float"), rf"{WHERE}\.type is 'float'; .* only with type 'int'"),
        (_weights(group_size=16), rf"{WHERE}\.group_size is 16; .* only with group_size 32 or 64 or 128"),
        (_weights(strategy="channel"), rf"{WHERE}\.strategy is 'channel'; .* only with strategy 'group'"),
        (
            lambda q: {**q, "format": "marlin-24"},
            r"quantization_config\.format is 'marlin-24'; .*'pack-quantized'",
        ),
        (
            lambda q: {**q, "format": "nvfp4-pack-quantized"},
            r"quantization_config\.format is 'nvfp4-pack-quantized'; .* only with format 'pack-quantized'",
        ),
        (
            lambda q: {**q, "quant_method": "gptq"},
            r"quantization_config\.quant_method is 'gptq'; moetune loads quantized checkpoints of quant_method "
            r"compressed-tensors, fp8, mxfp4 \(.*pack-quantized",
        ),
        (
            lambda q: {
                **q,
                "config_groups": {
                    "group_0": {**q["config_groups"]["group_0"], "input_activations": {"num_bits": 8}}
                },
            },
            r"group_0\.input_activations is \{'num_bits': 8\}; .* only with input_activations None",
        ),
        (
            lambda q: {**q, "transform_config": {"config_groups": {"R1": {"type": "hadamard"}}}},
            r"quantization_config\.transform_config is .*hadamard.* only with transform_config None",
        ),
        (
            lambda q: {**q, "quantization_status": "frozen"},
            r"quantization_status is 'frozen'; .* only with quantization_status 'compressed'",
        ),
    ],
    ids=[
        "num_bits-8",
        "asymmetric",
        "actorder",
        "type-float",
        "group_size-16",
        "strategy-channel",
        "format-marlin-24",
        "format-nvfp4",
        "quant_method-unknown",
        "quantized-activations",
        "transform-config",
        "status-frozen",
    ],
)
def test_config_moetune_cannot_hold_as_shipped_is_refused(thinking, tmp_path, no_heavy_work, quant, message):
    with pytest.raises(LoadError, match=message):
        _load(_edit(thinking, tmp_path, quant=quant))


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        (
            lambda t: {**t, f"{UP}.weight_scale": t[f"{UP}.weight_scale"].half()},
            rf"{UP}.weight_scale is F16; routed experts are held as moetune's int4 format, whose group scales are "
            "bf16",
        ),
        (
            lambda t: {**t, f"{UP}.weight_zero_point": torch.zeros(32, 3, dtype=torch.int8)},
            rf"{UP}.weight_packed: the config says symmetric: true, but {UP}.weight_zero_point is stored",
        ),
        (
            lambda t: {**t, f"{UP}.weight_g_idx": torch.zeros(96, dtype=torch.int32)},
            rf"{UP}.weight_packed: the config says actorder: null, but {UP}.weight_g_idx is stored",
        ),
        (
            lambda t: {k: v for k, v in t.items() if k != f"{UP}.weight_shape"},
            rf"{UP}.weight_packed has no {UP}.weight_shape in any shard",
        ),
        (
            lambda t: {**t, f"{UP}.weight_scale": t[f"{UP}.weight_scale"][:, :2].contiguous()},
            rf"{UP}.weight_scale is BF16 \(32, 2\); the scales of {UP}.weight_packed \(32, 12\) \(a \[32, 96\] "
            r"weight\) must be BF16/F16/F32 \[32, 96 / 32\]",
        ),
        (
            lambda t: {k: v for k, v in t.items() if k != f"{UP}.weight_packed"},
            rf"{UP}.weight_scale belongs to {UP}.weight_packed, which no shard holds",
        ),
    ],
    ids=["expert-scales-f16", "zero-point", "g_idx", "no-weight_shape", "scale-shape", "orphan-scale"],
)
def test_tensors_that_disagree_with_the_config_are_refused(
    thinking, tmp_path, no_heavy_work, tensors, message
):
    with pytest.raises(LoadError, match=message):
        _load(_edit(thinking, tmp_path, tensors=tensors))


def test_quantized_module_in_ignore_is_refused(thinking, tmp_path, no_heavy_work):
    def ignore_experts(quant):
        return {**quant, "ignore": [*quant["ignore"], "re:.*experts.*"]}

    with pytest.raises(LoadError, match=rf"{UP} is quantized, but quantization_config.ignore lists it"):
        _load(_edit(thinking, tmp_path, quant=ignore_experts))


def test_packed_tensors_without_a_quantization_config_are_refused(thinking, tmp_path, no_heavy_work):
    dst = _edit(thinking, tmp_path)
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        LoadError,
        match=rf"{UP}.weight_packed is a compressed-tensors packed weight, but config.json has no "
        r"quantization_config \(compressed-tensors INT4 checkpoints declare quant_method: compressed-tensors",
    ):
        _load(dst)


def test_weight_shape_that_disagrees_is_refused_when_read(thinking, tmp_path):
    dst = _edit(
        thinking,
        tmp_path,
        tensors=lambda t: {**t, f"{UP}.weight_shape": torch.tensor([32, 64], dtype=torch.int32)},
    )
    with pytest.raises(
        LoadError,
        match=rf"{UP}.weight_shape holds \[32, 64\], but its packed weight and scales are "
        r"of a \[32, 96\] weight",
    ):
        _load(dst)
