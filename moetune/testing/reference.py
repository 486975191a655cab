"""A plain autograd implementation of routed experts: one Python loop over experts, no engine code.

It is the independent reference the engine is tested against (in float64) and the ``vs_loop``
baseline of ``bench/engine.py`` (the transformers v4 style of computing experts).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def silu_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def expert_loop(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = silu_glu,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    lora: dict[str, torch.Tensor] | None = None,
    scaling: float = 1.0,
    masks: Callable[[int, int, tuple[int, ...]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """y ``[T, H]`` = sum_j w[t, j] * FFN_{ids[t, j]}(x[t]), differentiable in every tensor argument.

    gate_up ``[E, 2I, H]`` (gate rows first), down ``[E, H, I]``; ``lora`` has ``gate_up_A [E, r, H]``,
    ``gate_up_B [E, 2I, r]``, ``down_A [E, r, I]``, ``down_B [E, H, r]``. ``masks(expert, proj, shape)``
    gives the scaled dropout mask on the LoRA input of projection ``proj`` (0 gate_up, 1 down).
    """
    y = torch.zeros_like(x)
    inter = down.shape[2]
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(topk_ids == e)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        gu = xe @ gate_up[e].T
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e]
        if lora is not None:
            xd = xe * masks(e, 0, tuple(xe.shape)) if masks else xe
            gu = gu + scaling * (xd @ lora["gate_up_A"][e].T) @ lora["gate_up_B"][e].T
        h = act(gu[:, :inter], gu[:, inter:])
        out = h @ down[e].T
        if down_bias is not None:
            out = out + down_bias[e]
        if lora is not None:
            hd = h * masks(e, 1, tuple(h.shape)) if masks else h
            out = out + scaling * (hd @ lora["down_A"][e].T) @ lora["down_B"][e].T
        y = y.index_add(0, tok, out * topk_weights[tok, slot].unsqueeze(1))
    return y
