"""The AVX2 variant of the fused kernels (``kernels/avx2_gemm.cpp``: fp32 operands, 8-lane decoders, FMA) built
by name (``load_variant``: this CPU may load a better variant by default) against float64 products on each
format's own fp32 weights (``dequantize(float32)``, the torch path's fp32 tiles; dense bf16 weights widened; int8:
the codes against x, or g times the fp32 row scale, as 16-bit integer rows (``int16_rows``, qmax 32767: the
variant's avx2_int16.h; ``test_int16_rows`` bounds that rounding against the exact product), the row scale applied
to the forward's sums).

Bound per element: ``2^-21 |ref|`` (the scale's and the accumulate's fp32 roundings) plus ``K * 2^-23`` times
the product of magnitudes (K fp32 additions); a wrong scale, nibble or block is off by a factor, far outside it.
Row counts cover one to several register blocks (3 rows forward, 6 backward) and each remainder, and the forward
on the backward's loops over W^T (from 112 rows: 130 here, 113 in the odd shapes); odd shapes cover K off the
8-column lanes (bf16, int8 and fp8_block tails; the transposed forward's W^T rows past K), partial 4-row output
blocks and 32-column strips (O off them: the transposed forward's columns past O). fp8_block up to 12 rows forward
and 32 backward takes its block scales on copies of x and g (``block_scaled``): n = 1-11 and 1-17 here, and the
odd shape 258 x 75 puts a 4-row block across two grid rows (up's rows from 129).
The engine with fp32 compute on this variant equals the torch path; the registry's choice of it is in
``test_fused_kernels``.
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine import DenseExperts, ExpertFormat
from moetune.engine.formats import Int8Experts
from moetune.engine.gemm import Conversion, GemmPath, resolve_gemm_path
from moetune.engine.kernels import load_variant
from moetune.errors import EngineError
from tests.unit.engine import test_fused_fp8_mxfp4, test_fused_kernels
from tests.unit.engine.test_formats import _lora, _module, gaussian
from tests.unit.engine_cases import make_routing, run_module


def _avx2_or_why() -> str:
    if not test_fused_kernels.HAS_COMPILER:
        return "no C++ compiler (c++/g++) on PATH"
    try:
        load_variant("AVX2")
    except EngineError as err:
        return str(err)
    return ""


pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(bool(_avx2_or_why()), reason=_avx2_or_why()),
]


def _weights(name: str, o: int, k: int) -> ExpertFormat:
    """gate_up ``[o, k]`` of one expert in ``name`` (test_fused_kernels' or test_fused_fp8_mxfp4's builder)."""
    if name in ("fp8_block", "mxfp4"):
        return test_fused_fp8_mxfp4._weights(name, o, k, seed=o + k)
    if name == "bf16":  # dense bf16 weights, widened to fp32 in registers
        gen = torch.Generator().manual_seed(o + k)
        gate_up, down = torch.randn(1, o, k, generator=gen), torch.randn(1, k, o // 2, generator=gen)
        return DenseExperts(gate_up.bfloat16(), down.bfloat16())
    return test_fused_kernels._weights(name, o, k, seed=o + k)


def _reference(fmt: ExpertFormat, forward: bool, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 product with gate_up of expert 0, the same product of magnitudes)."""
    if isinstance(fmt, Int8Experts):
        codes, scale = fmt.gate_up[0].double(), fmt.gate_up_scale[0]
        q, step = test_fused_kernels.int16_rows(a, None if forward else scale, 32767)
        s = scale.double()
        if forward:
            return step * (q @ codes.t()) * s, step * (q.abs() @ codes.abs().t()) * s
        return step * (q @ codes), step * (q.abs() @ codes.abs())
    a = a.double()
    w = fmt.dequantize(torch.float32)[0][0].double()
    return (a @ w.t(), a.abs() @ w.abs().t()) if forward else (a @ w, a.abs() @ w.abs())


def _check(fmt: ExpertFormat, forward: bool, n: int, accumulate: bool) -> float:
    """The kernel's worst error over the bound (at most 1), and its worst relative error returned."""
    o, k = fmt.shape("gate_up")
    gen = torch.Generator().manual_seed(n)
    a = torch.randn(n, k if forward else o, generator=gen)
    out = torch.randn(n, o if forward else k, generator=gen)
    before = out.double()
    fmt.fused_gemm(load_variant("AVX2"), forward, "gate_up", 0, a, out, accumulate)
    ref, mag = _reference(fmt, forward, a)
    if accumulate:
        ref, mag = ref + before, mag + before.abs()
    bound = 2.0**-21 * ref.abs() + (k if forward else o) * 2.0**-23 * mag
    err = (out.double() - ref).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, (fmt.name, forward, n, accumulate, worst)
    return float((err / mag.clamp_min(1e-30)).max())


