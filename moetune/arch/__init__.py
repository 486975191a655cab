"""Architectures: which families moetune runs and how their experts modules are laid out.

``resolve_arch(model_type)`` gives the family's ``ArchSpec`` (or the generic v5-layout spec);
``find_experts(model, spec, model_type)`` lists the model's experts modules with their ``ExpertsLayout``.
Family files register their specs at import: softmax top-k (Qwen3/Qwen2-MoE, Mixtral, OLMoE, and the
vision-language Qwen3-VL-MoE / Qwen3.5-MoE), DeepSeek-V2, DeepSeek-V3 / GLM-4-MoE, gpt-oss, and the generic
fallback.
"""

from moetune.arch import (  # noqa: F401  (registration)
    deepseek,
    generic,
    gpt_oss,
    llama4,
    own_gate,
    softmax_topk,
    unsupported,
)
from moetune.arch.detect import ExpertsLayout, ExpertsSite, find_experts, read_layout
from moetune.arch.spec import (
    ARCHS,
    ArchSpec,
    ExpertsCall,
    LayoutFlags,
    Routing,
    resolve_arch,
    supported_model_types,
    supported_summary,
)

__all__ = [
    "ARCHS",
    "ArchSpec",
    "ExpertsCall",
    "ExpertsLayout",
    "ExpertsSite",
    "LayoutFlags",
    "Routing",
    "find_experts",
    "read_layout",
    "resolve_arch",
    "supported_model_types",
    "supported_summary",
]
