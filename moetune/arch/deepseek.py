"""Group-limited routing (DeepSeek-V2; DeepSeek-V3 and GLM-4-MoE).

DeepSeek-V2: softmax scores, top-k restricted to the ``topk_group`` best of ``n_group`` expert groups
(``topk_method="group_limited_greedy"``), times ``routed_scaling_factor``.
DeepSeek-V3 / GLM-4-MoE: sigmoid scores plus ``e_score_correction_bias`` choose the experts (group-limited),
the uncorrected scores weight them, renormalised (``norm_topk_prob``) and scaled.

In all three the block calls ``self.experts(x, topk_indices, topk_weights)`` after its ``gate`` router, then
adds the always-on shared experts; the first ``first_k_dense_replace`` layers are dense MLPs without
routed experts. moetune swaps only ``experts``; the router (fp32 weights, correction bias), the shared
experts and the dense layers stay on the model's device, the shared experts queued ahead of the CPU
engine's work so the two overlap.
"""

from moetune.arch.spec import ArchSpec, Routing, register

DEEPSEEK_V2 = register(
    ArchSpec(
        name="deepseek_v2",
        model_types=("deepseek_v2",),
        routing=Routing.SOFTMAX_GROUP_LIMITED,
        router_attr="gate",
        shared_attr="shared_experts",
    )
)

DEEPSEEK_V3 = register(
    ArchSpec(
        name="deepseek_v3",
        model_types=("deepseek_v3", "glm4_moe"),
        routing=Routing.SIGMOID_GROUP_LIMITED,
        router_attr="gate",
        shared_attr="shared_experts",
    )
)
