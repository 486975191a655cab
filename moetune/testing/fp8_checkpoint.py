"""Tiny FP8 checkpoints in DeepSeek-V3's layout, written locally from a random tiny model (no downloads).

``save_fp8_checkpoint`` saves a random ``tiny_model`` and rewrites it the way DeepSeek-V3 / Qwen3-FP8 are
released: every ``nn.Linear`` of the decoder layers (attention, dense MLPs, shared experts) and every routed
expert matrix becomes float8 e4m3fn codes ``<name>.weight`` plus an fp32 ``<name>.weight_scale_inv`` of shape
``[ceil(out/128), ceil(in/128)]`` (one dequantization multiplier per 128 x 128 block, partial edge blocks
included); embeddings, norms, routers and lm_head stay float. ``config.json`` gains
``quantization_config: {quant_method: fp8, weight_block_size: [128, 128], ...}``.

``dequantized_path`` also writes the reference: the same model with every FP8 weight replaced by
``codes * scale_inv`` in fp32 (``dequantize_reference``: torch's own e4m3fn -> fp32 conversion and one fp32
product per weight, independent of moetune's loader and engine), as a plain checkpoint transformers loads.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from moetune.engine.formats.fp8_block import BLOCK, FP8, grid, quantize_blocks
from moetune.testing.tiny import save_tiny_model, tiny_model

WEIGHTS = "model.safetensors"
FP8_QUANTIZATION_CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
EXPERT_KEY = re.compile(r"\.experts\.\d+\.\w+\.weight$")  # per-expert keys as save_pretrained writes them


def quantize_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w ``[O, D]`` float -> (codes ``[O, D]`` e4m3fn, scale_inv ``[ceil(O/128), ceil(D/128)]`` fp32)."""
    codes = torch.empty(w.shape, dtype=FP8)
    scale_inv = torch.empty(grid(*w.shape), dtype=torch.float32)
    quantize_blocks(w.float(), codes, scale_inv)
    return codes, scale_inv


def dequantize_reference(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """codes ``[O, D]`` e4m3fn and block scale_inv -> ``[O, D]`` fp32:
    ``codes[o, d] * scale_inv[o // 128, d // 128]``."""
    o, d = codes.shape
    per_element = scale_inv.repeat_interleave(BLOCK, 0)[:o].repeat_interleave(BLOCK, 1)[:, :d]
    return codes.to(torch.float32) * per_element


def fp8_keys(family: str, keys: list[str], **overrides: Any) -> list[str]:
    """The keys of a saved tiny ``family`` checkpoint that FP8 releases quantize: the ``.weight`` of every
    ``nn.Linear`` inside the decoder layers, and every routed expert matrix."""
    model = tiny_model(family, **overrides)
    linears = {
        f"{name}.weight"
        for name, module in model.named_modules()
        if type(module) is torch.nn.Linear and ".layers." in name
    }
    return [k for k in keys if k in linears or EXPERT_KEY.search(k)]


def save_fp8_checkpoint(
    family: str,
    path: str | Path,
    *,
    seed: int = 0,
    dequantized_path: str | Path | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny ``family`` model to ``path`` as an FP8 block-scaled checkpoint (see the module docstring).

    ``overrides`` go to the config (e.g. ``hidden_size=256, moe_intermediate_size=192`` for several and partial
    128 blocks). With ``dequantized_path``, the dequantized float32 reference checkpoint is written there too.
    """
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(family, path, seed=seed, tokenizer=False, **overrides)
    tensors = load_file(str(path / WEIGHTS))
    config = json.loads((path / "config.json").read_text())
    quantized: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for key in fp8_keys(family, list(tensors), seed=seed, **overrides):
        codes, scale_inv = quantize_reference(tensors[key])
        quantized[key], quantized[f"{key}_scale_inv"] = codes, scale_inv
        dequantized[key] = dequantize_reference(codes, scale_inv)
    assert quantized, f"no FP8 keys found in the tiny {family} checkpoint"
    save_file({**tensors, **quantized}, str(path / WEIGHTS), metadata={"format": "pt"})
    (path / "config.json").write_text(
        json.dumps({**config, "quantization_config": FP8_QUANTIZATION_CONFIG}, indent=2)
    )
    if dequantized_path is not None:
        ref = Path(dequantized_path)
        ref.mkdir(parents=True, exist_ok=True)
        save_file({**tensors, **dequantized}, str(ref / WEIGHTS), metadata={"format": "pt"})
        (ref / "config.json").write_text(json.dumps(config, indent=2))
    return path
