"""Sharded expert LoRA's rows split and gathered back (``expert_rows.share`` / ``rank_counts``,
``ShardedLora.gather``), with and without the Z extra rows a LongCat-Flash gate_up LoRA holds for its
zero-computation experts (``[E + Z]`` experts' rows, the Z after the routed ones, kept by the last rank): every
rank's part is checked against stock PEFT's layout read directly (A: expert e's rows ``e r .. e r + r - 1``;
B: expert e's columns ``j E' + e``), and the gathered tensor must be the whole one exactly. The collective is a
stand-in for ``dist.gather`` over ``world`` ranks called one after another (rank 0 last); the real one runs in
``tests/integration/test_dist_exchange.py``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from moetune.adapters.expert_rows import HeldRows, held_part, rank_counts, share
from moetune.train.sharded_lora import HeldTensor, ShardedLora

E, Z, R, IN, OUT = 6, 2, 2, 5, 3


@dataclass(frozen=True)
class _Group:
    """One rank's view of the stand-in process group."""

    rank: int
    world: int


class _Gather:
    """``dist.gather`` for ranks calling one after another: each sends, rank 0 (last) receives every part."""

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}

    def __call__(self, tensor, gather_list=None, group_dst=0, group=None) -> None:
        assert group_dst == 0
        self.sent[group.rank] = tensor.clone()
        if group.rank == 0:
            assert gather_list is not None and len(gather_list) == group.world
            for q, into in enumerate(gather_list):
                assert into.shape == self.sent[q].shape, (q, into.shape, self.sent[q].shape)  # equal sizes
                into.copy_(self.sent[q])


@pytest.fixture
def fake_dist(monkeypatch) -> _Gather:
    import torch.distributed as dist

    gather = _Gather()
    monkeypatch.setattr(dist, "gather", gather)
    monkeypatch.setattr(dist, "get_rank", lambda group: group.rank)
    monkeypatch.setattr(dist, "get_world_size", lambda group: group.world)
    return gather


def _stock_part(whole: torch.Tensor, kind: str, total: int, first: int, count: int) -> torch.Tensor:
    """Experts ``first .. first + count - 1``'s rows of a whole PEFT expert-LoRA tensor, read from the layout."""
    if kind == "A":
        return whole[first * R : (first + count) * R]
    cols = [j * total + e for j in range(R) for e in range(first, first + count)]  # j-major, as [out, r, E']
    return whole[:, cols]


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("kind", ["A", "B"])
@pytest.mark.parametrize("extra", [0, Z])
def test_rows_split_and_gather_back_exactly(fake_dist, world, kind, extra) -> None:
    total = E + extra
    gen = torch.Generator().manual_seed(world * 10 + extra)
    whole = torch.randn((total * R, IN) if kind == "A" else (OUT, R * total), generator=gen)
    per = E // world
    counts = [per] * (world - 1) + [per + extra]  # the last rank also keeps the Z unused rows
    ranks = []
    for q in range(world):
        first, count = share(E, total, world, q)
        assert (first, count) == (q * per, counts[q])
        rows = HeldRows(kind, R, first, count, total)  # type: ignore[arg-type]
        assert rank_counts(rows, q, world) == counts  # from any one rank's rows
        part = held_part(whole, rows)
        assert torch.equal(part, _stock_part(whole, kind, total, first, count))
        param = torch.nn.Parameter(part)
        ranks.append((ShardedLora([HeldTensor("w", param, rows)], _Group(q, world)), param, rows))
    for lora, param, rows in ranks[:0:-1]:  # ranks world-1 .. 1 send; rank 0 gathers last
        assert lora.gather(param, rows) is None
    lora, param, rows = ranks[0]
    sent = dict(fake_dist.sent)
    assert torch.equal(lora.gather(param, rows), whole)
    # into a reused buffer (the adapter save's), sized by gather_elements, left full of NaN: nothing unwritten read
    buffer = torch.full((lora.gather_elements(lora.tensors[0]),), float("nan"))
    fake_dist.sent = sent
    got = lora.gather(param, rows, buffer)
    assert torch.equal(got, whole)
    assert buffer.data_ptr() <= got.data_ptr() < buffer.data_ptr() + buffer.numel() * buffer.element_size()
