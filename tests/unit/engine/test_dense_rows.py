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
from tests.unit.engine.test_formats import QUANTIZED, E, H, I, gaussian
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


# ---- serialization (stores): the padded tensors themselves, read back as views


def test_empty_zeroes_the_padding(monkeypatch):
    """The bytes between rows are zeros (a store writes them), also where the allocator hands back memory that
    held other values (small tensors: freed ones of the same size are reused)."""
    monkeypatch.setattr(dense, "ALIAS_BYTES", 16)  # H = I = 8 bf16 values: 16-byte rows, padded by 32 values
    for _ in range(4):
        junk = [torch.full((2, 16, 40), 7.0, dtype=torch.bfloat16) for _ in range(8)]
        del junk
        gate_up, down = DenseExperts.empty(2, 8, 8, torch.bfloat16)
        for t in (gate_up, down):
            assert t.stride() == (t.shape[1] * 40, 40, 1)
            full = t.as_strided((2, t.shape[1], 40), t.stride())
            assert torch.count_nonzero(full[:, :, 8:]) == 0


def test_state_tensors_are_the_padded_tensors_and_read_back_as_views_of_them():
    gate_up, down = DenseExperts.empty(
        2, 1024, 2048, torch.bfloat16
    )  # gate_up's 4 KiB rows padded, down's not
    gate_up.normal_(), down.normal_()
    tensors = DenseExperts(gate_up, down).state_tensors()
    assert tensors["gate_up"].shape == (2, 2048, 2080) and tensors["gate_up"].is_contiguous()
    assert tensors["gate_up"].data_ptr() == gate_up.data_ptr()  # the tensor itself, no copy
    assert tensors["down"] is not None and tensors["down"].shape == (2, 2048, 1024)
    again = DenseExperts.from_state_tensors(tensors)
    assert isinstance(again, DenseExperts)
    assert again.gate_up.data_ptr() == gate_up.data_ptr() and again.gate_up.stride() == gate_up.stride()
    assert torch.equal(again.gate_up, gate_up) and torch.equal(again.down, down)


def test_weights_held_otherwise_are_given_as_they_are():
    """Contiguous 4 KiB rows, and padded-looking rows whose storage ends at the last row's K-th value (nothing
    after it to give), are given as held; contiguous rows read back as they are."""
    flat = torch.randn(2, 2048, 2048).bfloat16()  # gate_up [E, 2I, H]: 4 KiB rows, contiguous
    down = torch.randn(2, 2048, 1024).bfloat16()  # down [E, H, I]: 2 KiB rows
    assert DenseExperts(flat, down).state_tensors()["gate_up"] is flat
    storage = torch.randn(1 * 2048 * 2080 + 2047 * 2080 + 2048).bfloat16()
    tight = storage.as_strided((2, 2048, 2048), (2048 * 2080, 2080, 1))
    assert DenseExperts(tight, down).state_tensors()["gate_up"] is tight
    again = DenseExperts.from_state_tensors({"gate_up": flat, "down": down})
    assert isinstance(again, DenseExperts) and again.gate_up.data_ptr() == flat.data_ptr()
    assert again.gate_up.is_contiguous() and torch.equal(again.gate_up, flat)


def test_stored_rows_padded_under_another_rule_read_back_as_views():
    """Rows padded by less than a line, or where ``row_stride`` does not pad (2 KiB rows), read back all the same:
    a store written under another padding rule still loads."""
    for width in (1025, 1056):
        down = torch.randn(2, 2048, width).bfloat16()
        again = DenseExperts.from_state_tensors(
            {"gate_up": torch.zeros(2, 2048, 2048).bfloat16(), "down": down}
        )
        assert isinstance(again, DenseExperts) and again.down.stride(1) == width
        assert again.down.data_ptr() == down.data_ptr() and torch.equal(again.down, down[:, :, :1024])


@pytest.mark.parametrize("width", [2047, 2081, 4096])
def test_stored_rows_of_another_length_are_refused(width):
    down = torch.zeros(2, 2048, 1024, dtype=torch.bfloat16)
    match = rf"gate_up \(2, 2048, {width}\) has rows of {width} values.*hold 2048, stored 2048 to 2080 apart"
    with pytest.raises(EngineError, match=match):
        DenseExperts.from_state_tensors(
            {"gate_up": torch.zeros(2, 2048, width, dtype=torch.bfloat16), "down": down}
        )


@pytest.mark.parametrize("case", QUANTIZED, ids=lambda c: c.id)
def test_dequantize_into_padded_rows(case, monkeypatch):
    """Every format dequantizes into ``DenseExperts.empty``'s rows (padding forced onto the small rows here)
    the values it gives into new tensors, and leaves the padding alone."""
    monkeypatch.setattr(
        dense, "ALIAS_BYTES", 256
    )  # bf16 rows of H = 256 and I = 128 values: 512 and 256 bytes
    fmt = case.build(*gaussian())
    out = DenseExperts.empty(E, I, H, torch.bfloat16)
    assert out[0].stride(1) == H + 32 and out[1].stride(1) == I + 32
    got = fmt.dequantize(torch.bfloat16, out)
    assert got[0] is out[0] and got[1] is out[1]
    for a, b in zip(got, fmt.dequantize(torch.bfloat16)):
        assert torch.equal(a, b)
    full = out[0].as_strided((E, 2 * I, H + 32), out[0].stride())
    assert torch.count_nonzero(full[:, :, H:]) == 0


def test_dequantize_into_tensors_of_another_shape_or_dtype_is_refused():
    fmt = QUANTIZED[0].build(*gaussian())
    gate_up, down = DenseExperts.empty(E, I, H, torch.bfloat16)
    with pytest.raises(
        EngineError, match=r"out's gate_up is torch.bfloat16 .*; torch.float32 .* was asked for"
    ):
        fmt.dequantize(torch.float32, (gate_up, down))
    with pytest.raises(EngineError, match=rf"out's down is torch.bfloat16 \({E}, {H}, {I - 1}\)"):
        fmt.dequantize(torch.bfloat16, (gate_up, down[:, :, 1:]))
