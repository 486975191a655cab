"""Tiny real MoE models, built locally from transformers' own config classes (no downloads).

``tiny_config(family)`` gives a small config of the real config class: 2-4 layers, 8 experts, top-2,
H = 64 and I = 24 (so H != 2I and H != I: a transposed or swapped weight cannot pass a shape check by
accident), with every routing feature of the family switched on (shared experts, dense layers, groups,
score-correction bias, biases). ``save_tiny_model`` writes a random model of it as safetensors with a
tiny word-level tokenizer, the way users' checkpoints look. Tests, benchmarks and the demo share them.
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


def tiny_config(family: str, **overrides: Any):
    """A small config of ``family``'s real transformers config class (``overrides`` win)."""
    import transformers

    class_name, fields = TINY_FAMILIES.get(family)()
    return getattr(transformers, class_name)(**{**_COMMON, **fields, **overrides})


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
    """A random ``<Family>ForCausalLM`` of ``tiny_config(family, **overrides)`` in ``dtype``, in eval mode."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG: leave it be
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
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