FORMATS = ["bf16", "int8", "int4-g32-sym", "int4-g128-asym", "fp8_block", "mxfp4"]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
@pytest.mark.parametrize("accumulate", [True, False], ids=["accumulate", "overwrite"])
def test_avx2_kernel_matches_float64(name, forward, accumulate):
    fmt = _weights(name, 256, 384)
    for n in (1, 2, 3, 4, 5, 7, 10, 11, 14, 15, 17, 64, 130):  # blocks of 3 and 6 rows, every remainder
        assert _check(fmt, forward, n, accumulate) < 1e-5


@pytest.mark.parametrize(
    "name,o,k",
    [
        ("int8", 66, 75),  # K off the 8 lanes, O off the 4-row blocks and 32-column strips
        ("int8", 130, 1030),  # K past one 512-column chunk, a tail of 6
        ("bf16", 130, 1030),
        ("bf16", 66, 75),  # K odd: a partial 8-value load at each row's end
        ("fp8_block", 258, 75),  # K odd: a masked fp8 tail; up's grid rows start one row past a block
        ("fp8_block", 400, 200),
        ("int4-g32-sym", 64, 96),  # K = 96: three 32-column strips, three 8-lane chunks of the 512 columns
        ("mxfp4", 192, 160),
    ],
)
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
def test_avx2_kernel_odd_shapes(name, o, k, forward):
    for n in (1, 5, 40, 113):
        _check(_weights(name, o, k), forward, n, accumulate=n != 5)


@pytest.mark.parametrize("name", FORMATS)
def test_avx2_kernel_is_the_same_on_two_threads(name):
    """Each output element is summed by one thread in one order on 2 intra-op threads too: the forward's 4-row
    blocks split between threads (fp8_block up to 12 rows: each thread scales x for the grid rows of its own
    blocks, O = 400 with up's rows from 200 splitting its runs), the backward's 32-column strips (fp8_block up to
    32 rows: g scaled per 128 columns, 12 strips, 6 per thread: one thread's start inside a block)."""
    fmt = _weights(name, 400 if name == "fp8_block" else 512, 384)  # I = 256 for int4 g128 and mxfp4
    for n in (8, 20, 40, 113):
        test_fused_kernels.assert_same_bits_on_two_threads(fmt, n, load_variant("AVX2"), torch.float32)


def test_avx2_kernel_refuses_bf16_operands():
    fmt = _weights("int8", 64, 64)
    a, out = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="operands must be Float"):
        fmt.fused_gemm(load_variant("AVX2"), True, "gate_up", 0, a, out, False)


@pytest.mark.parametrize("name", ["bf16", "int8", "int4"])
def test_engine_fp32_on_avx2_equals_the_torch_path(name):
    """The LoRA engine module with fp32 compute (T = 40, E = 4, k = 2: about 20 rows per expert), forward and
    every gradient, AVX2 kernels forced vs the torch path: both fp32 with fp32 sums in another order. Bound
    2^-16 of each quantity's max; int8 2^-11, its products taking the activations as 16-bit integer rows (half a
    step, 2^-16 of a row's largest magnitude, per value, through the forward's two products and the backward's;
    measured ~2^-13). A kernel decoding another weight would be off by the quantization error (~2^-7)."""
    gate_up, down = gaussian()
    fmt = test_fused_kernels.Int8Experts.from_dense(gate_up, down)
    if name == "int4":
        fmt = test_fused_kernels.Int4Experts.from_dense(gate_up, down, group_size=64, symmetric=False)
    if name == "bf16":
        fmt = DenseExperts(gate_up.bfloat16(), down.bfloat16())
    x, ids, w = make_routing(T=40, E=gate_up.shape[0], k=2, H=gate_up.shape[2], dtype=torch.float32)
    gy = torch.randn(40, gate_up.shape[2], generator=torch.Generator().manual_seed(5))
    on, off = (_module(fmt, _lora(), compute_dtype=torch.float32) for _ in range(2))
    torch_path = resolve_gemm_path(fmt, torch.float32, fused=False)
    off.engine.gemm.path = torch_path
    on.engine.gemm.path = GemmPath(torch_path.conversion, torch_path.whole_tiles, 256, "AVX2")
    (y_on, g_on), (y_off, g_off) = (run_module(m, x, ids, w, gy) for m in (on, off))
    for label, a, b in [("y", y_on, y_off)] + [(n, g_on[n], g_off[n]) for n in g_off]:
        err = float((a.double() - b.double()).abs().max() / b.double().abs().max())
        assert err <= (2.0**-11 if name == "int8" else 2.0**-16), (name, label, err)
    assert torch_path.conversion is not Conversion.VIEW


def test_bf16_compute_never_takes_the_fp32_variant():
    fmt = _weights("int8", 64, 64)
    path = GemmPath(Conversion.SCALED_CODES, False, 8, "AVX2")
    from moetune.engine.gemm import BlockedGemm

    gemm = BlockedGemm(fmt, torch.bfloat16, path)
    a, out = torch.zeros(2, 64, dtype=torch.bfloat16), torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(EngineError, match="computing in torch.bfloat16; got variant 'AVX2'"):
        gemm.matmul_wt("gate_up", 0, a, out)
