"""Tiny Kimi-K2 checkpoints in the layout Moonshot releases them, written locally from a random tiny model.

Both builders start from ``tiny_model("deepseek_v3", **KIMI_TINY)``: sized so that every ``Linear``'s input is a
multiple of 32 (H = 96, I = 32, dense MLP 128, q/kv LoRA ranks 32; H != 2I), with the release's routing (one
expert group, ``routed_scaling_factor`` 2.827, one shared expert, the first layer dense, no MTP layer).
``config.json`` is the release's own (``kimi_config``): ``model_type: kimi_k2``, ``architectures:
[DeepseekV3ForCausalLM]``, ``auto_map`` into the repository's ``configuration_deepseek`` / ``modeling_deepseek``
(files not written: nothing may run them), ``scoring_func: sigmoid``, ``topk_method: noaux_tc``, YaRN
``rope_scaling`` and the rest; only sizes and token ids are tiny. The weights are sharded as released: one
shard per decoder layer (the embedding with the first) and one for the final norm and ``lm_head``, named
``model-00001-of-000004.safetensors`` (six-digit total, as Moonshot names them) and listed by
``model.safetensors.index.json``. Float tensors are bf16, the routers' ``e_score_correction_bias`` fp32.

* ``save_kimi_instruct``: Kimi-K2-Instruct's FP8. Every decoder ``Linear`` and routed expert matrix is e4m3
  with fp32 128 x 128 ``weight_scale_inv`` (``fp8_checkpoint.quantize_reference``); ``quantization_config:
  {quant_method: fp8, weight_block_size: [128, 128], ...}``.
* ``save_kimi_thinking``: Kimi-K2-Thinking's compressed-tensors INT4 (``pack-quantized``, symmetric, groups of
  32). Every ``Linear`` and routed expert matrix that ``ignore`` does not name (the release's list leaves only
  the routed experts) is stored as ``weight_packed`` int32 ``[O, D/8]``, ``weight_scale`` bf16 ``[O, D/32]``
  and ``weight_shape`` int32 ``[2]``, quantized as compressed-tensors' minmax observer and compressor do it
  (``quantize_int4``; tests check the bytes against the compressor itself).

With ``dequantized_path`` each also writes its reference: the same model with every quantized weight replaced
by its dequantized fp32 value (FP8: torch's own e4m3 conversion times the block scale; INT4: ``q * s``),
``config.json`` renamed to ``model_type: deepseek_v3`` without ``auto_map`` or ``quantization_config`` (the
renaming Moonshot documents), so transformers' own ``DeepseekV3ForCausalLM`` loads it.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from moetune.testing.fp8_checkpoint import FP8_QUANTIZATION_CONFIG, dequantize_reference, quantize_reference
from moetune.testing.tiny import tiny_model

# tiny_config("deepseek_v3") overrides: Kimi's routing, every Linear input a multiple of the INT4 group (32)
KIMI_TINY: dict[str, Any] = {
    "hidden_size": 96,
    "moe_intermediate_size": 32,
    "intermediate_size": 128,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.827,
    "norm_topk_prob": True,
    "num_nextn_predict_layers": 0,
}
# config.json fields that come from the tiny model (sizes, token ids); every other field is the release's
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
    "norm_topk_prob",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)
AUTO_MAP = {
    "AutoConfig": "configuration_deepseek.DeepseekV3Config",
    "AutoModel": "modeling_deepseek.DeepseekV3Model",
    "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
}
# moonshotai/Kimi-K2-Instruct's config.json, sizes and token ids aside (those come from the tiny model)
INSTRUCT: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": AUTO_MAP,
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "model_type": "kimi_k2",
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 0,
    "pretraining_tp": 1,
    "quantization_config": FP8_QUANTIZATION_CONFIG,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.48.3",
    "use_cache": True,
}
# moonshotai/Kimi-K2-Thinking differs in context length, norm epsilon and quantization
THINKING: dict[str, Any] = {
    **INSTRUCT,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {**INSTRUCT["rope_scaling"], "factor": 64.0},
    "transformers_version": "4.56.2",
}
# Kimi-K2-Thinking's quantization_config.ignore: everything but the routed experts stays bf16
KIMI_IGNORE = [
    "lm_head",
    "re:.*self_attn.*",
    "re:.*shared_experts.*",
    "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
]
INT4_GROUP = 32
INT4_QMIN, INT4_QMAX = -8, 7  # compressed-tensors' signed int4 range; stored as q + 8
EXPERT_KEY = re.compile(r"\.experts\.\d+\.\w+\.weight$")  # per-expert keys as save_pretrained writes them
FLOAT_KEPT = ("e_score_correction_bias",)  # released in fp32; every other float tensor in bf16


def compressed_int4_config(group_size: int = INT4_GROUP, ignore: list[str] | None = None) -> dict[str, Any]:
    """Kimi-K2-Thinking's ``quantization_config`` (``ignore`` defaults to the release's)."""
    weights: dict[str, Any] = {
        "actorder": None,
        "block_structure": None,
        "dynamic": False,
        "group_size": group_size,
        "num_bits": 4,
        "observer": "minmax",
        "observer_kwargs": {},
        "strategy": "group",
        "symmetric": True,
        "type": "int",
    }
    group = {"input_activations": None, "output_activations": None, "targets": ["Linear"], "weights": weights}
    return {
        "config_groups": {"group_0": group},
        "format": "pack-quantized",
        "ignore": list(KIMI_IGNORE if ignore is None else ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def kimi_model(seed: int = 0, **overrides: Any) -> Any:
    """The random float32 ``DeepseekV3ForCausalLM`` both builders write (``KIMI_TINY``, then ``overrides``)."""
    return tiny_model("deepseek_v3", seed, **{**KIMI_TINY, **overrides})


def kimi_config(model: Any, release: dict[str, Any], quantization: dict[str, Any] | None) -> dict[str, Any]:
    """``release``'s config.json with ``model``'s sizes and ``quantization`` (None: no quantization_config)."""
    config = {**release, **{k: getattr(model.config, k) for k in SIZE_FIELDS}}
    config["quantization_config"] = quantization
    return {k: v for k, v in sorted(config.items()) if v is not None or k != "quantization_config"}


def reference_config(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` as transformers' own DeepSeek-V3 reads it: model_type renamed, no remote code, no quantization."""
    drop = ("auto_map", "quantization_config")
    return {**{k: v for k, v in config.items() if k not in drop}, "model_type": "deepseek_v3"}


