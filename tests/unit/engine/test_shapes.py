"""Row pieces of bounded sizes for the bf16 GEMMs (``moetune.engine.shapes``): the split, its products against
float64 references, and that a bf16 engine issues GEMMs of a bounded set of shapes whatever the routing."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moetune.engine.lora import dropout_mask
from moetune.engine.shapes import PIECE_SIZES, RowSplit, row_pieces
from tests.unit.engine_cases import build_module, make_layer, make_routing, rel_err, run_module, run_reference

# bf16 products of K <= 64 terms rounded once: unit roundoff 2^-8 (3.9e-3) on the inputs and the output
BF16_TOL = 2e-2


def test_row_pieces_cover_n_in_order_with_bounded_sizes_and_count():
    sizes = set(PIECE_SIZES)
    for n in range(1, 2100):
        pieces = row_pieces(n)
        assert pieces[0][0] == 0 and pieces[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(
            rows in sizes and 0 <= rows - (r1 - r0) < (16 if r1 - r0 <= 64 else 32) for r0, r1, rows in pieces
        ), (n, pieces)
        assert len(pieces) == -(-n // 512), (n, pieces)
    assert row_pieces(37) == ((0, 37, 48),)  # one padded GEMM, not 32 + 5 rows reading the weights twice
    assert row_pieces(600) == ((0, 512, 512), (512, 600, 96))
    # the bound that keeps every GEMM form's shapes inside oneDNN's 1,024-kernel cache
    assert len(sizes) <= 33


def test_only_onednn_dtypes_split():
    assert RowSplit.for_dtype(torch.bfloat16).enabled and RowSplit.for_dtype(torch.float16).enabled
    for dtype in (torch.float32, torch.float64):
        split = RowSplit.for_dtype(dtype)
        assert not split.enabled and split.pieces(777) == ((0, 777, 777),)


@pytest.mark.parametrize("n", [1, 17, 300, 1100])
@pytest.mark.parametrize("beta,alpha", [(0.0, 1.0), (0.0, 0.5), (1.0, 1.0)])
def test_split_mm_matches_float64(n, beta, alpha):
    gen = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, 48, generator=gen), torch.randn(48, 40, generator=gen)
    out0 = torch.randn(n, 40, generator=gen)
    a, b, out0 = a.bfloat16(), b.bfloat16(), out0.bfloat16()
    out = out0.clone()
    if beta == 0.0:
        out[0, 0] = float("nan")  # beta 0 ignores what was there
    RowSplit.for_dtype(torch.bfloat16).mm(a, b, out, beta=beta, alpha=alpha)
    ref = beta * out0.double() + alpha * a.double() @ b.double()
    assert rel_err(out, ref) < BF16_TOL


@pytest.mark.parametrize("n", [1, 17, 300, 1100])
def test_split_sum_over_rows_into_fp32_and_transposed_views(n):
    gen = torch.Generator().manual_seed(n)
    a, b = torch.randn(n, 8, generator=gen).bfloat16(), torch.randn(n, 40, generator=gen).bfloat16()
    ref = a.double().t() @ b.double()
    out = torch.full((8, 40), float("nan"))
    RowSplit.for_dtype(torch.bfloat16).mm_t(a, b, out)
    assert out.dtype == torch.float32 and rel_err(out, ref) < BF16_TOL
    out_t = torch.full((40, 8), float("nan"))
    RowSplit.for_dtype(torch.bfloat16).mm_t(a, b, out_t.t())  # a LoRA B grad is written through a transpose
    assert rel_err(out_t.t(), ref) < BF16_TOL


def _many_rows_case(mode: str):
    """Experts with 550-650 rows each: a piece of 512 rows and a padded tail per GEMM."""
    layer = make_layer(E=4, H=64, I=32, lora="lora" in mode)
    for name in ("gate_up", "down"):
        setattr(layer, name, getattr(layer, name).bfloat16().double())
    x, ids, w = make_routing(T=800, E=4, k=3, H=64)
    return layer, x.bfloat16(), ids, w.bfloat16()


@pytest.mark.parametrize("mode", ["frozen", "lora", "full+lora"])
def test_bf16_engine_with_split_rows_within_bound(mode):
    """The bf16 engine on experts whose rows span several pieces, against the float64 loop on the same
    bf16-rounded weights (bound as in test_engine_reference: 8-bit mantissas through ~4 rounded stages)."""
    layer, x, ids, w = _many_rows_case(mode)
    counts = torch.bincount(ids.reshape(-1), minlength=4)
    pieces = [row_pieces(int(c)) for c in counts]
    assert all(len(p) == 2 for p in pieces) and any(p[-1][2] > p[-1][1] - p[-1][0] for p in pieces), pieces
    full = mode.startswith("full")
    gy = torch.randn(x.shape[0], 64, dtype=torch.float64)
    y, grads = run_module(
        build_module(layer, dtype=torch.bfloat16, compute_dtype=torch.bfloat16, full=full), x, ids, w, gy
    )
    y_ref, ref = run_reference(layer, x.double(), ids, w.double(), gy, full=full)
    assert rel_err(y, y_ref) < 3e-2
    for name in ref:
        assert rel_err(grads[name], ref[name]) < 3e-2, (name, rel_err(grads[name], ref[name]))


def test_bf16_engine_with_split_rows_and_dropout():
    """The masked LoRA backward (dropout) on split rows, against the loop with the engine's own masks."""
    layer, x, ids, w = _many_rows_case("lora")
    gy = torch.randn(x.shape[0], 64, dtype=torch.float64)
    mod = build_module(layer, dtype=torch.bfloat16, compute_dtype=torch.bfloat16, dropout=0.3)
    mod.train()
    torch.manual_seed(5)
    y, grads = run_module(mod, x, ids, w, gy)
    torch.manual_seed(5)  # the engine draws its mask seed from the global RNG: draw the same one
    seed = int(torch.randint(0, 2**62, (1,)).item())

    def masks(e, proj, shape):
        return dropout_mask(seed, e, proj, shape, 0.3, torch.bfloat16).double()

    y_ref, ref = run_reference(layer, x.double(), ids, w.double(), gy, masks=masks)
    assert rel_err(y, y_ref) < 3e-2
    for name in ref:
        assert rel_err(grads[name], ref[name]) < 3e-2, (name, rel_err(grads[name], ref[name]))


