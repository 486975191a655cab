"""Tiny real MoE models, built locally from transformers' own config classes (no downloads).

``tiny_config(family)`` gives a small config of the real config class: 2-4 layers, 8 experts, top-2,
H = 64 and I = 24 (so H != 2I and H != I: a transposed or swapped weight cannot pass a shape check by
accident), with every routing feature of the family switched on (shared experts, dense layers, groups,
score-correction bias, biases). ``save_tiny_model`` writes a random model of it as safetensors with a
tiny word-level tokenizer, the way users' checkpoints look. Tests, benchmarks and the demo share them.

Vision-language families (``qwen3_vl_moe``, ``qwen3_5_moe``) are the real composite configs: the MoE language
model above as ``text_config`` plus a 2-block vision tower (hidden 32, 4x4 patches, 2x2 merge) whose
merged patches come out at H; their special vision tokens take the ids just above the tokenizer's words.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from moetune.registry import Registry

HIDDEN = 64  # H
EXPERT_INTERMEDIATE = 24  # I
NUM_EXPERTS = 8  # E
TOP_K = 2  # k
VOCAB = 96

# Vision-language families: the vision special tokens sit above the VOCAB word ids, so text drawn from
# [3, VOCAB) never contains one (an image token without an image is an error in these models).
VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN = VOCAB, VOCAB + 1, VOCAB + 2, VOCAB + 3

TINY_FAMILIES: Registry[Callable[[], tuple[str, dict[str, Any]]]] = Registry("tiny model family")
"""family -> () -> (transformers config class name, the family's fields)."""

# Shared by every family: a small GQA attention stack with real rotary embeddings.
_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # larger than the usual 0.02 so routing and logits are far from uniform
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@TINY_FAMILIES.register("qwen3_moe")
def _qwen3_moe() -> tuple[str, dict[str, Any]]:
    return "Qwen3MoeConfig", {
        "num_hidden_layers": 3,
        "intermediate_size": 80,  # the dense MLP of the mlp_only layer
        "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "head_dim": 16,
    }


@TINY_FAMILIES.register("mixtral")
def _mixtral() -> tuple[str, dict[str, Any]]:
    return "MixtralConfig", {
        "num_hidden_layers": 2,
        "intermediate_size": EXPERT_INTERMEDIATE,
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "head_dim": 16,
    }


@TINY_FAMILIES.register("qwen2_moe")
def _qwen2_moe() -> tuple[str, dict[str, Any]]:
    return "Qwen2MoeConfig", {
        "num_hidden_layers": 4,
        "intermediate_size": 80,
        "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "shared_expert_intermediate_size": 40,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": False,
        "decoder_sparse_step": 2,  # layers 1 and 3 are sparse ((idx + 1) % 2 == 0) ...
        "mlp_only_layers": [3],  # ... and layer 3 is forced dense: one MoE layer among dense ones
    }


@TINY_FAMILIES.register("olmoe")
def _olmoe() -> tuple[str, dict[str, Any]]:
    return "OlmoeConfig", {
        "num_hidden_layers": 2,
        "intermediate_size": EXPERT_INTERMEDIATE,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "norm_topk_prob": False,
    }


def _deepseek_common() -> dict[str, Any]:
    return {
        "num_hidden_layers": 3,
        "intermediate_size": 80,
        "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "n_routed_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "n_shared_experts": 1,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
    }


@TINY_FAMILIES.register("deepseek_v3")
def _deepseek_v3() -> tuple[str, dict[str, Any]]:
    return "DeepseekV3Config", {
        **_deepseek_common(),
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "num_key_value_heads": 4,
    }


@TINY_FAMILIES.register("deepseek_v2")
def _deepseek_v2() -> tuple[str, dict[str, Any]]:
    return "DeepseekV2Config", {
        **_deepseek_common(),
        "topk_method": "group_limited_greedy",
        "norm_topk_prob": False,
        "kv_lora_rank": 16,
        "q_lora_rank": 24,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "num_key_value_heads": 4,
    }


@TINY_FAMILIES.register("glm4_moe")
def _glm4_moe() -> tuple[str, dict[str, Any]]:
    return "Glm4MoeConfig", {**_deepseek_common(), "head_dim": 16, "use_qk_norm": True}


@TINY_FAMILIES.register("gpt_oss")
def _gpt_oss() -> tuple[str, dict[str, Any]]:
    return "GptOssConfig", {
        "num_hidden_layers": 2,
        "intermediate_size": EXPERT_INTERMEDIATE,
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "head_dim": 16,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
        # gpt-oss's YaRN rope, scaled to the tiny context (the default assumes 4096 * 32 positions)
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 64,
        },
    }


@TINY_FAMILIES.register("ernie4_5_moe")
def _ernie4_5_moe() -> tuple[str, dict[str, Any]]:
    return "Ernie4_5_MoeConfig", {
        "num_hidden_layers": 3,
        "intermediate_size": 80,
        "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "moe_num_experts": NUM_EXPERTS,
        "moe_k": TOP_K,
        "moe_num_shared_experts": 1,
        "moe_layer_start_index": 1,
    }


