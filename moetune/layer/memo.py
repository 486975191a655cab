"""``ForwardMemo``: reuse an experts module's last differentiable forward when activation checkpointing recomputes it.

With non-reentrant checkpointing (``torch.utils.checkpoint(use_reentrant=False)``, what transformers'
``gradient_checkpointing_enable`` runs per decoder layer) a layer's forward runs once during forward, with
saved tensors discarded, and again during backward to regenerate them. Running the CPU experts a second
time would cost as much as their forward. Instead each ``CpuExperts`` keeps its last forward's output and
saved activations (the ones its ``ActivationPolicy`` keeps anyway) in one slot; the recompute finds them by
its inputs and hands the same tensors to autograd without calling the engine.

The key makes reuse exact, not a guess: the inputs ``x``, ``topk_ids``, ``topk_weights`` are equal
(``torch.equal``), the trained tensors are the same tensor objects (the same adapter's parameters, of which a
call's LoRA tensors are views: compared by identity, the slot holding them alive, never by address) with the
same in-place versions (no optimizer step in between) and
the CPU RNG is in the same state (checkpointing restores it, so LoRA dropout draws the same seed). On a
miss the engine simply runs again. The slot is emptied by the hit, or by the forward's own backward, so it
holds activations no longer than the autograd graph would.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetune.engine import ExpertEngine, ExpertLoRA, SavedForward


@dataclass
class _Entry:
    x: torch.Tensor  # [T, H] CPU, as given to the engine
    topk_ids: torch.Tensor  # [T, k] int64 CPU
    topk_weights: torch.Tensor  # [T, k] CPU
    trained: tuple[torch.Tensor, ...]  # the tensor objects trained tensors are (views of), held for identity
    versions: tuple[int, ...]  # their in-place versions
    rng_before: torch.Tensor  # CPU RNG state the forward started from
    rng_after: torch.Tensor  # ... and left behind (restored on a hit, as if the engine had run)
    y: torch.Tensor  # [T, H] CPU, dtype of x
    saved: SavedForward


class ForwardMemo:
    """One slot: the last forward of one engine that will be differentiated."""

    def __init__(self) -> None:
        self._entry: _Entry | None = None

    def forward(
        self,
        engine: ExpertEngine,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        training: bool,
        lora: ExpertLoRA | None = None,
    ) -> tuple[torch.Tensor, SavedForward]:
        """``engine.forward(..., save=True, lora=lora)`` or, when the slot holds a forward of the same inputs, its
        result.

        x ``[T, H]``, topk_ids ``[T, k]``, topk_weights ``[T, k]``, all CPU -> (y ``[T, H]``, SavedForward).
        """
        trained = tuple(t if t._base is None else t._base for t in engine.trained_tensors(lora))
        versions = tuple(t._version for t in trained)
        rng = torch.get_rng_state()
        e = self._entry
        if (
            e is not None
            and len(e.trained) == len(trained)
            and all(a is b for a, b in zip(e.trained, trained))
            and e.versions == versions
            and torch.equal(e.rng_before, rng)
            and e.x.shape == x.shape
            and e.x.dtype == x.dtype
            and torch.equal(e.topk_ids, topk_ids)
            and torch.equal(e.topk_weights, topk_weights)
            and torch.equal(e.x, x)
        ):
            self._entry = None
            torch.set_rng_state(e.rng_after)
            # a fresh tensor: y itself is already the output of the first forward's autograd node
            return e.y.detach().clone(), e.saved.with_tensors(e.saved.tensors())
        y, saved = engine.forward(x, topk_ids, topk_weights, save=True, training=training, lora=lora)
        assert saved is not None
        self._entry = _Entry(
            x, topk_ids, topk_weights, trained, versions, rng, torch.get_rng_state(), y, saved
        )
        return y, saved

    def forget(self, saved: SavedForward) -> None:
        """Empty the slot if it holds the forward ``saved`` came from (its backward has run)."""
        if self._entry is not None and self._entry.saved.index == saved.index:
            self._entry = None
