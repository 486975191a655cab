"""Expert LoRA layout conversion against stock PEFT ``target_parameters``: keys, shapes, round trips, delta
weights, and the engine's LoRA initialisation against PEFT's."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from torch import nn
from transformers import GptOssConfig, Llama4TextConfig, Qwen3MoeConfig
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from moetune.adapters import (
    ExpertParamNames,
    expert_lora_from_peft_state,
    expert_lora_to_peft_state,
    lora_from_peft,
    lora_to_peft,
)
from moetune.engine import DenseExperts, ExpertEngine, ExpertLoRA
from moetune.errors import AdapterError
from moetune.layer import CpuExperts

E, H, I, R, ALPHA, K = 8, 24, 16, 4, 8.0, 3  # hidden != 2I, so swapped in/out roles would show
PREFIX = "base_model.model.experts"  # the Holder's experts module, as PEFT's saved keys name it


class Holder(nn.Module):
    """The smallest model PEFT can wrap around a transformers experts module."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.experts(x, ids, w)


class DownFirstExperts(nn.Module):
    """Registers down_proj before gate_up_proj, to show that registration order decides PEFT's key names."""

    def __init__(self) -> None:
        super().__init__()
        self.down_proj = nn.Parameter(torch.zeros(E, H, I))
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, H))


def make_experts(kind: str, dtype: torch.dtype = torch.float32, impl: str = "eager") -> nn.Module:
    """A transformers experts module (``"qwen"``, the transposed ``"gpt_oss"`` or the transposed ``"llama4"``,
    which does not declare it) with random base weights."""
    if kind == "qwen":
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
        experts: nn.Module = Qwen3MoeExperts(cfg)
    elif kind == "gpt_oss":
        cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
        experts = GptOssExperts(cfg)
    elif kind == "llama4":
        cfg = Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
        experts = Llama4TextExperts(cfg)
    else:
        assert kind == "down_first", kind
        return DownFirstExperts().to(dtype)
    cfg._experts_implementation = impl
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return experts.to(dtype)


def peft_model(
    experts: nn.Module, *, use_rslora: bool = False, targets=("gate_up_proj", "down_proj")
) -> nn.Module:
    """Stock PEFT LoRA on the experts' fused parameters (default init: A kaiming-uniform, B zero)."""
    config = LoraConfig(target_parameters=list(targets), r=R, lora_alpha=ALPHA, use_rslora=use_rslora)
    return get_peft_model(Holder(experts), config)


