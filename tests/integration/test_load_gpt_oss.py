"""gpt-oss (transposed, interleaved gate_up with biases, clamped SwiGLU) against transformers; see
``load_checks``. Also checks the one-time re-layout into the engine's gate-rows-first ``[E, 2I, H]``."""

import torch

from tests.integration.load_checks import (  # noqa: F401  (collected here)
    family_fixture,
    test_bfloat16_error_bound,
    test_gradients,
    test_greedy_generation,
    test_logits_loss_and_aux_loss,
    test_structure,
)

pair = family_fixture("gpt_oss")


def test_relayout_into_engine(pair):
    _, _, ref, model = pair
    hf = ref.model.layers[1].mlp.experts  # gate_up_proj [E, H, 2I], gate at even columns
    engine = model.model.layers[1].mlp.experts.engine
    gate, up = hf.gate_up_proj[..., 0::2], hf.gate_up_proj[..., 1::2]  # [E, H, I] each
    assert torch.equal(engine.weights.gate_up, torch.cat((gate, up), dim=2).transpose(1, 2))
    assert torch.equal(engine.weights.down, hf.down_proj.transpose(1, 2))
    bias = hf.gate_up_proj_bias
    assert torch.equal(engine.gate_up_bias, torch.cat((bias[:, 0::2], bias[:, 1::2]), dim=1))
    assert torch.equal(engine.down_bias, hf.down_proj_bias)
    assert engine.act.name == "gpt_oss" and engine.act.alpha == hf.alpha and engine.act.limit == hf.limit
