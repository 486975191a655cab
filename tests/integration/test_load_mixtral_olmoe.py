"""Mixtral (``block_sparse_moe.experts.{e}.w1/w3/w2`` keys) and OLMoE, softmax top-k routing, against
transformers; see ``load_checks``."""

from tests.integration.load_checks import (  # noqa: F401  (collected here)
    family_fixture,
    test_bfloat16_error_bound,
    test_gradients,
    test_greedy_generation,
    test_logits_loss_and_aux_loss,
    test_structure,
)

pair = family_fixture("mixtral", "olmoe")
