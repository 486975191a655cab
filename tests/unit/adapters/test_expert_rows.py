"""A rank's rows of PEFT's expert LoRA tensors (``moetune.adapters.expert_rows``) against the engine's own view of the
whole tensors (``peft_layout.engine_view``: ``[E, r, in]`` / ``[E, out, r]``), sliced by expert."""

from __future__ import annotations

import pytest
import torch

from moetune.adapters.expert_rows import HeldRows, expert_axis, held_part, joined
from moetune.adapters.peft_layout import engine_view

E, R, IN, OUT = 8, 3, 5, 7


@pytest.mark.parametrize("world", [1, 2, 4])
def test_held_rows_are_the_engine_view_of_the_rank_experts(world) -> None:
    gen = torch.Generator().manual_seed(0)
    lora_a, lora_b = torch.randn(E * R, IN, generator=gen), torch.randn(OUT, R * E, generator=gen)
    whole_a, whole_b = engine_view(lora_a, lora_b, E)
    per = E // world
    parts_a, parts_b = [], []
    for rank in range(world):
        rows_a, rows_b = HeldRows("A", R, rank * per, per, E), HeldRows("B", R, rank * per, per, E)
        a, b = held_part(lora_a, rows_a), held_part(lora_b, rows_b)
        assert a.shape == (per * R, IN) and b.shape == (OUT, R * per)
        assert rows_a.is_whole(lora_a) and rows_b.is_whole(lora_b) and rows_a.whole == (world == 1)
        assert rows_a.whole_shape(a.shape) == tuple(lora_a.shape) and rows_b.whole_shape(b.shape) == tuple(
            lora_b.shape
        )
        mine_a, mine_b = engine_view(a, b, per)  # what the rank's engine computes with
        held = slice(rank * per, (rank + 1) * per)
        assert torch.equal(mine_a, whole_a[held]) and torch.equal(mine_b, whole_b[held])
        assert torch.equal(expert_axis(a, rows_a), lora_a.view(E, R, IN)[held])
        assert torch.equal(expert_axis(b, rows_b), lora_b.view(OUT, R, E)[:, :, held])
        parts_a.append(a)
        parts_b.append(b)
    # every rank's rows, in rank order, are the whole tensors again (exactly: only indexing)
    assert torch.equal(joined(parts_a, HeldRows("A", R, 0, per, E)), lora_a)
    assert torch.equal(joined(parts_b, HeldRows("B", R, 0, per, E)), lora_b)
    # the same written into a reused buffer (the adapter save's), which it then views
    for parts, kind, whole in ((parts_a, "A", lora_a), (parts_b, "B", lora_b)):
        buffer = torch.full((whole.numel() + 5,), float("nan"))
        got = joined(parts, HeldRows(kind, R, 0, per, E), buffer[: whole.numel()])
        assert torch.equal(got, whole) and got.data_ptr() == buffer.data_ptr()
