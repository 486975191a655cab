"""The kernels' GEMM on dense bf16 weights (``bf16_gemm``: ``kernels/few_rows.h`` on AVX512-BF16, the generic
decoding loops with ``Bf16Rows`` on the other variants) and the engines that route few-row experts to it.

Each product is compared with float64 on the same bf16 weights and operands, per element within ``2^-8 |ref|``
(the output's one rounding to bf16) plus ``K 2^-22 (|a| @ |W| + |out before|)`` (fp32 sums, with room): a lost
accumulation, a transposed or shifted weight, a column of the interleaved backward written to the wrong place or
another row of ``a`` are off by O(1). Shapes cover the loops' edges: 16-row weight blocks and 2-row pairs (O odd,
O < 16), 32-column steps (K off 32, K < 32), register blocks of 4 (forward) and 8 (backward) rows of ``a`` (n =
1, 2, 7, 8, 9, 16, 17, 40), rows of ``a`` and ``out`` further apart than their width.

The engines (lora, frozen, full; one expert at a time and on the pool) run with experts below and above the
threshold in one routing, against the float64 per-expert loop, within twice what the same engine on oneDNN's
GEMMs (the torch path) is off by.
"""

from __future__ import annotations

import shutil
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest
import torch

from moetune.engine import DenseExperts
from moetune.engine.formats.dense import BF16_FUSED_MAX_ROWS
from moetune.engine.gemm import Conversion, GemmPath, resolve_gemm_path
from moetune.engine.kernels import fused_variant, load_variant
from moetune.sysinfo import CpuInfo, cpu_info
from tests.unit.engine_cases import build_module, make_layer, padded_rows, rel_err, run_module, run_reference

pytestmark = pytest.mark.usefixtures("one_thread")

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None


def _needs(isa: str) -> pytest.MarkDecorator:
    return pytest.mark.skipif(
        not HAS_COMPILER or isa not in cpu_info().isa,
        reason=f"needs a C++ compiler and a CPU with {isa} (this one: {', '.join(cpu_info().isa) or 'none'})",
    )


needs_avx512 = _needs("AVX512-BF16")
SHAPES = [(1536, 2048), (2048, 768), (17, 45), (33, 31), (7, 16), (2, 1), (64, 100)]  # W [O, K]
# up to the AVX512-BF16 threshold (dense.py); 1-2, 3-4 and 5-8 rows take the backward's three band widths
ROWS = [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 40, 64, 100, 256]


