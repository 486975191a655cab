"""Qwen3-MoE (an mlp_only dense layer) and Qwen2-MoE (sigmoid-gated shared expert, decoder_sparse_step,
mlp_only_layers) against transformers; see ``load_checks``."""

from tests.integration.load_checks import (  # noqa: F401  (collected here)
    family_fixture,
    test_bfloat16_error_bound,
    test_gradients,
    test_greedy_generation,
    test_logits_loss_and_aux_loss,
    test_structure,
)

pair = family_fixture("qwen3_moe", "qwen2_moe")
