"""References for quantized experts: transformers' own model holding the weights moetune's engines compute with.

A quantized engine computes with its ``dequantize()`` weights (tests/unit/engine/test_formats.py proves ``tile`` and
``dequantize`` agree bit for bit), so transformers' model with those weights copied into its experts is the
reference: float32 logits within ``LOGITS_TOL`` (same weights, only the summation order differs). The
quantization itself is checked apart, as the relative Frobenius error of the dequantized weights against the
weights they came from, within docs/formats.md's bounds.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moetune.layer import CpuExperts

LOGITS_TOL = 1e-5  # float32, as tests/integration/load_checks.py
# Relative Frobenius error of dequantized expert weights, docs/formats.md's bounds for Gaussian weights.
WEIGHT_ERROR = {"int8": 0.01, "int4": 0.12, "fp8_block": 0.03, "dense": 0.0}


def hf_model(path: str | Path):
    """transformers' own float32 model of the checkpoint at ``path`` (a plain one: it is the reference)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def engines(model) -> dict[str, object]:
    """Experts module path -> its ``ExpertEngine``, for every ``CpuExperts`` of a moetune model."""
    out = {name: m.engine for name, m in model.named_modules() if isinstance(m, CpuExperts)}
    assert out, "no CpuExperts in the model"
    return out


def expert_weights(hf, path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` of transformers' experts module ``path`` (qwen3_moe,
    deepseek_v3 and the like store them in the engine's layout)."""
    module = hf.get_submodule(path)
    return module.gate_up_proj.detach(), module.down_proj.detach()


@torch.no_grad()
def with_engine_weights(hf, model):
    """``hf`` with each experts module's weights replaced by those moetune's engine computes with (in place)."""
    for path, engine in engines(model).items():
        gate_up, down = engine.weights.dequantize(torch.float32)
        module = hf.get_submodule(path)
        assert module.gate_up_proj.shape == gate_up.shape and module.down_proj.shape == down.shape
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return hf


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    """``||approx - exact||_F / ||exact||_F``."""
    return ((approx.double() - exact.double()).norm() / exact.double().norm()).item()


def token_ids(seed: int = 0, batch: int = 2, seq: int = 12) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 96, (batch, seq), generator=gen)


@torch.no_grad()
def max_logit_diff(a, b, ids: torch.Tensor) -> float:
    return (a(ids).logits.float() - b(ids).logits.float()).abs().max().item()
