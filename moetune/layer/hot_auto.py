"""``gpu_experts: auto``: count the routing of the first steps, then put the most-routed experts on the device.

While counting, every ``CpuExperts`` adds each call's routed slots per expert to its ``routing_counts`` ``[E]``
(from the host copy of the ids its engine needs anyway; an activation-checkpointing recompute counts again, in
every layer alike). :func:`place_auto` then ranks every (layer, expert) pair by its share of its layer's routed
slots, highest first (ties: layer order, then expert id: deterministic), takes pairs while their device copies
fit ``budget`` bytes, places them (``CpuExperts.place_hot``, on the device and in the dtype the counted calls'
hidden states had) and stops counting. Results do not change when the hot set does (hot and engine experts
compute the same numbers), so the choice can happen between any two steps; ``moetune train`` makes it after
``gpu_experts_warmup`` optimizer steps (``moetune.train.hot_auto``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from moetune.layer.cpu_experts import CpuExperts

logger = logging.getLogger(__name__)


def experts_modules(model: nn.Module) -> list[tuple[str, CpuExperts]]:
    """Every ``CpuExperts`` of ``model`` with its path, in module order."""
    return [(path, m) for path, m in model.named_modules() if isinstance(m, CpuExperts)]


def start_counting(model: nn.Module) -> int:
    """Zero and switch on the routing counts of every experts module; returns how many modules."""
    found = experts_modules(model)
    for _, m in found:
        m.routing_counts = torch.zeros(m.engine.num_experts, dtype=torch.int64)
    return len(found)


def expert_device_bytes(m: CpuExperts, dtype: torch.dtype) -> int:
    """Device bytes of one expert's copy in ``dtype``: gate_up ``[2I, H]``, down ``[H, I]`` and its biases."""
    e = m.engine
    h, i = e.hidden_size, e.intermediate_size
    numel = 3 * h * i + (2 * i if e.gate_up_bias is not None else 0) + (h if e.down_bias is not None else 0)
    return numel * torch.empty((), dtype=dtype).element_size()


def choose_hot(model: nn.Module, budget: int) -> dict[str, tuple[int, ...]]:
    """The hot experts per experts module path (sorted ids; modules that counted nothing get none) from the
    routing counts so far, within ``budget`` device bytes."""
    ranked: list[tuple[float, int, int, str, int]] = []
    for layer, (path, m) in enumerate(experts_modules(model)):
        counts, seen = m.routing_counts, m.counted_on
        if counts is None or seen is None or int(counts.sum()) == 0:
            continue
        share = (counts.double() / counts.sum()).tolist()
        size = expert_device_bytes(m, seen[1])
        ranked += [(-share[e], layer, e, path, size) for e in range(len(share)) if share[e] > 0]
    chosen: dict[str, list[int]] = {}
    left = budget
    for _, _, e, path, size in sorted(ranked):
        if size <= left:
            chosen.setdefault(path, []).append(e)
            left -= size
    return {path: tuple(sorted(ids)) for path, ids in chosen.items()}


def place_auto(model: nn.Module, budget: int) -> dict[str, tuple[int, ...]]:
    """Choose (:func:`choose_hot`) and place the hot experts, stop counting; returns what was placed."""
    modules = dict(experts_modules(model))
    chosen = choose_hot(model, budget)
    for path, ids in chosen.items():
        m = modules[path]
        assert m.counted_on is not None
        m.place_hot(ids, *m.counted_on)
    for m in modules.values():
        m.routing_counts = None
    placed = sum(len(ids) for ids in chosen.values())
    used = sum(m.hot.nbytes for m in modules.values() if m.hot is not None)
    logger.info(
        "moetune: gpu_experts auto: %d experts in %d of %d layers now computed on the device (%d of %d budget "
        "bytes), the most routed ones: %s",
        placed,
        len(chosen),
        len(modules),
        used,
        budget,
        {path: list(ids) for path, ids in chosen.items()},
    )
    if not placed:
        logger.warning(
            "moetune: gpu_experts auto: no expert placed (no routing counted, or gpu_experts_budget %d bytes "
            "holds no expert); every expert stays in the CPU engine",
            budget,
        )
    return chosen
