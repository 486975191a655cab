"""Tiny gpt-oss checkpoints in the on-disk layout of the MXFP4 release (openai/gpt-oss-20b, -120b), written
locally from a random tiny model (no downloads).

``save_mxfp4_checkpoint`` saves a random ``tiny_model("gpt_oss")`` and rewrites it the way the release stores
it: every routed-experts module's fused weights become MXFP4 (``moetune.engine.formats.mxfp4``, the OCP rule),
in the release's tensors and orientation::

    model.layers.{l}.mlp.experts.gate_up_proj_blocks   U8   [E, 2I, H/32, 16]   two e2m1 codes per byte
    model.layers.{l}.mlp.experts.gate_up_proj_scales   U8   [E, 2I, H/32]       e8m0, 2^(s - 127)
    model.layers.{l}.mlp.experts.down_proj_blocks      U8   [E, H, I/32, 16]
    model.layers.{l}.mlp.experts.down_proj_scales      U8   [E, H, I/32]
    model.layers.{l}.mlp.experts.gate_up_proj_bias     BF16 [E, 2I]
    model.layers.{l}.mlp.experts.down_proj_bias        BF16 [E, H]

Blocks hold each expert matrix as ``[out, in]``, blocks of 32 along the input: the transpose of the
run-time ``GptOssExperts.gate_up_proj [E, H, 2I]`` / ``down_proj [E, I, H]``, with gate_up's rows still
interleaved (gate at even rows, up at odd) as in the run-time tensor and its bias. Every other tensor is
bf16, and ``config.json`` gains the release's ``quantization_config``. The default intermediate size is 96
(three blocks; the tiny models' 24 is not a multiple of 32, which MXFP4 needs).

``dequantized_path`` also writes the reference: the same model with every expert weight dequantized by
transformers' own ``convert_moe_packed_tensors`` (what ``from_pretrained`` runs on a CPU) to float32 and
every other tensor widened from bf16, as a plain checkpoint transformers loads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from moetune.engine.formats.mxfp4 import BLOCK, Mxfp4Experts
from moetune.testing.tiny import save_tiny_model

WEIGHTS = "model.safetensors"
MXFP4_QUANTIZATION_CONFIG: dict[str, Any] = {  # as in openai/gpt-oss-20b's config.json
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
DEFAULT_INTERMEDIATE = 96  # I: a multiple of 32 with 2I != H = 64 and I != H
PROJECTIONS = ("gate_up_proj", "down_proj")


def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """Run-time ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` (float) -> the release's
    ``{gate_up_proj,down_proj}_{blocks,scales}`` (see the module docstring)."""
    fmt = Mxfp4Experts.from_dense(gate_up.transpose(1, 2), down.transpose(1, 2))  # [out, in], rows as stored
    out = {}
    for proj, codes, scale in (
        ("gate_up_proj", fmt.gate_up, fmt.gate_up_scale),
        ("down_proj", fmt.down, fmt.down_scale),
    ):
        out[f"{proj}_blocks"] = codes.reshape(*scale.shape, BLOCK // 2)
        out[f"{proj}_scales"] = scale
    return out


def dequantize_reference(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' own MXFP4 dequantization: blocks ``[E, O, D/32, 16]`` and scales ``[E, O, D/32]`` ->
    the run-time tensor ``[E, D, O]`` in float32."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)


def save_mxfp4_checkpoint(
    path: str | Path,
    *,
    seed: int = 0,
    dequantized_path: str | Path | None = None,
    **overrides: Any,
) -> Path:
    """Write a tiny gpt-oss model to ``path`` as the MXFP4 release stores it (see the module docstring).

    ``overrides`` go to ``tiny_config("gpt_oss")`` (default ``intermediate_size=96``; H and I must be
    multiples of 32). With ``dequantized_path``, the float32 reference checkpoint is written there too.
    """
    from safetensors.torch import load_file, save_file

    overrides = {"intermediate_size": DEFAULT_INTERMEDIATE, **overrides}
    path = save_tiny_model("gpt_oss", path, seed=seed, tokenizer=False, **overrides)
    tensors = load_file(str(path / WEIGHTS))
    config = json.loads((path / "config.json").read_text())
    stored: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    stems = [k.removesuffix("gate_up_proj") for k in tensors if k.endswith(".experts.gate_up_proj")]
    fused = {f"{stem}{proj}" for stem in stems for proj in PROJECTIONS}
    for key, t in tensors.items():
        if key not in fused:  # biases, attention, router, norms, embeddings: bf16 as released
            stored[key] = t.to(torch.bfloat16)
            reference[key] = stored[key].float()
    for stem in stems:
        packed = quantize_experts(tensors[f"{stem}gate_up_proj"], tensors[f"{stem}down_proj"])
        stored.update({f"{stem}{name}": t for name, t in packed.items()})
        for proj in PROJECTIONS:
            reference[f"{stem}{proj}"] = dequantize_reference(
                packed[f"{proj}_blocks"], packed[f"{proj}_scales"]
            )
    save_file(stored, str(path / WEIGHTS), metadata={"format": "pt"})
    release = {**config, "dtype": "bfloat16", "quantization_config": MXFP4_QUANTIZATION_CONFIG}
    (path / "config.json").write_text(json.dumps(release, indent=2))
    if dequantized_path is not None:
        ref = Path(dequantized_path)
        ref.mkdir(parents=True, exist_ok=True)
        save_file(reference, str(ref / WEIGHTS), metadata={"format": "pt"})
        (ref / "config.json").write_text(json.dumps({**config, "dtype": "float32"}, indent=2))
    return path
