"""Architectures: which families moetune runs and how their experts modules are laid out.

``resolve_arch(model_type)`` gives the family's ``ArchSpec`` (or the generic v5-layout spec);
``find_experts(model, spec, model_type)`` lists the model's experts modules with their ``ExpertsLayout``.
Family files register their specs at import: softmax top-k (Qwen3/Qwen2-MoE, Mixtral, OLMoE, and the
vision-language Qwen3-VL-MoE / Qwen3.5-MoE), DeepSeek-V2, DeepSeek-V3 / GLM-4-MoE, gpt-oss, the families whose
experts compute their own gated activation (``own_gate``: DeepSeek-V4, GLM-5-Next, HY-V4, MiniMax-M3, Step-3.7,
Inkling2, Beam), Llama 4 (pre-scaled dense experts call), LongCat-Flash (zero-computation experts), Muse Spark (a norm on each expert's output), DBRX (flat expert matrices), the
families refused with a reason (``unsupported``) and the generic fallback. ``docs/models.md`` lists every MoE
family transformers ships and what moetune does with it.
"""

from moetune.arch import (  # noqa: F401  (registration)
    dbrx,
    deepseek,
    generic,
    gpt_oss,
    llama4,
    longcat,
    own_gate,
    post_norm,
    softmax_topk,
    unsupported,
)
from moetune.arch.detect import ExpertsLayout, ExpertsSite, find_experts, read_layout
from moetune.arch.spec import (
    ARCHS,
    ArchSpec,
    ExpertsCall,
    FlatTensors,
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
    "FlatTensors",
    "LayoutFlags",
    "Routing",
    "find_experts",
    "read_layout",
    "resolve_arch",
    "supported_model_types",
    "supported_summary",
]
