"""The bridge into torch and transformers: the autograd Function and the module that holds an engine."""

from moetune.layer.cpu_experts import CpuExperts
from moetune.layer.function import ExpertsFunction, routed_experts

__all__ = ["CpuExperts", "ExpertsFunction", "routed_experts"]
