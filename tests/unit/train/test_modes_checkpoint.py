"""Layer-by-layer optimizer state (moetune.train.layered): files per decoder layer, exact round trip by parameter
name, and a run whose parameters differ is refused instead of loading moments into the wrong tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from moetune.errors import LoadError
from moetune.train.layered import OPTIMIZER_INDEX, load_optimizer_by_layer, part_of, save_optimizer_by_layer


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.norm = nn.LayerNorm(4)


def _trained(seed: int = 0) -> tuple[Tiny, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tiny()
    decay = [p for n, p in model.named_parameters() if "bias" not in n]
    rest = [p for n, p in model.named_parameters() if "bias" in n]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], lr=1e-2
    )
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return model, opt


def test_part_of_names_the_decoder_layer() -> None:
    assert part_of("model.layers.12.mlp.experts.gate_up_proj") == "model.layers.12"
    assert part_of("layers.0.weight") == "other"  # a top-level list has no prefix to split: one "other" file
    assert part_of("model.norm.weight") == "other"


def test_optimizer_state_round_trips_exactly(tmp_path: Path) -> None:
    model, opt = _trained()
    save_optimizer_by_layer(opt, model, tmp_path)
    index = json.loads((tmp_path / OPTIMIZER_INDEX).read_text())
    assert (
        index["param_groups"][0]["weight_decay"] == 0.1
        and "embed.weight" in index["param_groups"][0]["params"]
    )
    fresh = Tiny()
    fresh.load_state_dict(model.state_dict())
    again = torch.optim.AdamW(
        [
            {"params": [p for n, p in fresh.named_parameters() if "bias" not in n]},
            {"params": [p for n, p in fresh.named_parameters() if "bias" in n]},
        ],
        lr=5.0,
    )
    load_optimizer_by_layer(again, fresh, tmp_path)
    assert again.param_groups[0]["lr"] == 1e-2 and again.param_groups[0]["weight_decay"] == 0.1
    want = opt.state_dict()["state"]
    got = again.state_dict()["state"]
    assert want.keys() == got.keys()
    for i in want:
        for k in want[i]:
            assert torch.equal(want[i][k], got[i][k]), (i, k)
    # one more step from each gives the same weights
    for a, b in zip(model.parameters(), fresh.parameters()):
        a.grad = torch.ones_like(a)
        b.grad = torch.ones_like(b)
    opt.step(), again.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_a_run_with_other_trained_parameters_is_refused(tmp_path: Path) -> None:
    model, opt = _trained()
    save_optimizer_by_layer(opt, model, tmp_path)
    other = torch.optim.AdamW([p for n, p in model.named_parameters() if n.startswith("layers.")], lr=1e-2)
    with pytest.raises(
        LoadError, match=r"optimizer trains other parameters than this run \(missing \[\], extra \['embed"
    ):
        load_optimizer_by_layer(other, model, tmp_path)
