"""A tiny Kimi-K2.5 / K2.6 checkpoint in the layout Moonshot releases it, written locally from a random tiny model.

Kimi-K2.5 is a composite model (``model_type: kimi_k25``, ``architectures: [KimiK25ForConditionalGeneration]``,
an ``auto_map`` into the repository's code): a MoonViT vision tower, an ``mm_projector`` and a Kimi-K2 language
model whose config is ``text_config`` (``model_type: kimi_k2``, which transformers' ``Kimi_K25Config`` reads as
DeepSeek-V3). Its routed experts ship natively in compressed-tensors INT4 (``pack-quantized``, symmetric, groups
of 32), and the ``quantization_config`` sits in ``text_config``, not at the top of config.json. Tensors are named
``language_model.model.layers.{n}...``, ``vision_tower...``, ``mm_projector...`` (transformers' ``kimi_k25``
conversion rules map them onto its ``Kimi_K25ForConditionalGeneration``).

``save_kimi_k25`` builds the family's tiny survey config (``testing.families``) with ``moe_intermediate_size`` 32
(so every expert matrix's input is a multiple of the group), saves the random model with ``save_pretrained``
(transformers' own reverse renaming; the language model's ``blocks`` put back to the release's ``layers``),
quantizes every routed expert matrix as ``testing.kimi.quantize_int4`` does (compressed-tensors' minmax observer
and packing), keeps every other float tensor in bf16, and shards by decoder layer with an index. With
``dequantized_path`` it also writes the reference: every expert matrix dequantized (``q * s``, exact in fp32),
config.json without ``quantization_config`` or remote code, which transformers' own class loads.
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from moetune.testing.kimi import (
    EXPERT_KEY,
    KIMI_IGNORE,
    compress_int4_weights,
    compressed_int4_config,
    save_release,
)

K25_IGNORE = [*KIMI_IGNORE, "re:.*vision_tower.*", "re:.*mm_projector.*"]
"""The modules left bf16: Kimi-K2-Thinking's list plus the vision tower and the projector."""
AUTO_MAP = {
    "AutoConfig": "configuration_kimi_k25.KimiK25Config",
    "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
    "AutoModelForCausalLM": "modeling_kimi_k25.KimiK25ForConditionalGeneration",
}
LAYER_KEY = re.compile(r"^language_model\.model\.layers\.(\d+)\.")


def kimi_k25_model(seed: int = 0) -> Any:
    """The random float32 ``Kimi_K25ForConditionalGeneration`` the builder writes (expert I = 32)."""
    from moetune.testing.families import survey_config
    from moetune.testing.survey import _random_model

    config = survey_config("kimi_k25")
    config.text_config.moe_intermediate_size = 32  # a multiple of the INT4 group
    return _random_model(config, seed)


def _release_tensors(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``model`` as ``save_pretrained`` writes it, keys in the release's names, and its config.json."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        saved = load_file(str(Path(tmp) / "model.safetensors"))
        config = json.loads((Path(tmp) / "config.json").read_text())
    renamed = {
        k.replace("language_model.model.blocks.", "language_model.model.layers.", 1): t
        for k, t in saved.items()
    }
    return renamed, config


def save_kimi_k25(path: str | Path, *, seed: int = 0, dequantized_path: str | Path | None = None) -> Path:
    """A tiny Kimi-K2.5 (composite config, INT4 routed experts, ``text_config.quantization_config``) at ``path``;
    see the module docstring."""
    floats, config = _release_tensors(kimi_k25_model(seed))
    stored = {
        k: t if k.endswith("e_score_correction_bias") else t.to(torch.bfloat16) for k, t in floats.items()
    }
    reference = dict(stored)
    compress_int4_weights(floats, [k for k in floats if EXPERT_KEY.search(k)], stored, reference)
    text = dict(config["text_config"])
    release = {
        **config,
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": AUTO_MAP,
        "text_config": {
            **text,
            "model_type": "kimi_k2",
            "scoring_func": "sigmoid",
            "topk_method": "noaux_tc",
            "quantization_config": compressed_int4_config(ignore=K25_IGNORE),
        },
    }
    if dequantized_path is not None:
        from safetensors.torch import save_file

        ref = Path(dequantized_path)
        ref.mkdir(parents=True, exist_ok=True)
        save_file(reference, str(ref / "model.safetensors"), metadata={"format": "pt"})
        (ref / "config.json").write_text(json.dumps(config, indent=2))
    layers = int(text["num_hidden_layers"])
    return save_release(path, stored, release, layer_key=LAYER_KEY, layers=layers)
