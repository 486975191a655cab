"""DeepSeek-V3 and GLM-4-MoE (sigmoid scores + correction bias, groups, shared experts,
first_k_dense_replace, fp32 router) and DeepSeek-V2 (softmax, group-limited greedy) against transformers;
see ``load_checks``."""

from tests.integration.load_checks import (  # noqa: F401  (collected here)
    family_fixture,
    test_bfloat16_error_bound,
    test_gradients,
    test_greedy_generation,
    test_logits_loss_and_aux_loss,
    test_structure,
)

pair = family_fixture("deepseek_v3", "deepseek_v2", "glm4_moe")