def randomize_lora(pm: nn.Module, seed: int = 3) -> None:
    """Every lora_A / lora_B weight random and nonzero, so no LoRA path can hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def random_engine_lora(dtype: torch.dtype = torch.float64) -> ExpertLoRA:
    gen = torch.Generator().manual_seed(5)
    shapes = {"gate_up_A": (E, R, H), "gate_up_B": (E, 2 * I, R), "down_A": (E, R, I), "down_B": (E, H, R)}
    tensors = {n: torch.randn(s, generator=gen, dtype=dtype) for n, s in shapes.items()}
    return ExpertLoRA(**tensors, scaling=ALPHA / R)


def names_of(experts: nn.Module) -> ExpertParamNames:
    """The module's names, told whether its experts compute ``x @ W`` (gpt-oss and Llama 4; moetune's arch specs
    know it: ``ExpertsLayout.transposed``)."""
    return ExpertParamNames.from_module(
        experts, transposed=isinstance(experts, (Llama4TextExperts, GptOssExperts))
    )


def engine_lora_of(pm: nn.Module, experts: nn.Module, scaling: float = ALPHA / R) -> ExpertLoRA:
    names = names_of(experts)
    return expert_lora_from_peft_state(
        get_peft_model_state_dict(pm), PREFIX, num_experts=E, scaling=scaling, names=names
    )


# ---- key names and shapes


@pytest.mark.parametrize("kind", ["qwen", "gpt_oss", "llama4", "down_first"])
def test_peft_to_engine_to_peft_is_identity_with_peft_keys(kind):
    experts = make_experts(kind)
    names = names_of(experts)
    pm = peft_model(experts)
    randomize_lora(pm)
    state = get_peft_model_state_dict(pm)
    back = expert_lora_to_peft_state(engine_lora_of(pm, experts), PREFIX, names)
    assert sorted(back) == sorted(state)
    for key, t in state.items():
        assert back[key].dtype == t.dtype and torch.equal(back[key], t), key


def test_interleaving_is_read_off_the_module_and_round_trips():
    assert not names_of(make_experts("qwen")).interleaved
    assert names_of(make_experts("gpt_oss")).interleaved
    lora = random_engine_lora()
    names = ExpertParamNames(interleaved=True)
    state = expert_lora_to_peft_state(lora, PREFIX, names)
    gate_up = f"{PREFIX}.base_layer"
    b = lora_from_peft(state[f"{gate_up}.lora_A.weight"], state[f"{gate_up}.lora_B.weight"], E)[1]
    assert torch.equal(b[:, 0::2], lora.gate_up_B[:, :I]) and torch.equal(b[:, 1::2], lora.gate_up_B[:, I:])
    back = expert_lora_from_peft_state(state, PREFIX, num_experts=E, scaling=lora.scaling, names=names)
    assert all(torch.equal(x, y) for x, y in zip(back.tensors(), lora.tensors()))


def test_key_names_follow_registration_order():
    prefixes = {
        "qwen": {"gate_up": f"{PREFIX}.base_layer", "down": PREFIX},
        "gpt_oss": {"gate_up": f"{PREFIX}.base_layer", "down": PREFIX},
        "down_first": {"gate_up": PREFIX, "down": f"{PREFIX}.base_layer"},
    }
    for kind, want in prefixes.items():
        assert names_of(make_experts(kind)).key_prefixes(PREFIX) == want, kind


def test_target_parameters_order_does_not_change_keys():
    targets = ExpertParamNames().target_parameters("experts")  # ["experts.gate_up_proj", "experts.down_proj"]
    forward = get_peft_model_state_dict(peft_model(make_experts("qwen"), targets=targets))
    reverse = get_peft_model_state_dict(
        peft_model(make_experts("qwen"), targets=("down_proj", "gate_up_proj"))
    )
    assert list(forward) == list(reverse)
    shapes = {k: tuple(v.shape) for k, v in forward.items()}
    assert shapes == {
        f"{PREFIX}.base_layer.lora_A.weight": (E * R, H),
        f"{PREFIX}.base_layer.lora_B.weight": (2 * I, R * E),
        f"{PREFIX}.lora_A.weight": (E * R, I),
        f"{PREFIX}.lora_B.weight": (H, R * E),
    }
    single = get_peft_model_state_dict(peft_model(make_experts("qwen"), targets=("down_proj",)))
    assert list(single) == [f"{PREFIX}.lora_A.weight", f"{PREFIX}.lora_B.weight"]


# ---- round trips and delta weights


def test_engine_to_peft_to_engine_is_identity():
    lora = random_engine_lora()
    back = expert_lora_from_peft_state(
        expert_lora_to_peft_state(lora, PREFIX), PREFIX, num_experts=E, scaling=lora.scaling
    )
    for a, b in zip(lora.tensors(), back.tensors()):
        assert torch.equal(a, b)
    assert back.scaling == lora.scaling


def test_peft_layout_is_expert_major_A_rank_major_B():
    a = torch.arange(E * R * H, dtype=torch.float64).view(E, R, H)
    b = torch.arange(E * 2 * I * R, dtype=torch.float64).view(E, 2 * I, R)
    lora_a, lora_b = lora_to_peft(a, b)
    e, j, o = 5, 2, 7
    assert torch.equal(lora_a[e * R + j], a[e, j])
    assert lora_b[o, j * E + e] == b[e, o, j]
    a2, b2 = lora_from_peft(lora_a, lora_b, E)
    assert torch.equal(a2, a) and torch.equal(b2, b)


def test_swapped_layout_puts_B_transposed_in_lora_A():
    """PEFT's roles swapped (Llama 4): ``lora_A`` holds the engine's B transposed, expert-major, and ``lora_B`` the
    engine's A transposed, rank-major; the engine view and the round trip undo it exactly."""
    from moetune.adapters.peft_layout import engine_view

    a = torch.arange(E * R * H, dtype=torch.float64).view(E, R, H)
    b = -torch.arange(E * 2 * I * R, dtype=torch.float64).view(E, 2 * I, R)
    lora_a, lora_b = lora_to_peft(a, b, swapped=True)
    assert lora_a.shape == (E * R, 2 * I) and lora_b.shape == (H, R * E)
    e, j, o, i = 5, 2, 7, 11
    assert lora_a[e * R + j, o] == b[e, o, j] and lora_b[i, j * E + e] == a[e, j, i]
    for a2, b2 in (
        lora_from_peft(lora_a, lora_b, E, swapped=True),
        engine_view(lora_a, lora_b, E, swapped=True),
    ):
        assert torch.equal(a2, a) and torch.equal(b2, b)