@TINY_FAMILIES.register("minimax")
def _minimax() -> tuple[str, dict[str, Any]]:
    return "MiniMaxConfig", {
        "num_hidden_layers": 2,
        "intermediate_size": EXPERT_INTERMEDIATE,
        "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "block_size": 8,
    }


_VISION: dict[str, Any] = {
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_heads": 2,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": HIDDEN,  # merged patches replace image-token embeddings
    "num_position_embeddings": 16,  # a 4 x 4 learned grid, interpolated to each image's grid
    "initializer_range": 0.1,
}


def _vision_language(text: dict[str, Any], vision: dict[str, Any]) -> dict[str, Any]:
    """The fields of a composite vision-language config around the text model ``text``."""
    return {
        "text_config": {**_COMMON, "vocab_size": VOCAB + 4, **text},
        "vision_config": {**_VISION, **vision},
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
        "image_token_id": IMAGE_TOKEN,
        "video_token_id": VIDEO_TOKEN,
        "tie_word_embeddings": False,
    }


@TINY_FAMILIES.register("qwen3_vl_moe")
def _qwen3_vl_moe() -> tuple[str, dict[str, Any]]:
    text = {
        "num_hidden_layers": 3,
        "intermediate_size": 80,
        "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "mlp_only_layers": [1],
        "head_dim": 16,
        # multimodal RoPE: the 8 frequencies split over (time, height, width), interleaved as in the release
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
    }
    # DeepStack: the first vision block's features are added to the first language layer's hidden states
    return "Qwen3VLMoeConfig", _vision_language(text, {"deepstack_visual_indexes": [0]})


@TINY_FAMILIES.register("qwen3_5_moe")
def _qwen3_5_moe() -> tuple[str, dict[str, Any]]:
    text = {
        "num_hidden_layers": 2,
        "moe_intermediate_size": EXPERT_INTERMEDIATE,
        "shared_expert_intermediate_size": 40,
        "num_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K,
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],  # gated DeltaNet, then gated attention
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        # rotary on half of each head (8 dims, 4 frequencies) split over (time, height, width)
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }
    return "Qwen3_5MoeConfig", _vision_language(text, {})


def is_vision_language(config: Any) -> bool:
    """Whether ``config`` is a composite vision-language config (its model is an image-text-to-text one)."""
    return "vision_config" in getattr(config, "sub_configs", {})


def auto_class(config: Any) -> Any:
    """transformers' auto class of ``config``'s whole model: ``AutoModelForImageTextToText`` for a
    vision-language config, else ``AutoModelForCausalLM``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def tiny_config(family: str, **overrides: Any):
    """A small config of ``family``'s real transformers config class (``overrides`` win)."""
    import transformers

    class_name, fields = TINY_FAMILIES.get(family)()
    common = {} if "text_config" in fields else _COMMON  # vision-language: the text config holds them
    return getattr(transformers, class_name)(**{**common, **fields, **overrides})


@torch.no_grad()
def randomize_(model: Any, seed: int = 0, std: float = 0.1) -> None:
    """Give every parameter and persistent buffer a random value (transformers' init leaves many at 0 or 1).

    Matrices get N(0, std); norm scales 1 + N(0, 0.1); biases, attention sinks and score-correction biases
    N(0, 0.1), so bias and correction paths are exercised instead of hidden behind zeros. Non-persistent
    buffers (RoPE frequencies) are derived from the config and left alone: they are not saved.
    """
    gen = torch.Generator().manual_seed(seed)
    derived = {name for name, _ in model.named_non_persistent_buffers()}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not t.is_floating_point() or name in derived:
            continue
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if t.dim() >= 2:
            t.copy_(noise * std)
        elif "norm" in name:
            t.copy_(1 + 0.1 * noise)
        else:
            t.copy_(0.1 * noise)


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any) -> Any:
    """A random model of ``tiny_config(family, **overrides)`` in ``dtype``, in eval mode: ``<Family>ForCausalLM``,
    or ``<Family>ForConditionalGeneration`` for a vision-language family."""
    config = tiny_config(family, **overrides)
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG: leave it be
        torch.manual_seed(seed)
        model = auto_class(config).from_config(config, dtype=torch.float32)
    randomize_(model, seed)
    return model.to(dtype).eval()


def tiny_tokenizer():
    """A word-level tokenizer over ``VOCAB`` made-up words, wrapped as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    words = [f"w{i}" for i in range(VOCAB - len(specials))]
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def save_tiny_model(
    family: str,
    path: str | Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | int | None = None,
    tokenizer: bool = True,
    **overrides: Any,
) -> Path:
    """Save a random tiny ``family`` model to ``path`` (safetensors; sharded if ``max_shard_size`` is set)."""
    path = Path(path)
    model = tiny_model(family, seed, dtype, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size is not None else {}
    model.save_pretrained(path, **kwargs)
    if tokenizer:
        tiny_tokenizer().save_pretrained(path)
    return path