class _GemmShapes(TorchDispatchMode):
    """Records every dimension of every 2-D GEMM operand (mm, addmm) dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.dims: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            for t in args:
                if isinstance(t, torch.Tensor) and t.dim() == 2:
                    self.dims.update(t.shape)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["lora", "full+lora"])
def test_bf16_gemm_shapes_stay_in_a_fixed_set_whatever_the_routing(mode):
    """Three routings give the experts row counts like 37 or 213: every GEMM dimension must still be a piece size
    or one of the layer's own sizes (H, I, 2I, r), so oneDNN builds each GEMM's kernel once. (Before the
    split every new row count was a new shape, and a rebuilt kernel: ~1 ms per call.)"""
    layer = make_layer(E=4, H=72, I=40, r=4, lora="lora" in mode)
    mod = build_module(
        layer, dtype=torch.bfloat16, compute_dtype=torch.bfloat16, full=mode.startswith("full")
    )
    # the base GEMMs on oneDNN for every row count (the kernels' bf16_gemm, which takes few-row experts where it
    # loads, builds nothing per shape)
    mod.engine.gemm.path = replace(mod.engine.gemm.path, fused_rows=0)
    allowed = set(PIECE_SIZES) | {72, 40, 80, 4}
    seen_counts = set()
    for seed in range(3):
        x, ids, w = make_routing(T=61 + 30 * seed, E=4, k=2, H=72, seed=seed)
        seen_counts |= set(torch.bincount(ids.reshape(-1), minlength=4).tolist())
        with _GemmShapes() as rec:
            run_module(mod, x.bfloat16(), ids, w.bfloat16(), torch.randn(x.shape[0], 72))
        assert rec.dims, "no GEMM was recorded"
        assert rec.dims <= allowed, sorted(rec.dims - allowed)
    assert seen_counts - allowed  # the routings did produce row counts outside the set


def test_split_rows_false_gives_whole_row_gemms_with_the_same_results():
    """``EngineOptions(split_rows=False)`` (the benchmarks' A/B) multiplies each expert's rows whole: the recorder
    sees the routing's own row counts, and the results agree with the split engine to bf16 rounding."""
    layer = make_layer(E=4, H=72, I=40, r=4)
    x, ids, w = make_routing(T=61, E=4, k=2, H=72, seed=0)
    x, w, gy = x.bfloat16(), w.bfloat16(), torch.randn(61, 72)
    counts = set(torch.bincount(ids.reshape(-1), minlength=4).tolist())
    whole = build_module(layer, dtype=torch.bfloat16, compute_dtype=torch.bfloat16, split_rows=False)
    with _GemmShapes() as rec:
        y_whole, g_whole = run_module(whole, x, ids, w, gy)
    assert counts - set(PIECE_SIZES) <= rec.dims
    y, grads = run_module(
        build_module(layer, dtype=torch.bfloat16, compute_dtype=torch.bfloat16), x, ids, w, gy
    )
    assert rel_err(y, y_whole) < BF16_TOL
    for name in grads:
        assert rel_err(grads[name], g_whole[name]) < BF16_TOL, name
