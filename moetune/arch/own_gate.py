"""Families whose experts compute their own gated activation (``_apply_gate``), and the engine activation each is.

Every class below overrides transformers' default ``act_fn(gate) * up``; its spec names the engine activation
that computes the same thing, with the parameters read off the module. ``detect`` then checks the claim on a
random probe against the module's own ``_apply_gate`` and refuses the family if they differ (a changed
transformers fails loudly instead of training a different model).

    DeepSeek-V4, GLM-5-Next, HY-V4(-VL)  silu(min(g, L)) * clamp(u, -L, L)               clamped_swiglu
    MiniMax-M3-VL                        (clamp(u, -L, L) + 1) * g' * sigmoid(a g'),     clamped_swiglu
                                         g' = min(g, L) (gpt-oss's, not interleaved)     (a, L, offset 1)
    Step-3.7                             min(silu(g), L) * clamp(u, -L, L), L per layer  swiglu_clamped_output
                                         (no limit: plain silu)
    Inkling2, Inkling2-Loop              4 tanh(g/4) * sigmoid(g) * 25 tanh(u/25)         softcapped_swiglu
                                         (softcaps from the config), in fp32
    Beam                                 act_fn(g) * u computed in fp32                  the act_fn's own

Step-3.7's experts class also lacks ``use_experts_implementation``: its spec gives the layout flags
(gate_up ``[E, 2I, H]``, gate block first, no biases). All of them are called as
``experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`` by their MoE block after its ``gate``
router; DeepSeek-V4, GLM-5-Next and HY-V4 then add ``shared_experts`` of the same input, which moetune runs on
the device while the engine computes (``shared_attr``).
"""

from __future__ import annotations

import math
from typing import Any

from moetune.arch.detect import act_fn_name
from moetune.arch.spec import ArchSpec, LayoutFlags, Routing, register
from moetune.errors import ArchError


def _silu_act(module: Any) -> None:
    """``ArchError`` unless the module's ``act_fn`` is SiLU (the clamped SwiGLUs below assume it)."""
    if act_fn_name(module.act_fn) != "silu":
        raise ArchError(
            f"{type(module).__name__}: act_fn {type(module.act_fn).__name__} inside the clamped SwiGLU; the engine "
            "computes it with SiLU only (hidden_act='silu')"
        )


def _clamped(limit_attr: str) -> Any:
    def resolve(module: Any) -> tuple[str, dict[str, float]]:
        if hasattr(module, "act_fn"):
            _silu_act(module)
        return "clamped_swiglu", {"limit": float(getattr(module, limit_attr))}

    return resolve


def _minimax_m3(module: Any) -> tuple[str, dict[str, float]]:
    return "clamped_swiglu", {
        "alpha": float(module.swiglu_alpha),
        "limit": float(module.swiglu_limit),
        "up_offset": 1.0,
    }


def _step3p7(module: Any) -> tuple[str, dict[str, float]]:
    _silu_act(module)
    limit = float(module.limit)
    return ("silu", {}) if math.isinf(limit) else ("swiglu_clamped_output", {"limit": limit})


def _softcapped(module: Any) -> tuple[str, dict[str, float]]:
    return "softcapped_swiglu", {
        "gate_softcap": float(module.act_fn.gate_softcap.softcap),
        "up_softcap": float(module.act_fn.up_softcap.softcap),
    }


def _upcast_act_fn(module: Any) -> tuple[str, dict[str, float]]:
    # the fp32 upcast only changes rounding, and the engine computes fp32 weights in fp32 (bf16 ones per machine)
    name = act_fn_name(module.act_fn)
    if name is None:
        raise ArchError(
            f"{type(module).__name__}: act_fn {type(module.act_fn).__name__} is not one the engine computes"
        )
    return name, {}


DEEPSEEK_V4 = register(
    ArchSpec(
        name="deepseek_v4",
        model_types=("deepseek_v4",),
        routing=Routing.MODEL_DEFINED,  # scores + correction bias, or a token-id hash in the first layers
        router_attr="gate",
        activation=_clamped("limit"),
        shared_attr="shared_experts",
    )
)

CLAMPED = register(
    ArchSpec(
        name="clamped_swiglu",
        model_types=("glm5_next", "glm5_next_text", "hy_v4", "hy_v4_vl", "hy_v4_vl_text"),
        routing=Routing.MODEL_DEFINED,
        router_attr="gate",
        activation=_clamped("swiglu_limit"),
        shared_attr="shared_experts",
    )
)

MINIMAX_M3 = register(
    ArchSpec(
        name="minimax_m3",
        model_types=("minimax_m3_vl", "minimax_m3_vl_text"),
        routing=Routing.MODEL_DEFINED,
        router_attr="gate",
        activation=_minimax_m3,
    )
)

STEP3P7 = register(
    ArchSpec(
        name="step3p7",
        model_types=("step3p7",),
        routing=Routing.MODEL_DEFINED,
        router_attr="gate",
        activation=_step3p7,
        layout=LayoutFlags(is_transposed=False, is_concatenated=True, has_bias=False, has_gate=True),
    )
)

SOFTCAPPED = register(
    ArchSpec(
        name="softcapped_swiglu",
        model_types=("inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text"),
        routing=Routing.MODEL_DEFINED,
        router_attr="gate",
        activation=_softcapped,
    )
)

BEAM = register(
    ArchSpec(
        name="beam",
        model_types=("beam",),
        routing=Routing.MODEL_DEFINED,
        router_attr="gate",
        activation=_upcast_act_fn,
    )
)