@pytest.mark.parametrize("kind", ["qwen", "gpt_oss", "llama4"])
@pytest.mark.parametrize("use_rslora", [False, True])
def test_peft_delta_weight_is_scaled_B_at_A(kind, use_rslora):
    experts = make_experts(kind, torch.float64)
    names = names_of(experts)
    assert names.swapped == (kind == "llama4")
    pm = peft_model(experts, use_rslora=use_rslora)
    lora = random_engine_lora()
    result = set_peft_model_state_dict(pm, expert_lora_to_peft_state(lora, PREFIX, names))
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    outer = pm.base_model.model.experts
    wrappers = {outer.parameter_name: outer, outer.base_layer.parameter_name: outer.base_layer}
    scaling = ALPHA / math.sqrt(R) if use_rslora else ALPHA / R
    for proj, param in (("gate_up", names.gate_up), ("down", names.down)):
        a, b = getattr(lora, f"{proj}_A"), getattr(lora, f"{proj}_B")
        want = torch.einsum("eor,eri->eoi", b, a) * scaling  # [E, out, in], engine rows (gate rows first)
        if proj == "gate_up" and kind == "gpt_oss":  # gpt-oss interleaves gate (even) and up (odd) outputs
            gate, up = want.chunk(2, dim=1)
            want = torch.stack((gate, up), dim=2).flatten(1, 2)
        if kind in ("gpt_oss", "llama4"):  # x @ W: the parameter and its delta are [E, in, out]
            want = want.transpose(1, 2)
        got = wrappers[param].get_delta_weight("default")
        assert got.shape == getattr(experts, param).shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# ---- errors


def test_missing_key_names_the_key():
    state = expert_lora_to_peft_state(random_engine_lora(), PREFIX)
    del state[f"{PREFIX}.lora_B.weight"]
    with pytest.raises(AdapterError, match=r"experts\.lora_B\.weight"):
        expert_lora_from_peft_state(state, PREFIX, num_experts=E, scaling=2.0)


def test_wrong_expert_count_is_reported():
    state = expert_lora_to_peft_state(random_engine_lora(), PREFIX)
    with pytest.raises(AdapterError, match="E=3 experts"):
        expert_lora_from_peft_state(state, PREFIX, num_experts=3, scaling=2.0)


def test_inconsistent_projections_are_reported():
    state = expert_lora_to_peft_state(random_engine_lora(), PREFIX)
    state[f"{PREFIX}.lora_A.weight"] = torch.zeros(E * R, I + 1, dtype=torch.float64)
    state[f"{PREFIX}.lora_B.weight"] = torch.zeros(H, R * E, dtype=torch.float64)
    with pytest.raises(AdapterError, match="inconsistent"):
        expert_lora_from_peft_state(state, PREFIX, num_experts=E, scaling=2.0)


def test_cpu_experts_without_lora_and_unknown_param_names_raise():
    engine = ExpertEngine(DenseExperts(torch.zeros(E, 2 * I, H), torch.zeros(E, H, I)))
    with pytest.raises(AdapterError, match="no expert LoRA"):
        expert_lora_to_peft_state(CpuExperts(engine), PREFIX)
    with pytest.raises(AdapterError, match="w13"):
        ExpertParamNames.from_module(make_experts("qwen"), gate_up="w13", transposed=False)


def test_cpu_experts_source_saves_its_parameters():
    lora = random_engine_lora(torch.float32)
    mod = CpuExperts(ExpertEngine(DenseExperts(torch.zeros(E, 2 * I, H), torch.zeros(E, H, I)), lora=lora))
    with torch.no_grad():
        mod.lora_down_B.add_(1.0)  # the saved tensors are the module's live parameters
    state = expert_lora_to_peft_state(mod, PREFIX)
    assert torch.equal(
        lora_from_peft(state[f"{PREFIX}.lora_A.weight"], state[f"{PREFIX}.lora_B.weight"], E)[1],
        mod.lora_down_B,
    )


# ---- initialisation


def test_engine_init_draws_exactly_what_peft_draws():
    """``ExpertLoRA.init`` consumes the RNG as PEFT's ``reset_lora_parameters`` does: gate_up A, then down A,
    each ``kaiming_uniform_(a=sqrt(5))`` on ``[E * r, in]``; B zero. Same seed, bit-identical tensors."""
    pm = peft_model(make_experts("qwen"))
    outer = pm.base_model.model.experts
    randomize_lora(pm)  # so the reset below has to overwrite everything
    torch.manual_seed(1234)
    outer.base_layer.reset_lora_parameters("default", True)  # gate_up, registered first
    outer.reset_lora_parameters("default", True)  # down
    peft_state = get_peft_model_state_dict(pm)
    torch.manual_seed(1234)
    ours = expert_lora_to_peft_state(ExpertLoRA.init(E, H, I, R, ALPHA), PREFIX)
    for key, t in peft_state.items():
        assert torch.equal(ours[key], t), key
    for key, fan_in in ((f"{PREFIX}.base_layer.lora_A.weight", H), (f"{PREFIX}.lora_A.weight", I)):
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform_(a=sqrt(5)): gain sqrt(1/3) * sqrt(3 / fan_in)
        assert 0.9 * bound < ours[key].abs().max() <= bound
    assert not ours[f"{PREFIX}.lora_B.weight"].any() and not ours[f"{PREFIX}.base_layer.lora_B.weight"].any()
