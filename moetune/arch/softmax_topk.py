"""Softmax top-k routing: ``p = softmax(W_r x)`` over E experts, keep the top k (renormalised if configured).

Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE, and the Qwen vision-language MoE models: Qwen3-VL-MoE and
Qwen3.5-MoE (with or without a vision config; Qwen3.5 adds a sigmoid-gated shared expert like Qwen2-MoE).
In transformers 5.24 each MoE block computes ``router_logits, top_k_weights, top_k_index = self.gate(x)`` and
then calls ``self.experts(x, top_k_index, top_k_weights)``; moetune replaces only ``experts`` on the
instance, so the router, ``norm_topk_prob``, the shared experts, ``decoder_sparse_step`` / ``mlp_only_layers``
dense layers, and the router logits behind ``output_router_logits`` and the aux loss stay the model's own.
In the vision-language models only the language model has MoE blocks (``model.language_model.layers``); the
vision tower is an ordinary module and stays on the model's device.
"""

from moetune.arch.spec import ArchSpec, Routing, register

SOFTMAX_TOPK = register(
    ArchSpec(
        name="softmax_topk",
        model_types=(
            "qwen3_moe",
            "mixtral",
            "qwen2_moe",
            "olmoe",
            "qwen3_vl_moe",
            "qwen3_5_moe",
            "qwen3_5_moe_text",
        ),
        routing=Routing.SOFTMAX_TOPK,
        router_attr="gate",
    )
)
