"""Every MoE family transformers 5.24 ships, and a tiny config of each for the load survey.

``MOE_FAMILIES`` is pinned (see its docstring for how it was found); ``survey_config(model_type)`` builds a small
config of the family's real config class: the class's defaults shrunk field by field (``_TEXT_SIZES`` for the
language model, ``_TOWER_SIZES`` for vision/audio towers, per-layer lists cut to the distinct layer kinds), then
the family's own fields from ``_FAMILY_FIELDS`` where the generic shrinking is not enough.
"""

from __future__ import annotations

from typing import Any

MOE_FAMILIES: tuple[str, ...] = (
    "afmoe",
    "aria",
    "axk1",
    "axk2",
    "bailing_hybrid",
    "beam",
    "cohere2_moe",
    "dbrx",
    "deepseek_ocr2",
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v4",
    "diffusion_gemma",
    "doge",
    "dots1",
    "dots3_note",
    "ernie4_5_moe",
    "ernie4_5_vl_moe",
    "exaone_moe",
    "flex_olmo",
    "flint",
    "gemma4",
    "glm4_moe",
    "glm4_moe_lite",
    "glm4v_moe",
    "glm5_next",
    "glm_moe_dsa",
    "gpt_oss",
    "granitemoe",
    "granitemoe_swa",
    "granitemoehybrid",
    "granitemoeshared",
    "hunyuan_v1_moe",
    "hy_v3",
    "hy_v4",
    "hy_v4_vl",
    "inkling2",
    "inkling2_loop",
    "inkling_mm_model",
    "jamba",
    "jetmoe",
    "kimi_k25",
    "kimi_linear",
    "kolibri1",
    "laguna",
    "lara_mini",
    "lfm2_moe",
    "llama4",
    "longcat_flash",
    "mellum",
    "mimo_v2_flash",
    "minimax",
    "minimax_m2",
    "minimax_m3_vl",
    "mistral4",
    "mistral_large4",
    "mixtral",
    "muse_spark",
    "nemo_speechlm",
    "nemotron_h",
    "nemotron_h_omni",
    "nllb-moe",
    "olmoe",
    "openai_privacy_filter",
    "phimoe",
    "qwen2_moe",
    "qwen3_5_moe",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_omni_moe",
    "qwen3_vl_moe",
    "qwen4_exp",
    "solar_open",
    "step3p7",
    "switch_transformers",
    "unlimited_ocr",
    "zaya",
)
"""The model types of every MoE family in transformers 5.24, found as follows (``tests/integration/test_families``
re-runs the first step against the installed transformers, so a family added later fails that test until it is
listed here):

1. every ``transformers/models/<dir>/modeling_<dir>.py`` that imports ``use_experts_implementation`` (67 dirs),
   taking the model type of the dir's top-level config (``inkling`` -> ``inkling_mm_model``);
2. model files that route tokens to experts without that decorator, found by grepping the modeling files for
   ``num_experts`` / ``n_routed_experts`` / ``num_local_experts`` / ``moe_num_experts`` and reading the hits:
   llama4, longcat_flash, step3p7, dbrx, jetmoe, doge, and the encoder-decoders nllb-moe and switch_transformers
   (vitpose's MoE backbone is a pose estimator, not a language model, and is left out);
3. composite models whose default language model is one of these, found by building every config class in
   ``CONFIG_MAPPING`` and comparing its sub-configs' model types: kimi_k25 (DeepSeek-V3 text), nemotron_h_omni
   and nemo_speechlm (NemotronH text); Qwen3-Omni's thinker is loaded as part of qwen3_omni_moe.
"""

