"""``LoraPass``'s compute-dtype operands: copied into a workspace (in the engine the calling thread's, reused from
pass to pass) or, without one, fresh; the same numbers either way, and no copy where the masters are already the
operands. And a workspace survives ``copy.deepcopy`` (its lock is not copied)."""

from __future__ import annotations

import copy

import torch

from moetune.engine.lora import LORA_NAMES, ExpertLoRA, LoraPass
from moetune.engine.workspace import Workspace


def _lora(dtype=torch.float32) -> ExpertLoRA:
    gen = torch.Generator().manual_seed(0)
    lora = ExpertLoRA.init(4, 16, 8, 2, 4.0, dtype=dtype, generator=gen)
    lora.gate_up_B.normal_(generator=gen)  # B is zero after init: make every operand non-trivial
    lora.down_B.normal_(generator=gen)
    return lora


def _operands(p: LoraPass) -> list[torch.Tensor]:
    (a1, b1), (a2, b2) = p._ab["gate_up"], p._ab["down"]
    return [a1, b1, a2, b2]


def test_operands_are_converted_into_the_workspace_and_reused_by_the_next_pass():
    lora, ws = _lora(), Workspace()
    first = _operands(LoraPass(lora, torch.bfloat16, None, ws=ws))
    ptrs = [t.data_ptr() for t in first]
    with torch.no_grad():  # an optimizer step between passes: the next pass sees the new values
        for t in lora.tensors():
            t.mul_(2)
    second = _operands(LoraPass(lora, torch.bfloat16, None, ws=ws))
    assert [t.data_ptr() for t in second] == ptrs
    fresh = _operands(LoraPass(lora, torch.bfloat16, None))
    for name, got, want, master in zip(LORA_NAMES, second, fresh, lora.tensors()):
        assert got.dtype == torch.bfloat16 and got.is_contiguous(), name
        assert torch.equal(got, want) and torch.equal(got, master.to(torch.bfloat16)), name
        assert not any(got.data_ptr() == t.data_ptr() for t in lora.tensors()), name


def test_masters_already_in_the_compute_dtype_are_used_as_they_are():
    lora, ws = _lora(), Workspace()
    got = _operands(LoraPass(lora, torch.float32, None, ws=ws))
    assert [t.data_ptr() for t in got] == [t.data_ptr() for t in lora.tensors()]
    assert ws.nbytes == 0
    # a strided view (PEFT's rank-major lora_B) is still made contiguous, into the workspace
    strided = ExpertLoRA(
        lora.gate_up_A,
        lora.gate_up_B.transpose(1, 2).contiguous().transpose(1, 2),
        lora.down_A,
        lora.down_B,
        2.0,
    )
    b1 = _operands(LoraPass(strided, torch.float32, None, ws=ws))[1]
    assert b1.is_contiguous() and torch.equal(b1, lora.gate_up_B) and ws.nbytes == b1.nbytes


def test_a_workspace_copies_with_its_buffers_and_a_lock_of_its_own():
    ws = Workspace()
    ws.get("a", (2, 3), torch.float32).fill_(1.0)
    twin = copy.deepcopy(ws)  # a deep copy of a model copies its engines' workspaces
    assert twin._lock is not ws._lock
    got = twin.get("a", (2, 3), torch.float32)
    assert (
        torch.equal(got, torch.ones(2, 3)) and got.data_ptr() != ws.get("a", (2, 3), torch.float32).data_ptr()
    )