def _check(
    kernels,
    forward: bool,
    o: int,
    k: int,
    n: int,
    accumulate: bool,
    dtype: torch.dtype,
    seed: int,
    pad: int = 0,
) -> None:
    """One product against float64; ``pad``: W's rows ``k + pad`` apart (DenseExperts' padded rows), the pad NaN
    (read, it would spread), and the result bit for bit the one on the same W contiguous."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(o, k, generator=gen).bfloat16()
    if pad:
        w = padded_rows(w, pad)
    width_a, width_out = (k, o) if forward else (o, k)
    a = torch.randn(n, width_a + 5, generator=gen).to(dtype)[:, 2 : width_a + 2]  # rows width + 5 apart
    out_full = torch.randn(n, width_out + 3, generator=gen).to(dtype)
    out = out_full[:, :width_out]
    before, spare = out.double(), out_full[:, width_out:].clone()
    if pad:
        on_contiguous = out.clone()
        kernels.bf16_gemm(forward, a, on_contiguous, w.contiguous(), accumulate)
    kernels.bf16_gemm(forward, a, out, w, accumulate)
    if pad:
        assert torch.equal(out, on_contiguous), (forward, o, k, n, pad)
    w64 = w.double() if not forward else w.double().t()
    ref, mag = a.double() @ w64, a.double().abs() @ w64.abs()
    if accumulate:
        ref, mag = ref + before, mag + before.abs()
    unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-23
    bound = unit * ref.abs() + width_a * 2.0**-22 * mag
    worst = float(((out.double() - ref).abs() / bound.clamp_min(1e-300)).max()) if n else 0.0
    assert worst <= 1.0, (forward, o, k, n, accumulate, worst)
    assert torch.equal(out_full[:, width_out:], spare), "wrote past its columns"


@needs_avx512
@pytest.mark.parametrize("o,k", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
def test_avx512_bf16_loops_match_float64(o, k, forward):
    kernels = load_variant("AVX512-BF16")
    for n in ROWS:
        for accumulate in (False, True):
            _check(kernels, forward, o, k, n, accumulate, torch.bfloat16, seed=n)


@needs_avx512
@pytest.mark.parametrize("o,k,pad", [(1536, 2048, 32), (64, 100, 8), (33, 31, 1)], ids=lambda v: str(v))
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
def test_avx512_bf16_loops_take_padded_rows(o, k, pad, forward):
    """W's rows further apart than their width (``DenseExperts.empty``'s layout: 32 for 4 KiB rows; also odd and
    unaligned strides): the same bits as on W contiguous, the pad never read."""
    kernels = load_variant("AVX512-BF16")
    for n in (1, 5, 8, 9, 40):
        _check(kernels, forward, o, k, n, n % 2 == 0, torch.bfloat16, seed=n, pad=pad)


@pytest.mark.parametrize(
    "variant,isa,dtype",
    [("AMX-BF16", "AMX-BF16", torch.bfloat16), ("AVX2", "AVX2", torch.float32)],
    ids=["AMX-BF16", "AVX2"],
)
def test_other_variants_take_the_decoding_loops(variant, isa, dtype):
    """The AMX variant's tile loops and the AVX2 variant's fp32 ones, with ``Bf16Rows`` as their decoder."""
    if not HAS_COMPILER or isa not in cpu_info().isa:
        pytest.skip(f"needs a C++ compiler and a CPU with {isa}")
    kernels = load_variant(variant)
    for o, k, pad in [(1536, 2048, 0), (17, 45, 0), (64, 96, 0), (64, 96, 32), (17, 45, 3)]:
        for forward in (True, False):
            for n in (1, 9, 17, 65):
                _check(kernels, forward, o, k, n, n % 2 == 1, dtype, seed=n, pad=pad)


@needs_avx512
def test_two_threads_give_the_same_bits():
    """Each output element is summed by one thread in one order (forward: 16-row blocks of W per thread;
    backward: 32-column chunks, each with its own sums)."""
    kernels = load_variant("AVX512-BF16")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(200, 300, generator=gen).bfloat16()
    x, g = torch.randn(12, 300, generator=gen).bfloat16(), torch.randn(12, 200, generator=gen).bfloat16()
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        y, gx = torch.empty(12, 200, dtype=torch.bfloat16), torch.empty(12, 300, dtype=torch.bfloat16)
        kernels.bf16_gemm(True, x, y, w, False)
        kernels.bf16_gemm(False, g, gx, w, False)
        results.append((y, gx))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_avx512
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
def test_the_run_form_equals_one_call_per_expert(forward):
    """``bf16_gemm_run`` over (expert, first row, end row) segments, its input offset by the run's first row,
    equals ``bf16_gemm`` per expert bit for bit, and leaves rows outside the segments alone."""
    kernels = load_variant("AVX512-BF16")
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3, 48, 40, generator=gen).bfloat16()  # [E, O, K]
    width_a, width_out = (40, 48) if forward else (48, 40)
    segs = [(2, 4, 9), (0, 9, 10), (1, 10, 26)]
    a = torch.randn(22, width_a, generator=gen).bfloat16()  # rows 4 .. 26 of the run
    out = torch.randn(30, width_out, generator=gen).bfloat16()
    expected = out.clone()
    for e, s0, s1 in segs:
        kernels.bf16_gemm(forward, a[s0 - 4 : s1 - 4], expected[s0:s1], w[e], True)
    kernels.bf16_gemm_run(forward, a, 4, out, [v for seg in segs for v in seg], w, True)
    assert torch.equal(out, expected)


def test_dense_paths_name_the_kernel_where_it_runs():
    """bf16 weights computed in bf16 take the kernel up to the threshold of the variant that loads here (none
    listed for AMX-BF16 yet: not measured against AMX's GEMMs); other dtypes never do."""
    gen = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(2, 16, 8, generator=gen), torch.randn(2, 8, 8, generator=gen)
    avx512 = CpuInfo(
        model="test", isa=("AVX512-BF16", "AVX2"), logical_cpus=2, physical_cores=2, numa_nodes=1
    )
    bf16 = DenseExperts(gate_up.bfloat16(), down.bfloat16())
    path = resolve_gemm_path(bf16, torch.bfloat16, avx512)
    variant = fused_variant()
    rows = BF16_FUSED_MAX_ROWS.get(variant, 0) if variant == "AVX512-BF16" else 0
    assert path == GemmPath(Conversion.VIEW, True, rows, variant if rows else "")
    assert ("bf16 kernel (AVX512-BF16" in path.describe()) is bool(rows)
    assert resolve_gemm_path(bf16, torch.bfloat16, avx512, fused=False).fused_rows == 0
    for dtype in (torch.float32, torch.float16):
        other = DenseExperts(gate_up.to(dtype), down.to(dtype))
        assert other.FUSED_MAX_ROWS == {}
        assert resolve_gemm_path(other, dtype, avx512).fused_rows == 0
        assert resolve_gemm_path(other, torch.bfloat16, avx512).fused_rows == 0


MODES = {"lora": {}, "frozen": {"lora": False}, "full": {"full": True}}


class Counting:
    """A kernel module whose bf16 GEMM calls are counted by name."""

    def __init__(self, kernels: Any) -> None:
        self.kernels, self.counts = kernels, Counter[str]()

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.kernels, name)
        if not name.startswith("bf16_gemm"):
            return fn

        def counted(*args: Any) -> Any:
            self.counts[name] += 1
            return fn(*args)

        return counted