# The language model's sizes: H = 64, I = 24 (H != 2I, H != I), 8 experts, top-2, 4 heads of 16.
_TEXT_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "d_model": 64,
    "intermediate_size": 24,
    "moe_intermediate_size": 24,
    "expert_ffn_hidden_size": 24,
    "ffn_hidden_size": 24,
    "shared_expert_intermediate_size": 40,
    "moe_shared_expert_intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_layers": 2,
    "n_layers": 2,
    "num_attention_heads": 4,
    "n_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "num_experts": 8,
    "num_local_experts": 8,
    "n_routed_experts": 8,
    "moe_num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_k": 2,
    "moe_top_k": 2,
    "moe_topk": 2,
    "n_group": 4,
    "topk_group": 2,
    "num_expert_group": 4,
    "vocab_size": 128,
    "unpadded_vocab_size": 120,  # Inkling2 pads its unembedding to vocab_size
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
    "max_position_embeddings": 256,
    "kv_lora_rank": 16,
    "q_lora_rank": 24,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "first_k_dense_replace": 1,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 4,
    "swa_head_dim": 16,
    "projector_hidden_size": 32,
    # linear attention, sparse-attention indexers
    "linear_num_heads": 2,
    "linear_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    "index_kpool": 4,
    # Mamba mixers
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_chunk_size": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Vision and audio towers: as small as they go (text-only batches never run them, but they are saved and loaded).
_TOWER_SIZES: dict[str, int] = {
    "hidden_size": 32,
    "d_model": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_layers": 1,
    "n_layers": 2,
    "depth": 1,
    "patch_size": 4,
    "encoder_layers": 1,
    "decoder_layers": 1,
    "encoder_attention_heads": 2,
    "decoder_attention_heads": 2,
    "encoder_ffn_dim": 48,
    "decoder_ffn_dim": 48,
    "decoder_dim": 32,
    "codebook_size": 64,
    "downsample_hidden_size": 32,
    "num_attention_heads": 2,
    "num_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 16,
    # widths a tower hands to the language model must be its hidden size
    "text_hidden_size": 64,
    "out_hidden_size": 64,
    "adapter_out_dim": 64,
    "adapter_in_dim": 32,
    "adapter_input_size": 32,
    # MoE inside a tower (dots.3's vision experts)
    "num_local_experts": 4,
    "num_experts": 4,
    "moe_intermediate_size": 16,
}
# Sub-configs named like this are towers (the rest, text_config, ffn_config, thinker_config ..., hold the language
# model or its parts).
_TOWER_WORDS = ("vision", "visual", "audio", "speech", "sam", "encoder", "code2wav")
# Fields some classes default to None (set from the checkpoint) that an MoE model needs.
_NEEDED = (
    "head_dim",
    "num_experts",
    "n_routed_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
)
_MAX_LAYERS = 4  # per-layer lists keep their distinct kinds, one layer each, at most this many layers

