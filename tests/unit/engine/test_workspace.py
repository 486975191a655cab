"""``Workspace``: named scratch views handed out again without new torch ops, the same memory per name until it
grows, views of a replaced buffer never handed out again, and views made under inference_mode kept apart."""

from __future__ import annotations

import copy

import torch

from moetune.engine import workspace
from moetune.engine.workspace import Workspace


def test_the_same_request_gets_the_same_view_and_smaller_ones_the_same_memory():
    ws = Workspace()
    a = ws.get("x", (4, 8), torch.float32)
    assert ws.get("x", (4, 8), torch.float32) is a
    b = ws.get("x", (2, 8), torch.float32)
    assert b.data_ptr() == a.data_ptr() and b.shape == (2, 8)
    assert ws.get("x", (4, 8), torch.bfloat16).dtype == torch.bfloat16  # a name is per dtype


def test_growing_a_name_replaces_its_views():
    ws = Workspace()
    small = ws.get("x", (2, 8), torch.float32)
    big = ws.get("x", (64, 8), torch.float32)  # a larger buffer replaces the first
    again = ws.get("x", (2, 8), torch.float32)
    assert again is not small and again.data_ptr() == big.data_ptr()
    small.fill_(1.0)  # a view of the old buffer stays valid memory for whoever still holds it
    assert small.sum().item() == 16.0


def test_views_made_in_inference_mode_are_not_handed_to_normal_code():
    ws = Workspace()
    with torch.inference_mode():
        inner = ws.get("x", (4, 8), torch.float32)
        inner.zero_()
    outer = ws.get("x", (4, 8), torch.float32)
    assert outer is not inner and outer.data_ptr() == inner.data_ptr()
    w = torch.ones(8, 8, requires_grad=True)
    torch.mm(torch.ones(4, 8), w.detach(), out=outer)  # written outside inference mode: allowed
    assert outer.sum().item() == 4 * 8 * 8


def test_the_kept_views_are_bounded(monkeypatch):
    monkeypatch.setattr(workspace, "MAX_VIEWS", 8)
    ws = Workspace()
    for rows in range(1, 40):
        assert ws.get("x", (rows, 4), torch.float32).shape == (rows, 4)
    assert len(ws._views) <= 8


def test_a_copy_hands_out_views_of_its_own_buffers():
    ws = Workspace()
    a = ws.get("x", (4, 8), torch.float32)
    twin = copy.deepcopy(ws)
    b = twin.get("x", (4, 8), torch.float32)
    assert b.data_ptr() != a.data_ptr() and b.data_ptr() == twin._bufs[("x", torch.float32)].data_ptr()
