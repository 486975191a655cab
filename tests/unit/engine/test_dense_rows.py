"""Dense expert weights with padded rows (``formats/dense.py``: ``row_stride``, ``DenseExperts.empty``).

bf16 rows whose bytes are a multiple of 4 KiB are stored one cache line further apart; everything that reads the
weights (the kernels, torch's GEMMs, the engines in every mode, full mode's updates) takes the row stride. The
engine on padded rows (the pad NaN: read, it would spread) is compared bit for bit with the same engine on the
same weights stored contiguous, on the kernels and on torch's GEMMs alike.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moetune.engine import DenseExperts
from moetune.engine.formats import dense
from moetune.engine.kernels import fused_variant
from moetune.errors import EngineError
from tests.unit.engine_cases import build_module, make_layer, run_module

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize(
    "cols,dtype,stride",
    [
        (2048, torch.bfloat16, 2080),  # 4 KiB rows: one line more
        (4096, torch.bfloat16, 4128),
        (768, torch.bfloat16, 768),  # 1536 bytes: contiguous
        (7168, torch.bfloat16, 7168),  # 14336 bytes: contiguous
        (1024, torch.float32, 1024),  # 4 KiB, but not bf16 (no kernel reads it)
        (12, torch.bfloat16, 12),
    ],
)
def test_row_stride(cols, dtype, stride):
    assert dense.row_stride(cols, dtype) == stride


def test_empty_lays_out_padded_rows_the_format_keeps():
    gate_up, down = DenseExperts.empty(3, 1024, 2048, torch.bfloat16)  # E = 3, I = 1024, H = 2048
    assert gate_up.shape == (3, 2048, 2048) and gate_up.stride() == (2048 * 2080, 2080, 1)
    assert down.shape == (3, 2048, 1024) and down.is_contiguous()  # 2 KiB rows
    gate_up.normal_(), down.normal_()
    weights = DenseExperts(gate_up, down)
    assert weights.gate_up.data_ptr() == gate_up.data_ptr() and weights.gate_up.stride() == gate_up.stride()
    assert weights.nbytes == 2 * (3 * 2048 * 2080 + 3 * 2048 * 1024)
    # a view whose rows are not contiguous is laid out anew, contiguous
    t = torch.randn(3, 8, 2048).bfloat16().transpose(1, 2)  # [E, H, I] = [3, 2048, 8], rows not contiguous
    other = DenseExperts(torch.randn(3, 16, 2048).bfloat16(), t)
    assert other.down.is_contiguous() and torch.equal(other.down, t)


def test_padded_rows_still_give_clear_shape_errors():
    gate_up, _ = DenseExperts.empty(2, 1024, 2048, torch.bfloat16)
    with pytest.raises(EngineError, match=r"down must be \[E, H, I\] = \(2, 2048, 1024\)"):
        DenseExperts(gate_up, torch.zeros(2, 2048, 1000, dtype=torch.bfloat16))


MODES = {"lora": {}, "frozen": {"lora": False}, "full": {"full": True}}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_engine_on_padded_rows_equals_contiguous(mode, path):
    """Forward and every gradient (full mode's base gradients included), bf16, experts of 1-31 rows; ``kernels``:
    the fused kernels take up to 16 rows (where the variant that loads here computes in bf16), oneDNN the rest."""
    opts = dict(MODES[mode])
    lora, full = opts.pop("lora", True), opts.pop("full", False)
    layer = make_layer(E=4, H=64, I=40, r=4, lora=lora)
    ids = torch.tensor([[0, 1]] * 24 + [[2, 3]] + [[2, 0]] * 7)  # [T, 2]: 31, 25, 8 and 1 rows
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(32, 64, generator=gen), torch.rand(32, 2, generator=gen)
    gy = torch.randn(32, 64, generator=gen)
    runs = []
    for pad in (0, 32, 5):
        mod = build_module(layer, dtype=torch.bfloat16, full=full, pad=pad)
        held = mod.engine.weights
        assert held.gate_up.stride(1) == 64 + pad and held.down.stride(1) == 40 + pad
        gemm = mod.engine.gemm
        kernels = path == "kernels" and gemm.path.fused_rows > 0
        if path == "kernels" and not kernels:
            pytest.skip(f"no kernel variant computing in bf16 here ({fused_variant() or 'none'})")
        gemm.path = replace(gemm.path, fused_rows=16 if kernels else 0)
        runs.append(run_module(mod, x.bfloat16(), ids, w.bfloat16(), gy))
    (y0, g0), *others = runs
    for y, g in others:
        assert torch.equal(y, y0)
        assert g.keys() == g0.keys()
        for name in g0:
            assert (g[name] is None) == (g0[name] is None), name
            assert g0[name] is None or torch.equal(g[name], g0[name]), name
