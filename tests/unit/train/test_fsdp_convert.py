"""Resuming a LoRA checkpoint of the other kind (``moetune.train.fsdp.load_optimizer_whole``), in one process on a
plain model: FSDP's ``optimizer.bin`` (torch's full optimizer state dict, keyed by parameter name, as accelerate
writes it) and DDP's ``optimizer.pt`` (keyed by position) both restore the same AdamW state as torch's own
``load_state_dict`` of the same optimizer; groups or shapes that are not this run's raise ``LoadError``. The
multi-process resumes (shards cut from the whole tensors) are in ``tests/slow/test_dist_fsdp.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from moetune.errors import LoadError
from moetune.train.fsdp import DDP_OPTIMIZER, FSDP_OPTIMIZER, load_optimizer_whole


def _model(width: int = 4) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, width), nn.Linear(width, 2))


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    """Two groups (weights with decay, biases without), in the Trainer's manner; the second group's order is not
    the parameters' order."""
    weights, biases = [model[0].weight, model[1].weight], [model[1].bias, model[0].bias]
    return torch.optim.AdamW([{"params": weights}, {"params": biases, "weight_decay": 0.0}], lr=0.1)


def _trained() -> tuple[nn.Module, torch.optim.AdamW]:
    model = _model()
    opt = _adamw(model)
    for _ in range(2):
        model(torch.randn(5, 3)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("kind", ["fsdp", "ddp"])
def test_other_kinds_optimizer_state_restored(tmp_path: Path, kind: str) -> None:
    model, opt = _trained()
    if kind == "fsdp":
        full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        torch.save(full, tmp_path / FSDP_OPTIMIZER)
    else:
        torch.save(opt.state_dict(), tmp_path / DDP_OPTIMIZER)
    fresh = _model()
    got = _adamw(fresh)
    load_optimizer_whole(got, fresh, tmp_path)
    want = opt.state_dict()
    assert got.state_dict()["param_groups"] == want["param_groups"]
    for i, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got.state_dict()["state"][i][key], value, rtol=0, atol=0)
    # and the next step is the same as the uninterrupted optimizer's
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(5, 3)
    for m, o in ((model, opt), (fresh, got)):
        m(x).square().sum().backward()
        o.step()
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_other_parameters_refused(tmp_path: Path) -> None:
    _, opt = _trained()
    torch.save(opt.state_dict(), tmp_path / DDP_OPTIMIZER)
    wider = _model(width=6)  # another LoRA rank: the same parameters, other shapes
    with pytest.raises(LoadError, match="other shapes"):
        load_optimizer_whole(_adamw(wider), wider, tmp_path)
    model = _model()
    one_group = torch.optim.AdamW(model.parameters(), lr=0.1)
    with pytest.raises(LoadError, match="other parameters than this run"):
        load_optimizer_whole(one_group, model, tmp_path)
