"""The bridge into torch and transformers: the autograd Function and the module that holds an engine."""

from moetune.layer.cpu_experts import (
    EXPERTS_MODULES,
    BatchedExperts,
    CpuExperts,
    IdentityExperts,
    PostNormExperts,
    PrescaledDenseExperts,
)
from moetune.layer.function import ExpertsFunction, routed_experts

__all__ = [
    "EXPERTS_MODULES",
    "BatchedExperts",
    "CpuExperts",
    "ExpertsFunction",
    "IdentityExperts",
    "PostNormExperts",
    "PrescaledDenseExperts",
    "routed_experts",
]
