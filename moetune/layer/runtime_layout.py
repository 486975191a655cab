"""Dense expert tensors between the engine's layout and the transformers experts module's own.

The engine holds gate_up ``[E, 2I, H]`` (gate rows, then up rows) and down ``[E, H, I]``. The transformers
module it replaced (``ExpertsLayout``) may store them transposed (``[E, H, 2I]`` / ``[E, I, H]``) and with gate
and up interleaved along 2I (gpt-oss). A state dict of a ``CpuExperts`` carries the module's own layout, so that
``save_pretrained`` (which reverts transformers' own load-time conversions) writes the checkpoint's layout and
``load_state_dict`` of such a state dict fills the engine back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from moetune.arch.detect import ExpertsLayout


def _interleave(t: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` gate rows then up rows -> gate at even, up at odd rows."""
    i = t.shape[1] // 2
    return torch.stack((t[:, :i], t[:, i:]), dim=2).flatten(1, 2)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, ...]`` gate at even, up at odd rows -> gate rows then up rows."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def to_runtime(name: str, t: torch.Tensor, layout: ExpertsLayout | None) -> torch.Tensor:
    """Engine tensor ``name`` (``gate_up_proj`` ``[E, 2I, H]``, ``down_proj`` ``[E, H, I]``, their biases) in the
    module's layout (``layout=None``: the engine's own); a new tensor unless nothing changes."""
    if layout is None:
        return t
    if name.startswith("gate_up") and layout.interleaved:
        t = _interleave(t)
    if not name.endswith("_bias") and layout.transposed:
        t = t.transpose(1, 2).contiguous()
    return t


def from_runtime(name: str, t: torch.Tensor, layout: ExpertsLayout | None) -> torch.Tensor:
    """The inverse of :func:`to_runtime`: a module-layout tensor in the engine's layout."""
    if layout is None:
        return t
    if not name.endswith("_bias") and layout.transposed:
        t = t.transpose(1, 2)
    if name.startswith("gate_up") and layout.interleaved:
        t = _deinterleave(t)
    return t