@needs_avx512
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("workers", [1, 4])
def test_engine_on_the_kernel_matches_float64(mode, workers, four_threads):
    """Experts 0 and 1 get 31 and 24 rows (oneDNN), 2 and 3 get 8 and 1 (the kernel), in one pass: forward and every
    gradient against the float64 loop, within twice the error of the same engine on oneDNN alone (3e-2 at most);
    the kernel's engine calls it (a run call per projection, pass and run of experts)."""
    opts = dict(MODES[mode])
    lora, full = opts.pop("lora", True), opts.pop("full", False)
    layer = make_layer(E=4, H=96, I=40, r=4, lora=lora)
    ids = torch.tensor([[0, 1]] * 24 + [[2, 3]] + [[2, 0]] * 7)  # [T, 2]: 31, 25, 8 and 1 rows
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(32, 96, generator=gen, dtype=torch.float64)
    w = torch.rand(32, 2, generator=gen, dtype=torch.float64)
    gy = torch.randn(32, 96, generator=gen, dtype=torch.float64)
    y_ref, g_ref = run_reference(layer, x, ids, w, gy, full=full)
    runs, calls = [], Counting(load_variant("AVX512-BF16"))
    for rows in (16, 0):
        mod = build_module(layer, dtype=torch.bfloat16, full=full, expert_workers=workers)
        gemm = mod.engine.gemm
        gemm.path = replace(gemm.path, fused_rows=rows, fused_variant="AVX512-BF16" if rows else "")
        gemm._kernels = (gemm.path, calls)  # what _kernels_for would resolve, counting the calls
        runs.append(run_module(mod, x.bfloat16(), ids, w.bfloat16(), gy))
        if rows:  # forward (gate_up, down) and backward (down, gate_up): a run call each per run of experts
            made = dict(calls.counts)
            assert set(made) == {"bf16_gemm_run"} and made["bf16_gemm_run"] >= 4, made
    assert calls.counts == made  # none with the threshold at 0
    (y_k, g_k), (y_d, g_d) = runs
    assert g_k.keys() == g_d.keys() == g_ref.keys()
    for name, got, onednn, ref in [("y", y_k, y_d, y_ref)] + [(n, g_k[n], g_d[n], g_ref[n]) for n in g_ref]:
        if ref is None:
            continue
        err, base = rel_err(got, ref), rel_err(onednn, ref)
        assert err <= min(3e-2, max(2 * base, 1e-3)), (name, err, base)
