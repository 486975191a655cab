"""Checks shared by the ``test_load_<family>.py`` files: moetune against transformers on one checkpoint.

Each family file defines a module-scoped ``pair`` fixture with ``family_fixture(...)`` and imports the
``test_*`` functions below, so every family runs the same battery without copies of it. The batches come from
the ``make_inputs`` fixture: token ids (``conftest``), or, for vision-language models, also image+text
batches (``test_load_vision``).

Tiny random models of the real config classes (``moetune.testing.tiny``), saved with ``save_pretrained``.
float32 (the engine computes fp32 weights in fp32, so only summation order differs):

    logits                       max |diff| <= 1e-5
    loss, router aux loss        |diff| <= 1e-6
    grads of every non-expert parameter, routers included   max |diff| <= 1e-5 * max(1, max |grad|)
                                 (relative where a tensor's gradients exceed 1: Qwen3.5's DeltaNet conv1d
                                 weights get gradients ~14, where fp32 summation order alone moves 1.4e-5)
    greedy generation (20 new tokens)                        identical

bfloat16, against transformers' float32 logits, error = the median over tokens of the token's max |logit
error|: moetune's <= 1.5 * transformers' own bf16 error + 0.01, and <= 0.1 (logits are O(3)). The median,
not the max: a bf16 rounding can flip one token's top-k choice in either model, which moves that token's
logits by O(0.5) whoever is more accurate (measured: the medians agree within 30% in every family).

Models load with ``num_threads=1`` (torch's one pool, for the engines and the transformers side): on a
shared 2-core machine two OpenMP threads per tiny GEMM measured 6-60x slower than one.
"""

from __future__ import annotations

import pytest
import torch

import moetune
from moetune.layer import CpuExperts
from moetune.testing.tiny import TINY_FAMILIES, auto_class, save_tiny_model

FP32_LOGITS_TOL = 1e-5
FP32_LOSS_TOL = 1e-6
FP32_GRAD_TOL = 1e-5
BF16_RATIO, BF16_EPS, BF16_MAX = 1.5, 0.01, 0.1


def _hf(path, dtype):
    """transformers' own model of ``path`` (``AutoModelForCausalLM`` or ``AutoModelForImageTextToText``)."""
    from transformers import AutoConfig

    return auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=dtype).eval()


def family_fixture(*families: str):
    """A module-scoped fixture ``pair``: (family, path, transformers fp32 model, moetune fp32 model)."""
    unknown = set(families) - set(TINY_FAMILIES)
    assert not unknown, unknown

    @pytest.fixture(scope="module", params=families)
    def pair(request, tmp_path_factory):
        family = request.param
        path = save_tiny_model(family, tmp_path_factory.mktemp(family), tokenizer=False)
        model = moetune.load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1)
        return family, path, _hf(path, torch.float32), model

    return pair


def _token_error(logits: torch.Tensor, exact: torch.Tensor) -> float:
    """Median over tokens of max over the vocabulary of |logits - exact| (logits [B, S, V])."""
    return (logits.float() - exact).abs().amax(-1).median().item()


def _expert_paths(model) -> set[str]:
    return {n for n, m in model.named_modules() if n.endswith("experts") and hasattr(m, "gate_up_proj")}


def test_structure(pair):
    _, _, ref, model = pair
    assert type(model) is type(ref)
    swapped = {n for n, m in model.named_modules() if isinstance(m, CpuExperts)}
    assert swapped == _expert_paths(ref) and swapped
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    assert not [
        n for n in names if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
    ]  # never in torch
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])


def test_logits_loss_and_aux_loss(pair, make_inputs):
    _, _, ref, model = pair
    batch = make_inputs(0)
    with torch.no_grad():
        a = ref(**batch, output_router_logits=True)
        b = model(**batch, output_router_logits=True)
    assert (a.logits - b.logits).abs().max().item() <= FP32_LOGITS_TOL
    assert abs(a.loss.item() - b.loss.item()) <= FP32_LOSS_TOL
    if getattr(a, "aux_loss", None) is not None:
        assert abs(a.aux_loss.item() - b.aux_loss.item()) <= FP32_LOSS_TOL


def test_gradients(pair, make_inputs):
    _, _, ref, model = pair
    batch = make_inputs(1)
    for m in (ref, model):
        m.train()
        m.zero_grad()
        m(**batch, output_router_logits=True).loss.backward()
        m.eval()
    experts = _expert_paths(ref)
    ref_params = {n: p for n, p in ref.named_parameters() if not any(n.startswith(e + ".") for e in experts)}
    got = dict(model.named_parameters())
    assert set(got) == set(ref_params)
    routers = [n for n in got if ".gate.weight" in n or ".router.weight" in n]
    assert routers, "no router weights compared"
    for name, p in ref_params.items():
        if p.grad is None:  # e.g. ERNIE's score-correction bias (no_grad), a vision tower on text input
            assert got[name].grad is None, name
            continue
        assert got[name].grad is not None, name
        scale = max(1.0, p.grad.abs().max().item())
        assert (p.grad - got[name].grad).abs().max().item() <= FP32_GRAD_TOL * scale, name
    assert all(got[n].grad.abs().max() > 0 for n in routers)


def test_greedy_generation(pair, make_inputs):
    _, _, ref, model = pair
    batch = make_inputs(2, batch=1, seq=6)
    batch.pop("labels")
    kwargs = {"max_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ref.generate(**batch, **kwargs), model.generate(**batch, **kwargs))


def test_bfloat16_error_bound(pair, make_inputs):
    _, path, ref, _ = pair
    batch = make_inputs(3)
    batch.pop("labels")
    bf16 = moetune.load_model(path, device="cpu", dtype="bfloat16", progress=False, num_threads=1)
    with torch.no_grad():
        exact = ref(**batch).logits
        hf_err = _token_error(_hf(path, torch.bfloat16)(**batch).logits, exact)
        mt_err = _token_error(bf16(**batch).logits, exact)
    assert bf16.dtype == torch.bfloat16
    assert mt_err <= BF16_RATIO * hf_err + BF16_EPS and mt_err <= BF16_MAX, (mt_err, hf_err)
