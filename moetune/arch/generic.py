"""The fallback for model types not registered by name: any transformers v5 experts module.

transformers 5 marks its experts classes with ``use_experts_implementation``, which promises the call
``experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])`` and records the weight layout on
each instance (``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_gate``). ``moetune.arch.detect``
reads those flags and the parameter shapes, so a family such as ERNIE-4.5-MoE or MiniMax loads with no
family-specific code; the model's router and block stay as they are.
"""

from moetune.arch.spec import GENERIC, ArchSpec, Routing, register

GENERIC_SPEC = register(
    ArchSpec(name=GENERIC, model_types=(), routing=Routing.MODEL_DEFINED, router_attr=None)
)
