"""LLaMA-Factory keys that moetune does not honour, each with the reason and the fix.

A user's LLaMA-Factory YAML may carry any of these. Set to the value that asks for nothing (``off``, e.g.
``use_kt: false``), a key is accepted: it requests nothing moetune fails to do. Set to anything else, it is
an error that says why moetune does not support it; nothing is ignored silently. Keys in no list at all
are unknown and also errors (``moetune.config.load`` suggests the closest known key). KTransformers' keys
are read by ``moetune.config.ktransformers``, ``deepspeed`` and the TrainingArguments passed through by
``moetune.config.hf_args``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_NEVER = object()  # `off` for keys that are errors whatever their value


@dataclass(frozen=True)
class Rejected:
    """Why a key is not supported and what to do instead; ``off`` is the value that requests nothing."""

    reason: str
    off: Any = _NEVER

    def accepts(self, value: Any) -> bool:
        """True when ``value`` asks for nothing (the key's feature is off); a tuple ``off`` lists several."""
        if self.off is _NEVER:
            return False
        return value in self.off if isinstance(self.off, tuple) else value == self.off


def _group(reason: str, keys: dict[str, Any]) -> dict[str, Rejected]:
    return {key: Rejected(reason, off) for key, off in keys.items()}


_LATER_METHOD = (
    "this training method or LoRA variant is not supported; moetune trains LoRA (use_rslora included), full and "
    "freeze (finetuning_type), with stages sft, pt, dpo and kto"
)
_QUANT = (
    "bitsandbytes/GPTQ quantization does not apply: moetune keeps the routed experts in CPU RAM; choose "
    "their storage with `moetune: {expert_format: ...}`"
)
_KERNELS = (
    "moetune runs the model's stock transformers modules (sdpa attention); kernel patches are not applied"
)
_INFER = "generation/inference settings do not apply to `moetune train`"
_MULTIMODAL = "multimodal training is not supported"
_HUB = "moetune reads local models and datasets only; download them first and give local paths"
_PREF = (
    "this preference-training option has no equivalent in TRL's DPOTrainer/KTOTrainer, which moetune's dpo and "
    "kto stages run; supported: pref_beta, pref_ftx, pref_loss (sigmoid, hinge, ipo), kto_chosen_weight, "
    "kto_rejected_weight (docs/stages.md)"
)

REJECTED: dict[str, Rejected] = {
    # distribution
    # quantization of the base model
    **_group(
        _QUANT,
        {
            "quantization_bit": None,
            "quantization_method": "bnb",
            "quantization_type": "nf4",
            "double_quantization": True,
            "quantization_device_map": None,
            "fp8": False,
            "fp8_backend": "auto",
            "fp8_enable_fsdp_float8_all_gather": False,
        },
    ),
    # kernels and attention patches
    **_group(
        _KERNELS,
        {
            "flash_attn": ("auto", "sdpa"),
            "shift_attn": False,
            "use_unsloth": False,
            "use_unsloth_gc": False,
            "enable_liger_kernel": False,
            "use_liger_kernel": False,
            "mixture_of_depths": None,
            "rope_scaling": None,
            "use_reentrant_gc": True,
            "upcast_layernorm": False,
            "upcast_lmhead_output": False,
            "torch_compile": False,
        },
    ),
    # training methods other than LoRA, and LoRA variants
    **_group(
        _LATER_METHOD,
        {
            "use_dora": False,
            "pissa_init": False,
            "pissa_convert": False,
            "pissa_iter": 16,
            "loraplus_lr_ratio": None,
            "loraplus_lr_embedding": 1e-6,
            "create_new_adapter": False,
            "use_galore": False,
            "use_apollo": False,
            "use_badam": False,
            "use_llama_pro": False,
            "use_adam_mini": False,
            "use_muon": False,
            "use_mca": False,
            "module_dropout": 0.0,
            "use_dft_loss": False,
            "train_from_scratch": False,
            "ref_model": None,
            "reward_model": None,
            "reward_model_type": "lora",
            "ld_alpha": None,
        },
    ),
    # preference options without a TRL equivalent; accepted at the values that ask for nothing
    **_group(_PREF, {"pref_bco_weight": 0.0, "dpo_label_smoothing": 0.0, "simpo_gamma": 0.5}),
    "adapter_name_or_path": Rejected(
        "continuing from an existing adapter is not supported yet; to continue a moetune run use "
        "resume_from_checkpoint"
    ),
    "adapter_folder": Rejected("continuing from an existing adapter is not supported yet"),
    "fp16": Rejected(
        "moetune trains in bf16 or fp32 (fp16 needs loss scaling the CPU expert engine does not do); use bf16: true",
        False,
    ),
    # model loading and tokenizer changes
    **_group(
        _HUB,
        {
            "cache_dir": None,
            "model_revision": "main",
            "hf_hub_token": None,
            "ms_hub_token": None,
            "om_hub_token": None,
            "use_modelscope_hub": False,
            "use_openmind_hub": False,
        },
    ),
    **_group(
        "tokenizer and vocabulary changes are not supported; moetune uses the model's tokenizer as saved",
        {
            "use_fast_tokenizer": True,
            "resize_vocab": False,
            "split_special_tokens": False,
            "add_tokens": None,
            "add_special_tokens": None,
            "new_special_tokens_config": None,
            "init_special_tokens": "noise_init",
        },
    ),
    **_group(
        "moetune places the model itself (dense parts on the device, routed experts in CPU RAM)",
        {
            "low_cpu_mem_usage": True,
            "offload_folder": "offload",
            "device_map": None,
            "use_cache": True,
            "use_kv_cache": True,
            "use_v1_kernels": False,
            "infer_dtype": "auto",
            "print_param_status": False,
        },
    ),
    # data pipeline options
    **_group(
        "streaming datasets are not supported; moetune validates every row before training",
        {"streaming": False, "buffer_size": 16384},
    ),
    **_group(
        "mixing datasets other than by concatenation is not supported",
        {"mix_strategy": "concat", "interleave_probs": None},
    ),
    "tokenized_path": Rejected("pre-tokenized caches are not supported; moetune tokenizes on each run", None),
    "eval_on_each_dataset": Rejected("evaluation reports one metric over all eval datasets", False),
    "neat_packing": Rejected(
        "moetune packs with position_ids that restart per example, which transformers turns into a "
        "block-diagonal attention mask; use packing: true",
        False,
    ),
    "tool_format": Rejected("tool-calling formats are not supported yet", None),
    "ignore_pad_token_for_loss": Rejected("moetune never trains on padding", True),
    "data_shared_file_system": Rejected(
        "each moetune process reads and tokenizes the data itself (docs/distributed.md), so there is no shared "
        "preprocessing to place",
        False,
    ),
    "media_dir": Rejected(_MULTIMODAL, None),
    **_group(
        _MULTIMODAL,
        {
            "freeze_vision_tower": True,
            "freeze_multi_modal_projector": True,
            "freeze_language_model": False,
            "use_audio_in_video": False,
            "crop_to_patches": False,
        },
    ),
    # run outputs and modes
    "compute_accuracy": Rejected(
        "token accuracy during evaluation is not computed; eval_loss is reported", False
    ),
    "include_effective_tokens_per_second": Rejected("not reported", False),
    "early_stopping_steps": Rejected("early stopping is not supported", None),
    "disable_shuffling": Rejected("the training data is always shuffled", False),
    "do_predict": Rejected(_INFER, False),
    "predict_with_generate": Rejected(_INFER, False),
    "evaluation_strategy": Rejected("renamed by transformers; use eval_strategy"),
    "push_to_hub": Rejected(_HUB, False),
    "hub_model_id": Rejected(_HUB, None),
    # generation (LLaMA-Factory's GeneratingArguments)
    **_group(
        _INFER,
        {
            "do_sample": True,
            "temperature": 0.95,
            "top_p": 0.7,
            "top_k": 50,
            "num_beams": 1,
            "max_length": 1024,
            "max_new_tokens": 1024,
            "repetition_penalty": 1.0,
            "length_penalty": 1.0,
            "skip_special_tokens": True,
            "infer_backend": "huggingface",
            "eval_num_beams": None,
            # Seq2SeqTrainingArguments, which LLaMA-Factory's training arguments extend
            "sortish_sampler": False,
            "generation_max_length": None,
            "generation_num_beams": None,
            "generation_config": None,
        },
    ),
}

# families of keys rejected by prefix: (prefix, reason)
REJECTED_PREFIXES: tuple[tuple[str, str], ...] = (
    ("galore_", _LATER_METHOD),
    ("oft_", _LATER_METHOD),
    ("apollo_", _LATER_METHOD),
    ("badam_", _LATER_METHOD),
    ("pref_", _PREF),
    ("dpo_", _PREF),
    ("simpo_", _PREF),
    ("kto_", _PREF),
    ("ppo_", _LATER_METHOD + " (PPO)"),
    ("ref_model_", _LATER_METHOD),
    ("reward_model_", _LATER_METHOD),
    ("swanlab_", "SwanLab logging is configured through report_to; SwanLab's own keys are not supported"),
    ("use_swanlab", "use report_to: swanlab"),
    (
        "export_",
        "exporting is a separate command: `moetune train` saves the adapter to output_dir, and `moetune export "
        "merge.yaml` (LLaMA-Factory's merge config) or `moetune export --merge` merges it into the model",
    ),
    ("vllm_", _INFER),
    ("sglang_", _INFER),
    ("image_", _MULTIMODAL),
    ("video_", _MULTIMODAL),
    ("audio_", _MULTIMODAL),
)


def rejection(key: str, value: Any) -> str | None:
    """Why ``key: value`` is rejected, or None when it is not a rejected key or asks for nothing."""
    rule = REJECTED.get(key)
    if rule is not None:
        return None if rule.accepts(value) else rule.reason
    for prefix, reason in REJECTED_PREFIXES:
        if key.startswith(prefix):
            return reason
    return None


def is_rejected(key: str) -> bool:
    """True if ``key`` is a LLaMA-Factory key moetune knows and does not support (whatever its value)."""
    return key in REJECTED or any(key.startswith(prefix) for prefix, _ in REJECTED_PREFIXES)


# media-processing knobs (LLaMA-Factory's ProcessorArguments): with text rows they change nothing, and rows with
# images, videos or audio are refused when the data is read (moetune.config.datasets), so they are accepted
# with a logged line
MEDIA_KNOBS = (
    "image_max_pixels",
    "image_min_pixels",
    "image_do_pan_and_scan",
    "video_max_pixels",
    "video_min_pixels",
    "video_fps",
    "video_maxlen",
    "audio_sampling_rate",
)
MEDIA_NOTE = "no effect: moetune trains on text rows only (rows with images, videos or audio are refused)"