# Fields the generic shrinking cannot guess, per model type; nested dicts merge into sub-configs.
_MROPE = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}  # 4 frequencies: t, h, w
# Clamps and softcaps of the own-gate families, set low enough that they act on the tiny models' activations
# (pre-activations ~ N(0, 0.8^2) with H = 64 and weights ~ N(0, 0.1^2)): their engine activations are exercised
_LIMIT = 0.4
_FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    "dbrx": {
        # transformers 5.24's DBRX attention reads rope_theta from attn_config and needs a clip_qkv
        "attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 24, "moe_num_experts": 8, "moe_top_k": 2},
    },
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]}},
    "deepseek_v4": {"swiglu_limit": _LIMIT, "hc_sinkhorn_iters": 3, "o_lora_rank": 16, "o_groups": 2},
    "dots1": {"n_shared_experts": 1},
    "dots3_note": {  # the sliding-window layers' attention sizes come from swa_* fields
        "text_config": {
            "swa_num_attention_heads": 4,
            "swa_num_key_value_heads": 4,
            "swa_q_lora_rank": 24,
            "swa_kv_lora_rank": 16,
            "swa_head_dim": 24,
            "swa_qk_nope_head_dim": 16,
            "swa_v_head_dim": 16,
            "sliding_window": 8,
        }
    },
    "ernie4_5_vl_moe": {
        "text_config": {
            "moe_intermediate_size": [24, 16],  # text experts, vision experts
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
        }
    },
    "flint": {"mlp_only_layers": [0]},
    "gemma4": {"text_config": {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2}},
    "glm4v_moe": {"text_config": {"rope_parameters": {**_MROPE, "partial_rotary_factor": 0.5}}},
    "glm5_next": {"text_config": {"swiglu_limit": _LIMIT, "hc_sinkhorn_iters": 3}},
    "gpt_oss": {"swiglu_limit": _LIMIT},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"]},
    "hunyuan_v1_moe": {"num_experts": 8, "moe_topk": 2},
    "hy_v4": {"swiglu_limit": _LIMIT},
    "hy_v4_vl": {"text_config": {"rope_parameters": _MROPE, "swiglu_limit": _LIMIT}},
    "inkling2": {"text_config": {"mlp_gate_softcap": 0.5, "mlp_up_softcap": 0.5}},
    "inkling2_loop": {"text_config": {"mlp_gate_softcap": 0.5, "mlp_up_softcap": 0.5}},
    # enough vision layers for every folding scale: fewer would need scipy's linear_sum_assignment
    "inkling_mm_model": {"vision_config": {"n_layers": 8, "hidden_size": 8}},
    "jamba": {
        "attn_layer_period": 2,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "longcat_flash": {"zero_expert_num": 4},  # 8 routed + 4 identity experts
    # 0.334 of the head is rotary (8 dims); sliding-window layers double the key/value heads
    "mimo_v2_flash": {"head_dim": 24, "v_head_dim": 16, "num_key_value_heads": 2},
    "minimax_m3_vl": {"text_config": {"swiglu_limit": _LIMIT}},
    "muse_spark": {
        "text_config": {"moe_hidden_size": 32},
        "audio_config": {"hidden_sizes": [8, 8, 8, 16], "depths": [1, 1, 1, 1]},
    },
    "nemo_speechlm": {
        "audio_config": {"diarization_config": {"head_config": {"audio_hidden_size": 32}}},
        "word_timestamp_config": {"blank_token_id": 127},
    },
    "nemotron_h_omni": {"vision_config": {"video_temporal_patch_size": 2}},
    # the talker's text config lacks a default for its shared expert
    "qwen3_omni_moe": {
        "talker_config": {"text_config": {"shared_expert_intermediate_size": 40}, "spatial_merge_size": 2}
    },
    "qwen4_exp": {
        "text_config": {
            "indexer_n_heads": 2,
            "indexer_kv_heads": 1,
            "indexer_head_dim": 16,
            "indexer_budget": 8,
            "indexer_compress_ratio": 2,
        }
    },
    "step3p7": {"text_config": {"sliding_window": 8, "swiglu_limits": [0.0, _LIMIT]}},
}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shrunk(default: Any, text: bool) -> dict[str, Any]:
    """Size fields of config ``default`` (an instance with the class's defaults) replaced by tiny ones."""
    attrs = default.to_dict()
    table = _TEXT_SIZES if text else _TOWER_SIZES
    # shrink only: a size the class defaults to 0 or less (no q-LoRA, no RoPE part) keeps its meaning
    out: dict[str, Any] = {k: min(v, attrs[k]) for k, v in table.items() if _is_int(attrs.get(k))}
    out.update({k: table[k] for k in _NEEDED if text and k in attrs and attrs[k] is None})
    if "qk_rope_head_dim" in out and "head_dim" in out:  # MLA: head_dim is the rotary part
        out["head_dim"] = out["qk_rope_head_dim"]
    layers_key = next((k for k in ("num_hidden_layers", "num_layers", "n_layers") if k in out), None)
    if layers_key is not None:
        n_old = attrs[layers_key]
        per_layer = {k: v for k, v in attrs.items() if isinstance(v, list) and len(v) == n_old and n_old > 1}
        if per_layer:  # one layer of each kind (attention/linear, dense/MoE ...), in order of appearance
            kinds = {k: list(dict.fromkeys(map(repr, v))) for k, v in per_layer.items()}
            n = min(_MAX_LAYERS, max(out[layers_key], *(len(d) for d in kinds.values())))
            out[layers_key] = n
            for k, v in per_layer.items():
                firsts = [v[[repr(x) for x in v].index(r)] for r in kinds[k]]
                out[k] = (firsts + [firsts[-1]] * n)[:n]
    for key in getattr(type(default), "sub_configs", None) or {}:
        sub = getattr(default, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            fields = _shrunk(sub, text and not any(w in key for w in _TOWER_WORDS))
            if fields:
                out[key] = {**fields, "model_type": sub.model_type}
    return out


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def survey_config(model_type: str) -> Any:
    """A tiny config of ``model_type``'s real transformers config class (class defaults, shrunk)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = _merge(_shrunk(cls(), text=True), _FAMILY_FIELDS.get(model_type, {}))
    return cls(**fields)
