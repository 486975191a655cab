"""Softmax top-k routing: ``p = softmax(W_r x)`` over E experts, keep the top k (renormalised if configured).

Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE. In transformers 5.24 each MoE block computes
``router_logits, top_k_weights, top_k_index = self.gate(x)`` and then calls
``self.experts(x, top_k_index, top_k_weights)``; moetune replaces only ``experts`` on the instance, so the
router, ``norm_topk_prob``, Qwen2-MoE's sigmoid-gated shared expert, ``decoder_sparse_step`` /
``mlp_only_layers`` dense layers, and the router logits behind ``output_router_logits`` and the aux loss
stay the model's own.
"""

from moetune.arch.spec import ArchSpec, Routing, register

SOFTMAX_TOPK = register(
    ArchSpec(
        name="softmax_topk",
        model_types=("qwen3_moe", "mixtral", "qwen2_moe", "olmoe"),
        routing=Routing.SOFTMAX_TOPK,
        router_attr="gate",
    )
)
