"""Inputs for the tiny models: token ids, and image+text batches made the way the processor makes them.

Qwen3-VL-MoE and Qwen3.5-MoE checkpoints ship ``Qwen2VLImageProcessor`` (``preprocessor_config.json``) inside
``Qwen3VLProcessor``. ``image_text_inputs`` runs that image processor class itself (its PIL backend: no
torchvision, no download), configured from the model's vision config, on small random RGB images, and lays
out the token ids as the processor's chat prompt does: text, ``<|vision_start|>``, one ``<|image_pad|>`` per
merged patch, ``<|vision_end|>``, text, with the ``attention_mask`` and ``mm_token_type_ids`` the processor
returns alongside (the models need the latter for their multimodal RoPE).
"""

from __future__ import annotations

from typing import Any

import torch

from moetune.testing.tiny import VOCAB

# Qwen3-VL's preprocessor_config.json normalises with mean = std = 0.5 per channel.
IMAGE_MEAN = IMAGE_STD = (0.5, 0.5, 0.5)


def text_inputs(seed: int = 0, batch: int = 2, seq: int = 14) -> dict[str, torch.Tensor]:
    """``input_ids [batch, seq]`` int64: words of the tiny tokenizer, ids in ``[3, VOCAB)``."""
    gen = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(3, VOCAB, (batch, seq), generator=gen)}


def image_text_inputs(
    config: Any, seed: int = 0, batch: int = 2, seq: int = 14, image_hw: tuple[int, int] = (16, 24)
) -> dict[str, torch.Tensor]:
    """One ``image_hw`` RGB image per sequence, between ``seq`` text tokens (half before, half after).

    Returns ``input_ids``, ``attention_mask`` (ones) and ``mm_token_type_ids`` (1 at image tokens, else 0),
    each ``[batch, S]`` int64 (S = seq + 2 + image tokens); ``pixel_values [batch * P, 3 * Tp * p * p]``
    float32 (P patches per image: temporal patch Tp, patch p); ``image_grid_thw [batch, 3]`` int64.
    Images are sized to a multiple of ``patch_size * spatial_merge_size`` so the processor keeps them as is.
    """
    import numpy as np
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    vision = config.vision_config
    merge = vision.spatial_merge_size
    pixels = image_hw[0] * image_hw[1]
    processor = Qwen2VLImageProcessorPil(
        patch_size=vision.patch_size,
        temporal_patch_size=vision.temporal_patch_size,
        merge_size=merge,
        min_pixels=pixels,
        max_pixels=pixels,
        image_mean=list(IMAGE_MEAN),
        image_std=list(IMAGE_STD),
    )
    rng = np.random.RandomState(seed)
    images = [rng.randint(0, 256, (*image_hw, 3), dtype=np.uint8) for _ in range(batch)]
    vision_inputs = processor(images=images, return_tensors="pt")
    grid = vision_inputs["image_grid_thw"]  # [batch, 3]: (t, h, w) in patches
    n_image = int(grid[0].prod()) // merge**2  # one token per merge x merge block of patches
    text = text_inputs(seed, batch, seq)["input_ids"]
    before, after = text[:, : seq // 2], text[:, seq // 2 :]
    image = torch.tensor(
        [config.vision_start_token_id, *[config.image_token_id] * n_image, config.vision_end_token_id]
    ).expand(batch, -1)
    input_ids = torch.cat((before, image, after), dim=1)
    return {
        "input_ids": input_ids,
        "attention_mask": torch.ones_like(input_ids),
        "mm_token_type_ids": (input_ids == config.image_token_id).long(),
        "pixel_values": vision_inputs["pixel_values"],
        "image_grid_thw": grid,
    }


def labels_for(input_ids: torch.Tensor, config: Any) -> torch.Tensor:
    """``input_ids`` with the vision tokens set to -100 (no loss on them), as Qwen-VL fine-tuning does."""
    special = [
        getattr(config, name, None)
        for name in ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    ]
    mask = torch.isin(input_ids, torch.tensor([s for s in special if s is not None], dtype=input_ids.dtype))
    return input_ids.masked_fill(mask, -100)
