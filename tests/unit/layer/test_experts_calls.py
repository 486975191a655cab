"""The experts modules for families that call their experts differently, against transformers' own modules.

Llama 4 (``PrescaledDenseExperts``) and LongCat-Flash (``IdentityExperts``): transformers' experts module and
moetune's, on the same weights and inputs, in float64; outputs and the gradients of every input (the router's
scores or weights included) agree to rounding.
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine import DenseExperts, ExpertEngine
from moetune.layer import IdentityExperts, PrescaledDenseExperts
from tests.unit.engine_cases import rel_err

E, H, I, T, K = 6, 16, 10, 9, 2


def _randomize(module: torch.nn.Module) -> None:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


def _grads(out: torch.Tensor, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    return torch.autograd.grad(out, inputs, gy, retain_graph=True)  # both models share the inputs' graph


def test_llama4_prescaled_dense_call():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

    config = Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, hidden_act="silu")
    theirs = Llama4TextExperts(config).double()
    _randomize(theirs)
    # what Llama4TextMoe hands its experts: every token once per expert, times its score (0 off the top k)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    logits = torch.randn(T, E, generator=gen, dtype=torch.float64, requires_grad=True)
    top = torch.topk(logits, K, dim=1)
    scores = torch.full_like(logits, float("-inf")).scatter(1, top.indices, top.values).sigmoid()
    routed_in = x.repeat(E, 1) * scores.t().reshape(-1, 1)  # [E*T, H]

    engine = ExpertEngine(
        DenseExperts(theirs.gate_up_proj.detach().transpose(1, 2), theirs.down_proj.detach().transpose(1, 2))
    )
    ours = PrescaledDenseExperts(engine)
    want, got = theirs(routed_in), ours(routed_in)
    assert rel_err(got, want) < 1e-12
    for a, b in zip(_grads(got, logits), _grads(want, logits)):
        assert rel_err(a, b) < 1e-12


def _longcat() -> tuple[torch.nn.Module, ExpertEngine]:
    """transformers' LongCat-Flash experts module (E routed, 3 zero-computation experts) and an engine of its
    weights."""
    from transformers import LongcatFlashConfig
    from transformers.models.longcat_flash.modeling_longcat_flash import LongcatFlashExperts

    config = LongcatFlashConfig(
        hidden_size=H, expert_ffn_hidden_size=I, n_routed_experts=E, zero_expert_num=3, hidden_act="silu"
    )
    theirs = LongcatFlashExperts(config).double()
    _randomize(theirs)
    gate_up = theirs.gate_up_proj.detach()[:E]  # rows E.. belong to the identity experts and are never used
    return theirs, ExpertEngine(DenseExperts(gate_up, theirs.down_proj.detach()))


@pytest.mark.parametrize("identity_only", [False, True])
def test_longcat_identity_experts_call(identity_only):
    # identity_only: every slot a zero-computation expert; the engine is then called with no row (a sharded
    # module must still join its layer's exchange) and the result is still transformers' own
    theirs, engine = _longcat()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64, requires_grad=True)
    first = E if identity_only else 0
    ids = torch.stack([torch.randperm(E + 3 - first, generator=gen)[:K] + first for _ in range(T)])
    ids[0] = torch.tensor([E, E + 1])  # a token with identity experts only
    w = torch.rand(T, K, generator=gen, dtype=torch.float64, requires_grad=True)
    assert (ids >= E).any() and (ids < E).any() != identity_only

    want, got = theirs(x, ids, w), IdentityExperts(engine)(x, ids, w)
    assert rel_err(got, want) < 1e-12
    for a, b in zip(_grads(got, x, w), _grads(want, x, w)):
        assert rel_err(a, b) < 1e-12


def test_llama4_no_routed_row():
    # routed_in all zero: the engine is called with no row (as above) and every row stays zero
    routed_in = torch.zeros(E * T, H, dtype=torch.float64, requires_grad=True)
    out = PrescaledDenseExperts(_longcat()[1])(routed_in)
    assert out.shape == (E * T, H) and not out.any()