def _float_tensors(model: Any) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The model's tensors as ``save_pretrained`` writes them (per-expert keys), and the keys of every
    ``nn.Linear`` weight and routed expert matrix: what a quantization may cover."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = load_file(str(Path(tmp) / "model.safetensors"))
    linears = {f"{n}.weight" for n, m in model.named_modules() if type(m) is torch.nn.Linear}
    return tensors, [k for k in tensors if k in linears or EXPERT_KEY.search(k)]


def _released(key: str, t: torch.Tensor) -> torch.Tensor:
    return t.float() if key.endswith(FLOAT_KEPT) else t.to(torch.bfloat16)


LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")  # a decoder layer's keys in Kimi-K2's releases


def save_release(
    path: str | Path,
    tensors: dict[str, torch.Tensor],
    config: dict[str, Any],
    *,
    layer_key: re.Pattern[str] = LAYER_KEY,
    layers: int | None = None,
) -> Path:
    """Write ``tensors`` sharded as Kimi's releases are (one shard per decoder layer, whose keys ``layer_key``
    matches, the embedding with the first, one more for the rest) with ``model.safetensors.index.json`` and
    ``config``. ``layers``: the number of decoder layers (default ``config["num_hidden_layers"]``)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    layers = int(config["num_hidden_layers"]) if layers is None else layers
    shards: list[dict[str, torch.Tensor]] = [{} for _ in range(layers + 1)]
    for key, t in tensors.items():
        m = layer_key.match(key)
        shards[int(m.group(1)) if m else 0 if key.startswith("model.embed_tokens") else layers][key] = t
    names = [f"model-{i + 1:05d}-of-{len(shards):06d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sorted(shard), name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _write_reference(path: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(reference_config(config), indent=2))


def save_kimi_instruct(
    path: str | Path, *, seed: int = 0, dequantized_path: str | Path | None = None, **overrides: Any
) -> Path:
    """A tiny Kimi-K2-Instruct (FP8 128 x 128 blocks) at ``path``; see the module docstring."""
    model = kimi_model(seed, **overrides)
    floats, quantizable = _float_tensors(model)
    lm_head = {k for k in quantizable if not k.startswith("model.layers.")}  # the release keeps it bf16
    stored = {k: _released(k, t) for k, t in floats.items()}
    reference = dict(stored)
    for key in sorted(set(quantizable) - lm_head):
        codes, scale_inv = quantize_reference(floats[key])
        stored[key], stored[f"{key}_scale_inv"] = codes, scale_inv
        reference[key] = dequantize_reference(codes, scale_inv)
    config = kimi_config(model, INSTRUCT, FP8_QUANTIZATION_CONFIG)
    if dequantized_path is not None:
        _write_reference(dequantized_path, reference, config)
    return save_release(path, stored, config)


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w ``[O, D]`` float -> (packed ``[O, D/8]`` int32, scale ``[O, D/g]`` bf16), as compressed-tensors does it:
    ``s = max|w| / 7.5`` per group (its minmax observer: the range over (q_max - q_min) / 2), rounded to bf16;
    ``q = round(clamp(w / s, -8, 7))`` in fp32; packed by ``pack_int4``."""
    o, d = w.shape
    groups = w.float().view(o, d // group_size, group_size)
    scale = (groups.abs().amax(dim=2) / ((INT4_QMAX - INT4_QMIN) / 2)).to(torch.bfloat16)
    q = torch.clamp(groups / scale.float()[..., None], INT4_QMIN, INT4_QMAX).round().to(torch.int8)
    return pack_int4(q.view(o, d)), scale


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q ``[O, D]`` int8 in [-8, 7] -> ``[O, D/8]`` int32: ``q + 8`` in 4 bits, code ``i`` of each group of 8 in
    bits ``4i..4i+3`` of its word (little-endian bytes: codes 2j, 2j + 1 in byte j's low, high nibble)."""
    o, d = q.shape
    u = (q.to(torch.int16) - INT4_QMIN).to(torch.uint8).view(o, d // 2, 2)
    return (u[..., 0] | (u[..., 1] << 4)).contiguous().view(torch.int32)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, group_size: int = INT4_GROUP) -> torch.Tensor:
    """packed ``[O, D/8]`` int32 and scale ``[O, D/g]`` -> ``[O, D]`` fp32, ``q * s`` exactly."""
    o = packed.shape[0]
    b = packed.contiguous().view(torch.uint8)
    u = torch.stack((b & 0x0F, b >> 4), dim=-1).view(o, -1)
    q = u.to(torch.float32) + INT4_QMIN
    return q * scale.to(torch.float32).repeat_interleave(group_size, dim=1)


def _ignored(key: str, ignore: list[str]) -> bool:
    """compressed-tensors' rule for the module of weight ``key``: an exact name or a ``re:`` match."""
    module = key.removesuffix(".weight")
    return any(
        re.match(p.removeprefix("re:"), module) is not None if p.startswith("re:") else p == module
        for p in ignore
    )


def compress_int4_weights(
    floats: dict[str, torch.Tensor],
    keys: list[str],
    stored: dict[str, torch.Tensor],
    reference: dict[str, torch.Tensor],
) -> None:
    """Replace each ``keys`` weight of ``stored`` by its compressed-tensors INT4 triple (``weight_packed`` int32,
    ``weight_scale``, ``weight_shape``), quantized from ``floats``; ``reference[key]`` becomes its dequantized
    value (the weights the release defines)."""
    for key in keys:
        name = key.removesuffix(".weight")
        packed, scale = quantize_int4(floats[key])
        del stored[key]
        stored[f"{name}.weight_packed"], stored[f"{name}.weight_scale"] = packed, scale
        stored[f"{name}.weight_shape"] = torch.tensor(floats[key].shape, dtype=torch.int32)
        reference[key] = dequantize_int4(packed, scale)


def save_kimi_thinking(
    path: str | Path,
    *,
    seed: int = 0,
    ignore: list[str] | None = None,
    dequantized_path: str | Path | None = None,
    **overrides: Any,
) -> Path:
    """A tiny Kimi-K2-Thinking (compressed-tensors INT4, groups of 32) at ``path``; see the module docstring.

    ``ignore``: the modules left bf16 (default: the release's ``KIMI_IGNORE``; ``["lm_head"]`` quantizes
    attention, dense MLPs and shared experts too).
    """
    ignore = KIMI_IGNORE if ignore is None else ignore
    model = kimi_model(seed, **overrides)
    floats, quantizable = _float_tensors(model)
    stored = {k: _released(k, t) for k, t in floats.items()}
    reference = dict(stored)
    compress_int4_weights(floats, [k for k in quantizable if not _ignored(k, ignore)], stored, reference)
    config = kimi_config(model, THINKING, compressed_int4_config(ignore=ignore))
    if dequantized_path is not None:
        _write_reference(dequantized_path, reference, config)
    return save_release(path, stored, config)
