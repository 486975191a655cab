"""LoRA products of all experts at once (``moetune.engine.lora_batch``): when the engine takes that path, its
padded layout, and the bf16 engine on it against the float64 loop and against the per-expert path."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetune.engine.lora import ExpertLoRA, LoraPass
from moetune.engine.lora_batch import MAX_BATCH_ROWS, PAD_LIMIT, LoraBatch
from moetune.engine.routing import dispatch
from moetune.engine.workspace import Workspace
from tests.unit.engine_cases import build_module, make_layer, make_routing, rel_err, run_module, run_reference

BF16_TOL = 2e-2  # as test_shapes: bf16 products rounded once
REF_TOL = 3e-2  # as test_engine_reference: bf16 through ~4 rounded stages, against float64


def _pass(dtype=torch.bfloat16, seed=None, E=8) -> LoraPass:
    lora = ExpertLoRA.init(E, 16, 8, 4, 8.0, generator=torch.Generator().manual_seed(0))
    return LoraPass(lora, dtype, seed)


@pytest.fixture
def nan_empty(monkeypatch):
    """``torch.empty`` that fills floating tensors with NaN: memory left uninitialised and read before it is written
    (a grad the batched pass was to write and did not) shows, where fresh pages would read as zeros."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def _ids(counts: list[int]) -> torch.Tensor:
    """top-1 routing ``[T, 1]`` giving expert e counts[e] rows, shuffled."""
    flat = torch.cat([torch.full((c,), e, dtype=torch.int64) for e, c in enumerate(counts)])
    return flat[torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(1))].view(-1, 1)


def test_plan_batches_few_rows_without_dropout_in_onednn_dtypes():
    few = dispatch(_ids([3, 0, 9, 1, 5, 2, 7, 4]), 8)  # largest 9 rows -> padded to 9, 72 slots for 31 rows
    assert LoraBatch.plan(_pass(), few) == 9
    assert LoraBatch.plan(_pass(torch.float16), few) == 9
    assert LoraBatch.plan(None, few) is None
    assert LoraBatch.plan(_pass(seed=3), few) is None  # dropout masks are drawn per expert
    for dtype in (torch.float32, torch.float64):  # MKL: no per-call kernel cost, and results kept bit for bit
        assert LoraBatch.plan(_pass(dtype), few) is None
    mixed = dispatch(_ids([MAX_BATCH_ROWS + 1] + [20] * 7), 8)  # the large expert stays per expert
    assert LoraBatch.plan(_pass(), mixed) == 32
    assert LoraBatch(_pass(), mixed, 32).large == [True] + [False] * 7
    assert LoraBatch.plan(_pass(), dispatch(_ids([MAX_BATCH_ROWS + 1] * 8), 8)) is None
    assert LoraBatch.plan(_pass(), dispatch(_ids([20] * 8), 8)) == 32  # a piece size: few bmm shapes
    sparse = dispatch(_ids([30, 1, 0, 0, 0, 0, 0, 0]), 8)  # 8 x 32 slots for 31 rows: mostly padding
    assert PAD_LIMIT * 31 < 8 * 32 and LoraBatch.plan(_pass(), sparse) is None


@pytest.mark.parametrize("parts", [1, 3, 8, 20])
def test_chunks_pad_and_unpad_place_each_experts_rows_in_its_slots(parts):
    counts = [3, 0, 5, 1, 2, 0, 4, 1]
    disp = dispatch(_ids(counts), 8)
    batch = LoraBatch(_pass(), disp, 8)
    chunks = batch.chunks(parts)
    assert len(chunks) == min(parts, 8) and chunks[0][:3:2] == (0, 0) and chunks[-1][1::2] == (8, 16)
    assert all(a[1] == b[0] and a[3] == b[2] for a, b in zip(chunks, chunks[1:]))
    rows = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)  # [N, 3], sorted order
    out = torch.full_like(rows, float("nan"))
    starts = [sum(counts[:e]) for e in range(9)]
    for chunk in chunks:
        e0, e1, r0, r1 = chunk
        assert (r0, r1) == (starts[e0], starts[e1])
        padded = batch.pad(rows, chunk)
        assert padded.shape == (e1 - e0, 8, 3)
        for e in range(e0, e1):
            c = counts[e]
            assert torch.equal(padded[e - e0, :c], rows[starts[e] : starts[e] + c])
            assert bool(batch.real[e, :c].all()) and not bool(batch.real[e, c:].any())
        batch.unpad(padded, out, chunk)
    assert torch.equal(out, rows)


