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

from moetune.adapters.expert_rows import HeldRows, held_part
from moetune.errors import LoadError
from moetune.train.fsdp import DDP_OPTIMIZER, FSDP_OPTIMIZER, load_optimizer_whole
from moetune.train.sharded_lora import HeldTensor, ShardedLora, write_rows_file


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


# the expert LoRA held by rows (expert_parallel: sharded): E experts of LoRA rank R, A [E R, IN], B [OUT, R E]
E, R, IN, OUT = 8, 2, 3, 4


class _Experts(nn.Module):
    """A dense layer and one layer's expert LoRA weights, held whole (``count == E``) or by rows."""

    def __init__(self, count: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(IN, OUT)
        self.lora_A = nn.Parameter(torch.randn(count * R, IN))
        self.lora_B = nn.Parameter(torch.randn(OUT, R * count))

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.lora_A.T @ self.lora_B.T).square().sum() + self.dense(x).square().sum()


def _rank(world: int, rank: int) -> tuple[_Experts, torch.optim.AdamW, list[HeldTensor]]:
    """Rank ``rank`` of ``world``: its rows of the expert LoRA, the whole dense layer, the Trainer's two groups."""
    per = E // world
    model = _Experts(per)
    held = [
        HeldTensor(f"lora_{kind}", getattr(model, f"lora_{kind}"), HeldRows(kind, R, rank * per, per, E))
        for kind in ("A", "B")
    ]
    groups = [{"params": [model.dense.weight, model.lora_A, model.lora_B]}, {"params": [model.dense.bias]}]
    return model, torch.optim.AdamW(groups, lr=0.1, weight_decay=0.01), held


def _held(whole: torch.Tensor, t: HeldTensor) -> torch.Tensor:
    return whole if t.param.shape == whole.shape else held_part(whole, t.rows)


def _one_process_steps(steps: int) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]], torch.Tensor]:
    """One process holding every expert: its parameters and AdamW state after ``steps - 1`` steps (copies), and
    the input of step ``steps``."""
    model, opt, _ = _rank(1, 0)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, IN, generator=gen) for _ in range(steps)]
    for x in xs[:-1]:
        model.loss(x).backward()
        opt.step()
        opt.zero_grad()
    params = [p.detach().clone() for p in _params(model)]
    return params, [dict(opt.state[p]) for p in _params(model)], xs[-1]


def _params(model: _Experts) -> list[torch.Tensor]:
    return [model.dense.weight, model.lora_A, model.lora_B, model.dense.bias]


@pytest.mark.parametrize(
    ("kind", "saved", "resumed"),
    [("fsdp", 2, 2), ("fsdp", 2, 1), ("ddp", 2, 4), ("ddp", 4, 2), ("ddp", 1, 2), ("fsdp", 1, 2)],
)
def test_other_kinds_expert_lora_rows_restored(tmp_path: Path, kind: str, saved: int, resumed: int) -> None:
    # the checkpoint a run of `saved` processes writes (`saved` 1: one process, whole moments in the optimizer file;
    # else every rank its rows file, the main process's optimizer file without the rows' moments), resumed by each
    # rank of `resumed` processes of the other kind: what torch's own load_state_dict restores from the state the
    # uninterrupted rank holds (the one-process state cut to its rows), and the same next AdamW step
    whole_params, whole_state, x = _one_process_steps(3)
    for rank in range(saved):
        model, opt, held = _rank(saved, rank)
        sharded = ShardedLora.__new__(ShardedLora)  # the save's own filter; no process group needed for it
        sharded.tensors = held if saved > 1 else []
        for p, state in zip(_params(model), whole_state, strict=True):
            t = next((t for t in held if t.param is p), None)
            opt.state[p] = {k: v if t is None or not v.dim() else _held(v, t) for k, v in state.items()}
        if saved > 1:
            write_rows_file(held, opt, tmp_path, rank, saved)
        if rank == 0:
            with sharded.held_state_left_out(opt):
                if kind == "fsdp":
                    full = get_optimizer_state_dict(
                        model, opt, options=StateDictOptions(full_state_dict=True)
                    )
                    torch.save(full, tmp_path / FSDP_OPTIMIZER)
                else:
                    torch.save(opt.state_dict(), tmp_path / DDP_OPTIMIZER)
    for rank in range(resumed):
        model, got, held = _rank(resumed, rank)
        load_optimizer_whole(got, model, tmp_path, held)
        # the reference: torch's own load of the uninterrupted rank's state (the one-process state, its rows)
        ref_model, want, ref_held = _rank(resumed, rank)
        by_param = dict(zip(_params(ref_model), whole_state, strict=True))
        cut = {t.param: t for t in ref_held}
        state = {
            i: {k: _held(v, cut[p]) if p in cut and v.dim() else v for k, v in by_param[p].items()}
            for i, p in enumerate(p for g in want.param_groups for p in g["params"])
        }
        want.load_state_dict({"state": state, "param_groups": want.state_dict()["param_groups"]})
        assert got.state_dict()["param_groups"] == want.state_dict()["param_groups"]
        for i, values in want.state_dict()["state"].items():
            assert got.state_dict()["state"][i].keys() == values.keys()
            for key, value in values.items():
                torch.testing.assert_close(got.state_dict()["state"][i][key], value, rtol=0, atol=0)
        # the next step from the uninterrupted parameters and gradients (cut to the rank's rows) is one process's
        full, full_opt, _ = _rank(1, 0)
        with torch.no_grad():
            for p, v in zip(_params(full), whole_params, strict=True):
                p.copy_(v)
        for p, state in zip(_params(full), whole_state, strict=True):
            full_opt.state[p] = {k: v.clone() for k, v in state.items()}  # its step updates in place
        full.loss(x).backward()
        rows = {t.param: t for t in held}
        with torch.no_grad():
            for p, w, f in zip(_params(model), whole_params, _params(full), strict=True):
                p.copy_(_held(w, rows[p]) if p in rows else w)
                p.grad = _held(f.grad, rows[p]) if p in rows else f.grad.clone()
        full_opt.step()
        got.step()
        for p, f in zip(_params(model), _params(full), strict=True):
            torch.testing.assert_close(p, _held(f.detach(), rows[p]) if p in rows else f, rtol=0, atol=0)
