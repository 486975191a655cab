"""The expert LoRA rows' optimizer state in a checkpoint (``moetune.train.sharded_lora``): written per rank by a
sharded run, put together again by expert ranges for any number of processes, or cut from a whole
``optimizer.pt``; checked against the whole moments cut independently (``expert_rows.held_part``)."""

from __future__ import annotations

import pytest
import torch

from moetune.adapters.expert_rows import HeldRows, held_part
from moetune.errors import LoadError
from moetune.train.sharded_lora import HeldTensor, rows_file, rows_loading, write_rows_file

E, R, IN, OUT = 8, 2, 5, 3
NAMES = {"A": "layers.0.mlp.experts.lora_A.default.weight", "B": "layers.0.mlp.experts.lora_B.default.weight"}


def _whole() -> dict[str, dict[str, torch.Tensor]]:
    """One process's AdamW moments of the two weights (random, so a wrong row lands on a wrong value)."""
    gen = torch.Generator().manual_seed(3)
    shapes = {"A": (E * R, IN), "B": (OUT, R * E)}
    return {
        k: {m: torch.randn(shape, generator=gen) for m in ("exp_avg", "exp_avg_sq")}
        for k, shape in shapes.items()
    }


def _rank(world: int, rank: int) -> tuple[list[HeldTensor], torch.optim.AdamW]:
    """The two weights as rank ``rank`` of ``world`` holds them, and an AdamW over them."""
    per = E // world
    tensors = []
    for kind in ("A", "B"):
        rows = HeldRows(kind, R, rank * per, per, E)  # type: ignore[arg-type]
        shape = (per * R, IN) if kind == "A" else (OUT, R * per)
        tensors.append(HeldTensor(NAMES[kind], torch.nn.Parameter(torch.zeros(shape)), rows))
    return tensors, torch.optim.AdamW([t.param for t in tensors], lr=1e-2)


def _save_sharded(folder, world: int, whole) -> None:
    for rank in range(world):
        tensors, opt = _rank(world, rank)
        for t in tensors:  # the state AdamW holds for the rank's rows
            kind = t.name.split(".lora_")[1][0]
            opt.state[t.param] = {"step": torch.tensor(2.0)} | {
                m: held_part(v, t.rows) for m, v in whole[kind].items()
            }
        write_rows_file(tensors, opt, folder, rank, world)


def _load(folder, world: int, rank: int, saved_state: dict) -> list[tuple[HeldTensor, dict]]:
    tensors, opt = _rank(world, rank)
    state_dict = {"state": saved_state, "param_groups": opt.state_dict()["param_groups"]}
    with rows_loading(opt, tensors, folder):
        opt.load_state_dict(state_dict)
    return [(t, opt.state[t.param]) for t in tensors]


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (2, 4), (4, 2), (1, 2)])
def test_rows_follow_their_experts_to_another_number_of_processes(tmp_path, saved, resumed) -> None:
    whole = _whole()
    steps = {0: {"step": torch.tensor(2.0)}, 1: {"step": torch.tensor(2.0)}}  # optimizer.pt: moments left out
    if saved > 1:
        _save_sharded(tmp_path, saved, whole)
    else:  # one process: optimizer.pt holds the whole moments
        steps = {i: steps[i] | whole[k] for i, k in enumerate("AB")}
    for rank in range(resumed):
        for t, state in _load(tmp_path, resumed, rank, steps):
            kind = t.name.split(".lora_")[1][0]
            assert float(state["step"]) == 2.0
            for moment in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state[moment], held_part(whole[kind][moment], t.rows)), (
                    rank,
                    t.name,
                    moment,
                )


def test_a_missing_rank_file_is_refused(tmp_path) -> None:
    _save_sharded(tmp_path, 4, _whole())
    (tmp_path / rows_file(2, 4)).unlink()
    with pytest.raises(LoadError, match="split over 4 files"):
        _load(tmp_path, 2, 0, {0: {"step": torch.tensor(2.0)}, 1: {"step": torch.tensor(2.0)}})
