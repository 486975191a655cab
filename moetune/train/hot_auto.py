"""The training callback of ``gpu_experts: auto``: choose and place the hot experts after the warm-up steps."""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from moetune.layer.hot_auto import place_auto

DEFAULT_WARMUP = (
    4  # optimizer steps counted: enough batches for stable shares on a small run, little time lost
)


class HotExpertsAuto(TrainerCallback):
    """After ``warmup`` optimizer steps, :func:`moetune.layer.hot_auto.place_auto` with ``budget`` device bytes
    (once; a resumed run counts from its resume step)."""

    def __init__(self, budget: int, warmup: int | None) -> None:
        self.budget = budget
        self.warmup = DEFAULT_WARMUP if warmup is None else warmup
        self.done = False

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if not self.done and model is not None and state.global_step >= self.warmup:
            place_auto(model, self.budget)
            self.done = True
