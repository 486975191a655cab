"""Architecture registry and experts-layout detection, on models built on the meta device (no weights)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from moetune.arch import (
    ARCHS,
    ArchSpec,
    ExpertsCall,
    LayoutFlags,
    Routing,
    find_experts,
    read_layout,
    resolve_arch,
    supported_model_types,
    supported_summary,
)
from moetune.arch.spec import register
from moetune.errors import ArchError, RegistryError
from moetune.loading.hf import empty_model
from moetune.testing.tiny import EXPERT_INTERMEDIATE, HIDDEN, NUM_EXPERTS, TINY_FAMILIES, tiny_config


def _meta(family: str, **overrides):
    return empty_model(tiny_config(family, **overrides), torch.float32, "meta")


def test_registered_families():
    assert supported_model_types() == sorted(
        ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe", "deepseek_v3", "deepseek_v2", "glm4_moe", "gpt_oss"]
        + ["qwen3_vl_moe", "qwen3_5_moe", "qwen3_5_moe_text", "llama4", "llama4_text", "deepseek_v4", "beam"]
        + ["glm5_next", "glm5_next_text", "hy_v4", "hy_v4_vl", "hy_v4_vl_text", "minimax_m3_vl"]
        + [
            "minimax_m3_vl_text",
            "longcat_flash",
            "step3p7",
            "inkling2",
            "inkling2_text",
            "inkling2_loop",
            "inkling2_loop_text",
            "muse_spark",
            "muse_spark_text",
            "dbrx",
        ]
    )
    assert resolve_arch("glm4_moe").name == "deepseek_v3"
    assert resolve_arch("gpt_oss").routing is Routing.TOPK_SOFTMAX
    assert resolve_arch("ernie4_5_moe").name == "generic"  # no family code: detected from the modules
    assert resolve_arch("llama4").call is ExpertsCall.PRESCALED_DENSE
    assert resolve_arch("muse_spark").call is ExpertsCall.TOPK_POST_NORM
    assert resolve_arch("dbrx").flat is not None and resolve_arch("dbrx").call is ExpertsCall.TOPK_BATCHED
    assert resolve_arch("doge").unsupported and "doge" not in supported_model_types()
    assert "generic" in ARCHS
    assert "unsupported_doge" not in supported_summary()  # refused families are not offered as supported


def test_a_model_type_is_claimed_once():
    with pytest.raises(RegistryError, match="claimed by both"):
        register(ArchSpec("qwen_again", ("qwen3_moe",), Routing.SOFTMAX_TOPK))


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_detects_every_family(family):
    model = _meta(family)
    sites = find_experts(model, resolve_arch(family), family)
    assert sites and all(p.device.type == "meta" for p in model.parameters())
    for site in sites:
        lay = site.layout
        assert (lay.num_experts, lay.hidden_size, lay.intermediate_size) == (
            NUM_EXPERTS,
            HIDDEN,
            EXPERT_INTERMEDIATE,
        )
        gpt_oss = family == "gpt_oss"
        assert (lay.transposed, lay.interleaved, lay.has_bias) == (gpt_oss,) * 3
        assert lay.activation == ("gpt_oss" if gpt_oss else "silu")
        if resolve_arch(family).router_attr:
            assert site.router == site.path.rpartition(".")[0] + "." + resolve_arch(family).router_attr


def test_dense_and_sparse_layers():
    # qwen2_moe tiny: decoder_sparse_step=2 and mlp_only_layers=[3] leave layer 1 as the only MoE layer
    assert [s.path for s in find_experts(_meta("qwen2_moe"), resolve_arch("qwen2_moe"), "qwen2_moe")] == [
        "model.layers.1.mlp.experts"
    ]
    # deepseek_v3 tiny: first_k_dense_replace=1
    paths = [s.path for s in find_experts(_meta("deepseek_v3"), resolve_arch("deepseek_v3"), "deepseek_v3")]
    assert paths == ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts"]


def test_gpt_oss_activation_parameters():
    model = _meta("gpt_oss", swiglu_limit=5.0)
    (site, *_) = find_experts(model, resolve_arch("gpt_oss"), "gpt_oss")
    assert dict(site.layout.activation_kwargs) == {"alpha": pytest.approx(1.702), "limit": 5.0}


@pytest.mark.parametrize(
    ("hidden_act", "engine_name"), [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_pytorch_tanh")]
)
def test_activation_read_from_act_fn(hidden_act, engine_name):
    model = _meta("qwen3_moe", hidden_act=hidden_act)
    (site, *_) = find_experts(model, resolve_arch("qwen3_moe"), "qwen3_moe")
    assert site.layout.activation == engine_name


def test_unsupported_activation():
    with pytest.raises(
        ArchError, match="'mixtral'(.|\n)*ReLUSquaredActivation is not one the engine computes"
    ):
        find_experts(_meta("mixtral", hidden_act="relu2"), resolve_arch("mixtral"), "mixtral")


def test_dense_model_has_no_experts():
    from transformers import LlamaConfig

    model = empty_model(
        LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2),
        torch.float32,
        "x",
    )
    with pytest.raises(
        ArchError, match=r"model_type 'llama' \(LlamaForCausalLM\) is not a supported MoE(.|\n)*gpt_oss"
    ):
        find_experts(model, resolve_arch("llama"), "llama")


def _experts_class(**flags):
    from transformers.integrations.moe import use_experts_implementation

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(4, 2 * 6, 10))
            self.down_proj = nn.Parameter(torch.empty(4, 10, 6))
            self.act_fn = nn.SiLU()

    return use_experts_implementation(Experts, **flags)


def _config():
    from transformers import PretrainedConfig

    return PretrainedConfig()


def test_generic_detection_from_flags():
    layout = read_layout(_experts_class()(_config()), resolve_arch("x"), "m.experts")
    assert (layout.num_experts, layout.hidden_size, layout.intermediate_size) == (4, 10, 6)
    assert not (layout.transposed or layout.interleaved or layout.has_bias)


def test_own_gate_activation_needs_a_spec():
    cls = _experts_class()
    cls._apply_gate = lambda self, gate_up: gate_up[..., :6] * gate_up[..., 6:]
    with pytest.raises(ArchError, match="computes its own gated activation"):
        read_layout(cls(_config()), resolve_arch("x"), "m.experts")


def test_post_expert_norm_and_unmarked_modules_are_refused():
    with pytest.raises(ArchError, match="normalises each expert's output"):
        read_layout(_experts_class(has_post_expert_norm=True)(_config()), resolve_arch("x"), "m.experts")

    class Unmarked(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(4, 12, 10))
            self.down_proj = nn.Parameter(torch.empty(4, 10, 6))

    with pytest.raises(ArchError, match="not the layout flags"):
        read_layout(Unmarked(), resolve_arch("x"), "m.experts")


def test_inconsistent_shapes():
    module = _experts_class()(_config())
    module.down_proj = nn.Parameter(torch.empty(4, 6, 10))
    with pytest.raises(ArchError, match=r"down_proj is \(4, 6, 10\), expected \(4, 10, 6\)"):
        read_layout(module, resolve_arch("x"), "m.experts")


def _own_gate_class(limit: float):
    cls = _experts_class()

    def apply_gate(self, gate_up):  # DeepSeek-V4's
        gate, up = gate_up.chunk(2, dim=-1)
        return self.act_fn(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)

    cls._apply_gate = apply_gate
    return cls


def test_own_gate_activation_from_the_spec_is_checked_against_apply_gate():
    right = ArchSpec(
        "clamped", (), Routing.MODEL_DEFINED, activation=lambda m: ("clamped_swiglu", {"limit": 2.0})
    )
    layout = read_layout(_own_gate_class(2.0)(_config()), right, "m.experts")
    assert (layout.activation, dict(layout.activation_kwargs)) == ("clamped_swiglu", {"limit": 2.0})
    wrong = ArchSpec(
        "clamped", (), Routing.MODEL_DEFINED, activation=lambda m: ("clamped_swiglu", {"limit": 3.0})
    )
    with pytest.raises(ArchError, match="on a random probe they differ"):
        read_layout(_own_gate_class(2.0)(_config()), wrong, "m.experts")


@pytest.mark.parametrize(
    ("family", "activation"),
    [("deepseek_v4", "clamped_swiglu"), ("glm5_next", "clamped_swiglu"), ("hy_v4_vl", "clamped_swiglu")]
    + [("minimax_m3_vl", "clamped_swiglu"), ("step3p7", "swiglu_clamped_output")]
    + [("inkling2", "softcapped_swiglu"), ("beam", "silu"), ("lfm2_moe", "silu"), ("llama4", "silu")],
)
def test_families_with_their_own_gate_or_layout(family, activation):
    from moetune.testing.families import survey_config

    model = empty_model(survey_config(family), torch.float32, "meta")
    sites = find_experts(model, resolve_arch(family), family)
    assert sites and {s.layout.activation for s in sites} == {activation}
    assert all(s.layout.transposed == (family == "llama4") for s in sites)  # Llama 4: flags from its spec


def test_layout_flags_from_the_spec():
    class Unmarked(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_up_proj = nn.Parameter(torch.empty(4, 10, 12))  # [E, H, 2I]
            self.down_proj = nn.Parameter(torch.empty(4, 6, 10))
            self.act_fn = nn.SiLU()

    spec = ArchSpec("x", (), Routing.MODEL_DEFINED, layout=LayoutFlags(is_transposed=True))
    layout = read_layout(Unmarked(), spec, "m.experts")
    assert (layout.num_experts, layout.hidden_size, layout.intermediate_size, layout.transposed) == (
        4,
        10,
        6,
        True,
    )


def test_non_gated_experts_run_as_tied_gated_ones():
    from moetune.testing.families import survey_config

    model = empty_model(survey_config("nemotron_h"), torch.float32, "meta")
    (site,) = find_experts(model, resolve_arch("nemotron_h"), "nemotron_h")
    lay = site.layout
    assert not lay.gated and lay.activation == "relu"  # relu2(u) = relu(u) * u
    assert lay.tensor_names == ("up_proj", "down_proj") and lay.runtime_shape("up_proj") == (8, 24, 64)


def _non_gated_class(act: nn.Module, **flags):
    from transformers.integrations.moe import use_experts_implementation

    class Experts(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.up_proj = nn.Parameter(torch.empty(4, 6, 10))
            self.down_proj = nn.Parameter(torch.empty(4, 10, 6))
            self.act_fn = act

    return use_experts_implementation(Experts, has_gate=False, **flags)


def test_non_gated_experts_other_than_f_times_u_are_refused():
    from transformers.activations import ReLUSquaredActivation

    layout = read_layout(_non_gated_class(ReLUSquaredActivation())(_config()), resolve_arch("x"), "m.experts")
    assert (layout.num_experts, layout.hidden_size, layout.intermediate_size, layout.gated) == (
        4,
        10,
        6,
        False,
    )
    with pytest.raises(ArchError, match=r"non-gated experts(.|\n)*act_fn SiLU(.|\n)*ReLUSquaredActivation"):
        read_layout(_non_gated_class(nn.SiLU())(_config()), resolve_arch("x"), "m.experts")
    with pytest.raises(ArchError, match="non-gated experts with biases"):
        read_layout(
            _non_gated_class(ReLUSquaredActivation(), has_bias=True)(_config()),
            resolve_arch("x"),
            "m.experts",
        )


def test_post_expert_norm_needs_the_call_and_the_module():
    spec = resolve_arch("muse_spark")
    with pytest.raises(ArchError, match="keeps its submodule"):
        read_layout(_experts_class(has_post_expert_norm=True)(_config()), spec, "m.experts")
    module = _experts_class(has_post_expert_norm=True)(_config())
    module.post_expert_norm = nn.LayerNorm(10)
    assert read_layout(module, spec, "m.experts").intermediate_size == 6


def test_unsupported_families_are_refused_by_name():
    from moetune.testing.families import survey_config

    model = empty_model(survey_config("doge"), torch.float32, "meta")
    with pytest.raises(ArchError, match=r"model_type 'doge' \(DogeForCausalLM\) is not supported: Doge's"):
        find_experts(model, resolve_arch("doge"), "doge")


def test_own_gate_that_needs_weights_is_refused_not_crashed():
    cls = _experts_class()
    cls._apply_gate = lambda self, gate_up: gate_up[..., :6] * self.gate_up_proj[0, 0, 0]  # reads a weight
    spec = ArchSpec("x", (), Routing.MODEL_DEFINED, activation=lambda m: ("silu", {}))
    with torch.device("meta"):
        module = cls(_config())
    with pytest.raises(ArchError, match="could not be checked"):
        read_layout(module, spec, "m.experts")


def test_flat_experts_from_the_spec():
    from moetune.testing.families import survey_config

    model = empty_model(survey_config("dbrx"), torch.float32, "meta")
    sites = find_experts(model, resolve_arch("dbrx"), "dbrx")
    assert [s.path for s in sites] == ["transformer.blocks.0.ffn.experts", "transformer.blocks.1.ffn.experts"]
    lay = sites[0].layout
    assert (lay.num_experts, lay.hidden_size, lay.intermediate_size, lay.activation) == (8, 64, 24, "silu")
    assert lay.tensor_names == ("mlp.w1", "mlp.v1", "mlp.w2") and lay.runtime_shape("mlp.w2") == (192, 64)
    assert sites[0].router == "transformer.blocks.0.ffn.router"
    experts = model.get_submodule("transformer.blocks.0.ffn.experts")
    experts.mlp.v1 = nn.Parameter(torch.empty(192, 32, device="meta"))
    with pytest.raises(ArchError, match=r"\.mlp\.v1 is \(192, 32\), expected \(192, 64\)"):
        read_layout(experts, resolve_arch("dbrx"), "x")
