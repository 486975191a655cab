"""gpt-oss: top-k of the router logits (with a router bias), softmax over the k; clamped SwiGLU experts.

``GptOssExperts`` stores gate_up ``[E, H, 2I]`` transposed with gate and up interleaved along 2I (gate at
even columns), down ``[E, I, H]``, and biases for both projections. The layout is read off the module's
``is_transposed`` / ``is_concatenated`` / ``has_bias`` flags by ``moetune.arch.detect`` and re-laid out once
at load; this spec only names the activation its ``_apply_gate`` computes:
``(clamp(up, -L, L) + 1) * g * sigmoid(alpha * g)``, ``g = min(gate, L)``, with alpha and L from the module.
The block (``GptOssMLP``) calls ``self.experts(x, router_indices, router_scores)`` after ``self.router``.
"""

from __future__ import annotations

from typing import Any

from moetune.arch.spec import ArchSpec, Routing, register


def _clamped_swiglu(module: Any) -> tuple[str, dict[str, float]]:
    return "gpt_oss", {"alpha": float(module.alpha), "limit": float(module.limit)}


GPT_OSS = register(
    ArchSpec(
        name="gpt_oss",
        model_types=("gpt_oss",),
        routing=Routing.TOPK_SOFTMAX,
        router_attr="router",
        activation=_clamped_swiglu,
    )
)
