"""Families with no moetune code at all (ERNIE-4.5-MoE, MiniMax): detected from their v5 experts modules."""

from moetune.arch import resolve_arch
from tests.integration.load_checks import (  # noqa: F401  (collected here)
    family_fixture,
    test_bfloat16_error_bound,
    test_gradients,
    test_greedy_generation,
    test_logits_loss_and_aux_loss,
    test_structure,
)

pair = family_fixture("ernie4_5_moe", "minimax")


def test_resolved_by_the_generic_spec(pair):
    family = pair[0]
    assert resolve_arch(family).name == "generic"