class _Batched(TorchDispatchMode):
    """Counts baddbmm calls (only the batched LoRA terms use it) and records every bmm operand's dimensions."""

    def __init__(self) -> None:
        super().__init__()
        self.baddbmm = 0
        self.dims: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.baddbmm):
            self.baddbmm += func.overloadpacket is torch.ops.aten.baddbmm
            self.dims.update(d for t in args if isinstance(t, torch.Tensor) for d in t.shape)
        return func(*args, **(kwargs or {}))


def _case(seed=0):
    """E = 8 experts, top-2 of 40 tokens: 4-17 rows each, one expert left idle (its LoRA grads must be 0)."""
    layer = make_layer(E=8, H=64, I=32, r=4)
    layer.gate_up, layer.down = layer.gate_up.bfloat16().double(), layer.down.bfloat16().double()
    x, ids, w = make_routing(T=40, E=7, k=2, H=64, seed=seed)  # experts 0-6: expert 7 gets no row
    return layer, x.bfloat16(), ids, w.bfloat16(), torch.randn(40, 64, dtype=torch.float64)


@pytest.mark.parametrize("workers", [1, 4])
@pytest.mark.parametrize("policy", ["retain", "recompute"])
@pytest.mark.parametrize("mode", ["lora", "full+lora"])
def test_batched_lora_engine_matches_float64_loop(
    policy, mode, workers, four_threads, monkeypatch, nan_empty
):
    """One chunk of experts, or four run by the expert pool (each writes its own rows and grad slices)."""
    layer, x, ids, w, gy = _case()
    full = mode.startswith("full")
    mod = build_module(
        layer,
        dtype=torch.bfloat16,
        compute_dtype=torch.bfloat16,
        full=full,
        policy=policy,
        expert_workers=workers,
    )
    seen: list[
        int
    ] = []  # the chunks' first experts, as the engine ran them (a spy: pool threads escape modes)
    grads_of = LoraBatch.backward_weights
    monkeypatch.setattr(
        LoraBatch,
        "backward_weights",
        lambda self, chunk, *a: (seen.append(chunk[0]), grads_of(self, chunk, *a)),
    )
    y, grads = run_module(mod, x, ids, w, gy)
    assert sorted(seen) == sorted(2 * [8 * p // workers for p in range(workers)]), seen  # down and gate_up
    y_ref, ref = run_reference(layer, x.double(), ids, w.double(), gy, full=full)
    assert rel_err(y, y_ref) < REF_TOL
    for name in ref:
        assert rel_err(grads[name], ref[name]) < REF_TOL, (name, rel_err(grads[name], ref[name]))
    for name in ("lora_gate_up_A", "lora_gate_up_B", "lora_down_A", "lora_down_B"):
        assert grads[name].dtype == torch.float32
        assert not bool(grads[name][7].any()), name  # the idle expert: exactly zero, as per expert
        assert bool(grads[name][:7].ne(0).all(dim=-1).any()), name


@pytest.mark.parametrize("policy", ["retain", "recompute"])
@pytest.mark.parametrize("mode", ["lora", "full+lora"])
def test_few_row_experts_batched_beside_large_ones_per_expert(policy, mode, monkeypatch, nan_empty):
    """Expert 0 gets 45 rows (per expert), the others 0-9 (batched): the batch writes first, the per-expert terms
    of expert 0 replace its rows and write its grads, which the batch leaves alone; all against the float64 loop,
    every grad written (``nan_empty``: the pass's grads start uninitialised)."""
    layer = make_layer(E=8, H=64, I=32, r=4)
    layer.gate_up, layer.down = layer.gate_up.bfloat16().double(), layer.down.bfloat16().double()
    ids = _ids([45, 3, 9, 0, 7, 2, 9, 4])
    gen = torch.Generator().manual_seed(2)
    t = ids.shape[0]
    x, w, gy = (
        torch.randn(t, 64, generator=gen),
        torch.rand(t, 1, generator=gen),
        torch.randn(t, 64, generator=gen),
    )
    full = mode.startswith("full")
    mod = build_module(layer, dtype=torch.bfloat16, compute_dtype=torch.bfloat16, full=full, policy=policy)
    per_expert: list[int] = []
    own = LoraPass.backward_run

    def spy(self, proj, segments, *a, **kw):  # the experts whose LoRA backward runs per expert
        per_expert.extend(e for e, _, _ in segments)
        return own(self, proj, segments, *a, **kw)

    monkeypatch.setattr(LoraPass, "backward_run", spy)
    y, grads = run_module(mod, x.bfloat16(), ids, w.bfloat16(), gy.double())
    assert per_expert == [0, 0], per_expert  # down and gate_up of the large expert only
    y_ref, ref = run_reference(
        layer, x.bfloat16().double(), ids, w.bfloat16().double(), gy.double(), full=full
    )
    assert rel_err(y, y_ref) < REF_TOL
    for name in ref:
        assert rel_err(grads[name], ref[name]) < REF_TOL, (name, rel_err(grads[name], ref[name]))
        if name.startswith("lora_"):
            assert bool(grads[name][0].ne(0).all(dim=-1).any()) and not bool(grads[name][3].any()), name


@pytest.mark.parametrize("policy", ["retain", "recompute"])
def test_batched_and_per_expert_lora_agree(policy):
    layer, x, ids, w, gy = _case(seed=3)
    per_expert = build_module(
        layer, dtype=torch.bfloat16, compute_dtype=torch.bfloat16, policy=policy, batch_lora=False
    )
    with _Batched() as rec:
        y_each, g_each = run_module(per_expert, x, ids, w, gy)
    assert rec.baddbmm == 0
    y, grads = run_module(
        build_module(layer, dtype=torch.bfloat16, compute_dtype=torch.bfloat16, policy=policy), x, ids, w, gy
    )
    assert rel_err(y, y_each) < BF16_TOL
    for name in grads:
        assert rel_err(grads[name], g_each[name]) < BF16_TOL, (name, rel_err(grads[name], g_each[name]))


def test_batched_bmm_shapes_stay_in_a_fixed_set():
    """Whatever the routing, the bmm operands have E experts, a piece-sized m and the layer's own sizes, so
    oneDNN builds each product's kernel once (as for the per-expert GEMMs: test_shapes)."""
    from moetune.engine.shapes import PIECE_SIZES

    layer = make_layer(E=8, H=64, I=32, r=4)
    mod = build_module(layer, dtype=torch.bfloat16, compute_dtype=torch.bfloat16)
    allowed = set(PIECE_SIZES) | {8, 64, 32, 4, 1}  # 1: the combine's [T, 1, k] x [T, k, H]
    for seed in range(3):
        t = 37 + 11 * seed
        x, ids, w = make_routing(T=t, E=8, k=2, H=64, seed=seed)
        with _Batched() as rec:
            run_module(mod, x.bfloat16(), ids, w.bfloat16(), torch.randn(t, 64))
        assert rec.baddbmm >= 4
        assert rec.dims - {t, 2} <= allowed, sorted(rec.dims - allowed)  # t, k: the combine's bmm


def test_named_pads_fill_each_chunks_part_of_one_reused_workspace_buffer():
    counts = [3, 0, 5, 1, 2, 0, 4, 1]
    ws = Workspace()
    batch = LoraBatch(_pass(), dispatch(_ids(counts), 8), 8, ws)
    rows = torch.arange(16 * 3, dtype=torch.float32).view(16, 3)  # [N, 3], sorted order
    chunks = batch.chunks(3)
    parts = [batch.pad(rows, chunk, "x") for chunk in chunks]
    whole = ws.get("lora_batch_x", (8, 8, 3), torch.float32)
    assert torch.equal(torch.cat(parts), whole)  # the chunks' parts tile the one buffer, in expert order
    for chunk, part in zip(chunks, parts):
        assert part.data_ptr() == whole[chunk[0]].data_ptr()
        assert torch.equal(part, batch.pad(rows, chunk))  # as the fresh pad
    again = LoraBatch(_pass(), dispatch(_ids(counts), 8), 8, ws).pad(rows, chunks[0], "x")
    assert again.data_ptr() == whole.data_ptr()  # the next pass reuses it
