"""The compiled fused kernels (``moetune.engine.kernels``) against float64 references, their variant registry,
and their fallback.

The kernel products run on the variant that loads here (AMX-BF16 on AMX CPUs, AVX512-BF16 on AVX512-BF16 ones;
on an AVX2-only CPU the variant that loads computes in fp32 and ``test_fused_avx2`` tests it, so these skip);
the registry's choice per CPU is checked on fake ISA tuples with a fake build.

Each kernel product is compared with float64 arithmetic on the format's own weights: int8 as ``codes`` times the
fp32 row scale (the backward's ``g * scale`` rounded once to bf16, the torch path's definition; on the AVX512-BF16
variant x, or g times the scale, as 16-bit integers per row: ``int16_rows``, and ``test_int16_rows`` bounds
that form against the exact product), int4 as
``dequantize(bf16)`` (each weight rounded once to bf16, as the torch path's tiles are); where the loaded variant's
backward takes a weight's group-scaled form (W = S * V, decoders.h; the AVX512-BF16 variant with up to
``group_scaled_rows`` rows; and its fp8_block forward with up to ``FP8_SCALED_X_ROWS`` rows), as g (or x) times S
rounded once to bf16 (in fp32 first, as the kernel multiplies) times V, S and V read from the kernel entry's own
operands (``_scaled_form``). Bound per element:
``2^-8 |ref|`` (the output's one rounding to bf16, half an ulp) plus ``K * 2^-22 * (|a| @ |W|^T + |out before|)``
(fp32 sums over K terms, with room). A dropped scale, a wrong nibble, another row's codes or a lost accumulation
are off by the quantization step or by O(1), far outside it.

The engine end to end (lora and frozen mode) with the kernels on is compared with the same engine on the torch
path; ``test_gemm_paths`` also runs the fused path against a float64 engine.

Without a C++ compiler the kernel tests are skipped (the reason names it); on a CPU with none of the variants'
ISAs the kernel products are skipped naming the CPU.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import replace
from types import ModuleType

import pytest
import torch

from moetune.engine import EngineOptions, ExpertEngine, ExpertFormat
from moetune.engine.formats import FORMATS, Int4Experts, Int8Experts
from moetune.engine.gemm import resolve_gemm_path
from moetune.engine.kernels import (
    KERNELS_ENV,
    fused_unavailable,
    fused_variant,
    load_fused,
    load_variant,
    loader,
    variant_named,
)
from moetune.errors import ConfigError
from moetune.sysinfo import CpuInfo
from tests.unit.engine.test_formats import _lora, _module, gaussian
from tests.unit.engine_cases import make_routing, run_errors, run_module

pytestmark = pytest.mark.usefixtures("one_thread")

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler (c++/g++) on PATH")


def _bf16_kernels_or_why() -> str:
    """Why these bf16 kernel tests cannot run here, or "" where the variant that loads computes in bf16."""
    if not HAS_COMPILER:
        return "no C++ compiler (c++/g++) on PATH"
    kernels = load_fused()
    if kernels is None:
        return f"the fused kernels do not run here: {fused_unavailable()}"
    spec = variant_named(str(kernels.variant))
    if spec is None or spec.compute != torch.bfloat16:
        return f"the variant that loads here ({kernels.variant}) computes in fp32: test_fused_avx2 tests it"
    return ""


needs_kernels = pytest.mark.skipif(bool(_bf16_kernels_or_why()), reason=_bf16_kernels_or_why())
AMX = CpuInfo(
    model="test", isa=("AMX-BF16", "AVX512-BF16", "AVX2"), logical_cpus=2, physical_cores=2, numa_nodes=1
)


def _weights(name: str, o: int, k: int, seed: int = 0) -> ExpertFormat:
    """One expert whose gate_up is ``[o, k]`` (o even: gate rows then up rows) in format ``name``."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(1, o, k, generator=gen) / k**0.5
    down = torch.randn(1, k, o // 2, generator=gen) / (o // 2) ** 0.5
    if name == "int8":
        return Int8Experts.from_dense(gate_up, down)
    _, group, sym = name.split("-")  # "int4-g64-sym"
    return Int4Experts.from_dense(gate_up, down, group_size=int(group[1:]), symmetric=sym == "sym")


FP4 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=torch.float64)


def _scaled_form(kernel: str, operands: tuple) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """(S, V, columns per scale) with W = S * V exactly, float64 ``[O, K]``, from a kernel entry's own operands
    (decoders.h's group-scaled form): int4 the group's scale and u - z; fp8_block the block's scale_inv * 2^8 and the
    code's value * 2^-8; mxfp4 2^(s - 127) and FP4[code]. None for int4 with groups of 16 (no such form) and for
    int8, whose form (S = 1, its row scale on g) gives exactly the reference ``_reference`` already takes for it."""
    if kernel == "int4_gemm":
        packed, scale, zero, group = operands
        if group < 32:
            return None
        u = torch.cat((packed & 15, packed >> 4), dim=1).double()  # byte j: column j (low), j + K/2 (high)
        z = 8.0 if zero is None else zero.double().repeat_interleave(group, 1)
        return scale.double().repeat_interleave(group, 1), u - z, group
    if kernel == "fp8_block_gemm":
        codes, scale_inv, seg, seg_grid = operands
        rows = torch.arange(codes.shape[0])
        grid = torch.where(
            rows < seg, rows // 128, seg_grid + (rows - seg) // 128
        )  # up's rows: their own grid rows
        s = scale_inv.double()[grid][:, torch.arange(codes.shape[1]) // 128] * 256
        return s, codes.double() / 256, 128
    if kernel == "mxfp4_gemm":
        packed, scale = operands
        v = FP4[torch.stack((packed & 15, packed >> 4), dim=-1).flatten(1).long()]  # low nibble first
        e = scale.double().repeat_interleave(32, 1)
        return torch.where(e > 0, torch.exp2(e - 127), 2.0**-127), v, 32
    return None


def group_scaled_rows(columns: int, symmetric_int4: bool = False) -> int:
    """The rows of g up to which the AVX512-BF16 variant's backward takes the group-scaled form (few_rows.h's
    use_raw_pairs, decoders.h's raw_rows): 8 per 32 columns a scale covers, twice that for int4 without zero points,
    at most 32."""
    return min(32, 8 * columns // 32 * (2 if symmetric_int4 else 1))


def _scaled_backward(g: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g @ W, its product of magnitudes) in float64 with W = s * v taken as the group-scaled backward takes it: g
    times each 32 columns' scales in fp32, rounded once to bf16, times v."""
    ref = torch.empty(g.shape[0], v.shape[1], dtype=torch.float64)
    mag = torch.empty_like(ref)
    for c in range(0, v.shape[1], 32):
        gs = (g.float() * s[:, c].float()).bfloat16().double()
        ref[:, c : c + 32], mag[:, c : c + 32] = gs @ v[:, c : c + 32], gs.abs() @ v[:, c : c + 32].abs()
    return ref, mag


# the rows of x up to which the AVX512-BF16 variant's fp8_block forward takes the group-scaled form (avx512_gemm.cpp's
# dot products, fp8_scaled_x), where up's rows start on a multiple of 16 (seg, the second operand after the codes)
FP8_SCALED_X_ROWS = 32


def _scaled_forward(x: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x @ W^T, its product of magnitudes) in float64 with W = s * v taken as the group-scaled forward takes it: x
    times each weight row's scales in fp32, rounded once to bf16, times v."""
    xs = (x.float()[:, None, :] * s.float()[None]).bfloat16().double()  # [n, O, K]
    return (xs * v[None]).sum(-1), (xs.abs() * v.abs()[None]).sum(-1)


def takes_scaled_form(kernel: str, operands: tuple, forward: bool, n: int) -> tuple[torch.Tensor, ...] | None:
    """(S, V) where the loaded variant's product with these operands takes the group-scaled form: the AVX512-BF16
    variant's backward with up to ``group_scaled_rows`` rows, and its fp8_block forward with up to
    ``FP8_SCALED_X_ROWS`` where up's rows start on a multiple of 16; else None."""
    form = _scaled_form(kernel, operands)
    if form is None or fused_variant() != "AVX512-BF16":
        return None
    if forward and not (kernel == "fp8_block_gemm" and n <= FP8_SCALED_X_ROWS and operands[2] % 16 == 0):
        return None
    if not forward and n > group_scaled_rows(form[2], kernel == "int4_gemm" and operands[2] is None):
        return None
    return form[0], form[1]


def forward_qmax(k: int) -> int:
    """The largest |q| of x's 16-bit rows in the AVX512-BF16 variant's int8 forward over ``k`` columns
    (int16_rows.h's forward_qmax): an int32 lane sums 2 ceil(k / 32) products of at most qmax * 128."""
    return min(32767, (2**31 - 1) // (128 * 2 * -(-k // 32)))


def int16_rows(a: torch.Tensor, scale: torch.Tensor | None, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q ``[n, cols]``, step ``[n, 1]``) in float64: a's rows (times ``scale`` per column in fp32, where given) as
    the AVX512-BF16 variant's int8 products take them (int16_rows.h): q = round(v * (qmax / max |v|)) in fp32, ties
    to even, within +-qmax, and step = max |v| / qmax in fp32."""
    v = a.float() if scale is None else a.float() * scale.float()
    top = v.abs().amax(dim=1, keepdim=True)
    inv = torch.where(top > 0, torch.tensor(float(qmax)) / top, torch.zeros(()))
    q = (v * inv).round().clamp(-qmax, qmax)
    return q.double(), (top / qmax).double()


def _int8_reference(
    a: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, forward: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(a @ W^T or a @ W in float64, the same product of magnitudes) for int8 codes ``[O, K]`` and row scales
    ``[O]``, with a as the loaded variant takes it: on the AVX512-BF16 variant a's rows as 16-bit integers
    (``int16_rows``; the backward's g times the row scale first), elsewhere a itself (the forward scales the fp32
    sums, the backward takes g times the row scale rounded once to bf16)."""
    c, s = codes.double(), scale.double()
    if fused_variant() == "AVX512-BF16":
        if forward:
            q, step = int16_rows(a, None, forward_qmax(codes.shape[1]))
            return step * (q @ c.t()) * s, step * (q.abs() @ c.abs().t()) * s
        q, step = int16_rows(a, scale, 32767)
        return step * (q @ c), step * (q.abs() @ c.abs())
    if forward:
        return (a.double() @ c.t()) * s, (a.double().abs() @ c.abs().t()) * s
    scaled = (a.double() * s).to(torch.bfloat16).double()  # g * scale, rounded once
    return scaled @ c, scaled.abs() @ c.abs()


def _reference(fmt: ExpertFormat, forward: bool, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a @ W^T or a @ W in float64, the same product of magnitudes) for gate_up of expert 0, W's values as the
    loaded variant takes them for this product."""
    scaled = takes_scaled_form(*fmt.fused_operands("gate_up", 0), forward, a.shape[0])
    if scaled is not None:
        return _scaled_forward(a, *scaled) if forward else _scaled_backward(a, *scaled)
    if isinstance(fmt, Int8Experts):
        return _int8_reference(a, fmt.gate_up[0], fmt.gate_up_scale[0], forward)
    w = fmt.dequantize(torch.bfloat16)[0][0].double()
    return (
        (a.double() @ w.t(), a.double().abs() @ w.abs().t())
        if forward
        else (a.double() @ w, a.double().abs() @ w.abs())
    )


def _check(fmt: ExpertFormat, forward: bool, n: int, accumulate: bool, seed: int = 1) -> None:
    o, k = fmt.shape("gate_up")
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, k if forward else o, generator=gen).bfloat16()
    out = torch.randn(n, o if forward else k, generator=gen).bfloat16()
    before = out.double()
    fmt.fused_gemm(load_fused(), forward, "gate_up", 0, a, out, accumulate)
    ref, mag = _reference(fmt, forward, a)
    if accumulate:
        ref, mag = ref + before, mag + before.abs()
    bound = 2.0**-8 * ref.abs() + (k if forward else o) * 2.0**-22 * mag
    err = (out.double() - ref).abs()
    worst = float((err / bound).max()) if n else 0.0
    assert worst <= 1.0, (fmt.name, forward, n, accumulate, worst)


FORMATS_UNDER_TEST = ["int8", "int4-g32-sym", "int4-g64-asym", "int4-g128-sym"]


@needs_kernels
@pytest.mark.parametrize("name", FORMATS_UNDER_TEST)
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
# AMX: past 64 rows several passes over the tiles; AVX512: the forward's dot products up to 8 rows (int4 whose rows
# its decoder writes whole: these formats; 16-32 for the others), more with each weight decoded once
# (avx512_gemm.cpp's dot_rows); the backward's group-scaled form up to 8-32 rows
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7, 8, 9, 16, 17, 24, 25, 33, 64, 65, 129, 150, 300])
def test_kernel_matches_float64(name, forward, n):
    _check(_weights(name, 256, 256), forward, n, accumulate=n % 2 == 1)


@needs_kernels
@pytest.mark.parametrize(
    "name,o,k",
    [
        ("int8", 1536, 2048),  # a 2048-wide model's gate_up (K = H = 2048)
        ("int8", 64, 7168),  # K = 7168 (DeepSeek-V3 / Kimi-K2 hidden size)
        ("int8", 34, 40),  # O and K off every tile size: 16-row blocks, 32-column steps, 64-column panels
        ("int8", 2, 1),
        ("int8", 18, 75),  # K odd and past one 64-column strip, O past one 16-row block
        ("int4-g64-sym", 1536, 2048),
        ("int4-g32-asym", 64, 96),  # K/2 = 48: a 32-column step spans the low and high nibbles
        ("int4-g32-sym", 192, 32),  # K = 32: one step, half of it high nibbles
    ],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_kernel_shapes(name, o, k, accumulate):
    fmt = _weights(name, o, k)
    for forward in (True, False):
        for n in (1, 3, 5, 7, 9, 17, 64):  # 7: the backward's band walk decoding between its dot products
            _check(fmt, forward, n, accumulate)


@needs_kernels
@pytest.mark.parametrize("o,k", [(35, 64), (33, 75)])
def test_int8_kernel_odd_rows(o, k):
    """The int8 kernel entry with an odd number of weight rows (a down projection of odd H): the backward's last
    pair of rows has one past O, read as zeros, at every row count of g (the band walk's bands of 8 to 128 pairs),
    against float64 (g as ``_int8_reference`` takes it); the forward as well."""
    gen = torch.Generator().manual_seed(4)
    codes = torch.randint(-127, 128, (o, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(o, generator=gen) * 0.01 + 0.001
    for forward in (True, False):
        for n in (1, 5, 6, 7, 8, 9, 20):
            a = torch.randn(n, k if forward else o, generator=gen).bfloat16()
            out = torch.empty(n, o if forward else k, dtype=torch.bfloat16)
            load_fused().int8_gemm(forward, a, out, codes, scale, False)
            ref, mag = _int8_reference(a, codes, scale, forward)
            bound = 2.0**-8 * ref.abs() + (k if forward else o) * 2.0**-22 * mag
            assert float(((out.double() - ref).abs() / bound).max()) <= 1.0, (o, k, forward, n)


@needs_kernels
@pytest.mark.parametrize("group,k", [(16, 128), (16, 96), (32, 96), (32, 8192), (32, 8256)])
def test_int4_kernel_off_the_table_path(group, k):
    """The int4 kernel entry with groups the format does not make (16: two per 32-column step) and a step across
    K/2 (K = 96) decodes without its one-table chunk (decoders.h's bf16x32 falls back), and a row of more groups
    than the AVX512 forward's row tables hold (258 > RowTables::kMax = 256, K = 8256; 8192: exactly 256) decodes
    chunk by chunk: still the dequantized weights, each (u - z) * s rounded once to bf16 (or, where the backward
    takes the group-scaled form, g times s rounded once, times u - z), against float64 within the bound of
    ``_check``."""
    gen = torch.Generator().manual_seed(3)
    o = 48
    packed = torch.randint(0, 256, (o, k // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(o, k // group, generator=gen) * 0.1 + 0.01).bfloat16()
    zero = torch.randint(0, 16, (o, k // group), generator=gen, dtype=torch.uint8)
    codes = torch.cat((packed & 15, packed >> 4), dim=1).double()  # byte j: column j (low), j + K/2 (high)
    step = (codes - zero.double().repeat_interleave(group, 1)) * scale.double().repeat_interleave(group, 1)
    w = step.float().bfloat16().double()
    for forward in (True, False):
        for n in (1, 9, 20):
            a = torch.randn(n, k if forward else o, generator=gen).bfloat16()
            out = torch.empty(n, o if forward else k, dtype=torch.bfloat16)
            load_fused().int4_gemm(forward, a, out, packed, scale, zero, group, False)
            ref = a.double() @ (w.t() if forward else w)
            mag = a.double().abs() @ (w.abs().t() if forward else w.abs())
            scaled = takes_scaled_form("int4_gemm", (packed, scale, zero, group), forward, n)
            if scaled is not None:
                ref, mag = _scaled_backward(a, *scaled)
            bound = 2.0**-8 * ref.abs() + (k if forward else o) * 2.0**-22 * mag
            assert float(((out.double() - ref).abs() / bound).max()) <= 1.0, (group, k, forward, n)


def assert_same_bits_on_two_threads(
    fmt: ExpertFormat, n: int, kernels: ModuleType | None = None, dtype: torch.dtype = torch.bfloat16
) -> None:
    """gate_up's forward and backward products with n rows on 1 and 2 intra-op threads are equal bit for bit
    (on ``kernels``, operands in ``dtype``; default: the default variant's, bf16)."""
    kernels = kernels or load_fused()
    o, k = fmt.shape("gate_up")
    gen = torch.Generator().manual_seed(n)
    a, g = torch.randn(n, k, generator=gen).to(dtype), torch.randn(n, o, generator=gen).to(dtype)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        y, gx = torch.empty(n, o, dtype=dtype), torch.empty(n, k, dtype=dtype)
        fmt.fused_gemm(kernels, True, "gate_up", 0, a, y, False)
        fmt.fused_gemm(kernels, False, "gate_up", 0, g, gx, False)
        results.append((y, gx))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1]), (
        fmt.name,
        n,
    )


@needs_kernels
def test_kernel_is_the_same_on_two_threads():
    """Each output element is summed by one thread in one order: 2 intra-op threads give the same bits."""
    assert_same_bits_on_two_threads(_weights("int4-g64-asym", 256, 512), 40)


def engine_case(name: str, group: int) -> tuple:
    """(weights, x, ids, w, gy) for an engine test: the Gaussian layer as int8 (``name`` "int8") or as int4 with
    ``group`` and zero points, 40 tokens routed to 2 experts each, and the output's gradient."""
    gate_up, down = gaussian()
    fmt = (
        Int8Experts.from_dense(gate_up, down)
        if name == "int8"
        else Int4Experts.from_dense(gate_up, down, group_size=group, symmetric=False)
    )
    x, ids, w = make_routing(T=40, E=gate_up.shape[0], k=2, H=gate_up.shape[2], dtype=torch.float32)
    return fmt, x, ids, w, torch.randn(40, gate_up.shape[2], generator=torch.Generator().manual_seed(5))


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4-g64-asym"])
@pytest.mark.parametrize("with_lora", [True, False], ids=["lora", "frozen"])
@pytest.mark.parametrize("workers", [1, 4])
def test_engine_with_kernels_matches_torch_path(name, with_lora, workers, four_threads):
    """Forward and every gradient of the engine module, kernels on vs off, same weights and routing: both
    compute in bf16 with fp32 sums, so they differ by bf16 roundings of intermediates only. Bound: 2^-6 of each
    quantity's max (measured: at most 1.3e-2, y in lora mode; int4 frozen bit-identical); kernels computing
    another weight (a lost scale, a wrong expert) would be off by the quantization error or O(1)."""
    fmt, x, ids, w, gy = engine_case(name, group=64)
    results = []
    for fused in (True, False):
        opts = {"compute_dtype": torch.bfloat16, "expert_workers": workers}
        module = _module(fmt, _lora(), **opts) if with_lora else _frozen(fmt, EngineOptions(**opts))
        module.engine.gemm.path = resolve_gemm_path(fmt, torch.bfloat16, AMX, fused=fused)
        assert bool(module.engine.gemm.path.fused_rows) is fused
        results.append(run_module(module, x, ids, w, gy))
    for label, err in run_errors(*results).items():
        assert err <= 2.0**-6, (label, err)


def _frozen(fmt: ExpertFormat, options: EngineOptions):
    from moetune.layer import CpuExperts

    return CpuExperts(ExpertEngine(fmt, options=options))


@needs_compiler
def test_the_kernels_build_here_or_name_the_cpu():
    """With a compiler the source builds (or the CPU is named as the reason it is not run): never a build error."""
    why = fused_unavailable()
    assert not why.startswith("building"), why


def test_no_build_on_a_cpu_without_any_variants_isa(monkeypatch):
    """Where the kernels could not run, nothing is compiled: the reason names the CPU's ISA."""
    from torch.utils import cpp_extension

    def must_not_build(**_: object) -> None:
        raise AssertionError("built on a CPU no variant runs on")

    monkeypatch.setattr(loader, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", must_not_build)
    monkeypatch.setattr(loader, "cpu_info", lambda: replace(AMX, isa=("SSE4.2",)))
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert load_fused() is None
    wanted = ", ".join(v.isa for v in loader.VARIANTS)
    assert fused_unavailable() == f"the CPU has none of {wanted} (found: SSE4.2)"


def _fake_builds(monkeypatch, isa: tuple[str, ...], refuse: dict[str, str] | None = None) -> list[str]:
    """Builds of no compiler: each returns a module of the variant its source is (``unavailable()`` from
    ``refuse``, else ""); the sources asked for are recorded in the returned list. The CPU reports ``isa``."""
    from types import SimpleNamespace

    from torch.utils import cpp_extension

    built: list[str] = []

    def fake_load(name: str, sources: list[str], **_: object) -> SimpleNamespace:
        variant = next(v for v in loader.VARIANTS if sources[0].endswith("/" + v.source))
        built.append(variant.source)
        why = (refuse or {}).get(variant.name, "")
        return SimpleNamespace(variant=variant.name, unavailable=lambda: why)

    monkeypatch.setattr(loader, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(loader, "cpu_info", lambda: replace(AMX, isa=isa))
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    return built


@pytest.mark.parametrize(
    "isa,expected",
    [
        (("AMX-BF16", "AVX512-BF16", "AVX512F", "AVX2"), "AMX-BF16"),
        (("AVX512-BF16", "AVX512F", "AVX2"), "AVX512-BF16"),
        (("AMX-BF16",), "AMX-BF16"),
        (("AVX512F", "AVX2"), "AVX2"),  # AVX512 without BF16 (Skylake-X, Cascade Lake): fp32 compute
        (("AVX2",), "AVX2"),
    ],
)
def test_the_registry_builds_the_best_variant_the_cpu_has(monkeypatch, isa, expected):
    built = _fake_builds(monkeypatch, isa)
    assert load_fused().variant == expected and fused_variant() == expected
    assert built == [next(v.source for v in loader.VARIANTS if v.name == expected)]  # only the one taken
    assert fused_unavailable() == ""


def test_a_variant_that_cannot_run_falls_back_to_the_next(monkeypatch, caplog):
    built = _fake_builds(
        monkeypatch, ("AMX-BF16", "AVX512-BF16"), refuse={"AMX-BF16": "the kernel refused AMX tile state"}
    )
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        assert fused_variant() == "AVX512-BF16"
    assert built == ["amx_gemm.cpp", "avx512_gemm.cpp"]
    assert any("AMX-BF16: the kernel refused AMX tile state" in r.getMessage() for r in caplog.records)


@needs_compiler
def test_every_variant_this_cpu_runs_builds_here():
    """Each variant whose ISA this CPU has builds and loads (``load_variant`` raises with the compiler's error):
    where the best one failed to build, the registry would fall back to the next (a warning) and the kernel tests
    above would skip as if the CPU lacked it."""
    runnable = [v.name for v in loader.VARIANTS if v.isa in loader.cpu_info().isa]
    for name in runnable:
        assert load_variant(name).variant == name
    assert fused_variant() == (runnable[0] if runnable else "")


def test_a_cpu_with_neither_isa_takes_the_torch_path_and_says_why(monkeypatch, caplog):
    built = _fake_builds(monkeypatch, ("AVX512F", "SSE4.2"))
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert load_fused() is None and fused_variant() == ""
    assert built == []
    why = "the CPU has none of AMX-BF16, AVX512-BF16, AVX2 (found: AVX512F, SSE4.2)"
    assert fused_unavailable() == why
    assert [r.getMessage() for r in caplog.records if r.name == loader.__name__] == [
        f"moetune fused kernels not used ({why}); the engine uses the torch path"
    ]
    int8 = FORMATS.get("int8").from_dense(*gaussian(e=1))
    assert resolve_gemm_path(int8, torch.bfloat16, AMX).fused_rows == 0


def test_the_build_key_covers_every_header_a_variant_includes():
    """A changed shared header must rebuild every variant: each variant's hashed files include all of them (the
    fp32 AVX2 variant all but layouts.h, the bf16 pair layouts it does not use), and a variant's own loops
    (few_rows.h: the AVX512-BF16 variant's loops for few rows; int16_rows.h and int8_rows.h: its int8 loops;
    avx2_int16.h and avx2_int8.h: the AVX2 variant's int8 loops and its int4 ones with 8-bit rows; rows_layout.h:
    the integer rows both of them take) are in its key."""
    own = {
        "AVX512-BF16": {"few_rows.h", "int16_rows.h", "int8_rows.h", "rows_layout.h"},
        "AVX2": {"avx2_int16.h", "avx2_int8.h", "rows_layout.h"},
    }
    headers = {p.name for p in loader.HERE.glob("*.h")} - set().union(*own.values())
    for variant in loader.VARIANTS:
        names = [p.name for p in variant.sources()]
        wanted = headers - {"layouts.h"} if variant.compute == torch.float32 else set(headers)
        wanted |= own.get(variant.name, set())
        assert names[0] == variant.source and set(names[1:]) == wanted, (variant, names)


def test_the_build_key_names_the_torch_install_and_the_sources_folder(monkeypatch, tmp_path):
    """Two environments with the same torch version (two virtualenvs), or two checkouts of moetune, build into two
    folders: torch's builder writes the torch install's include folders and the sources' paths into the build
    commands, so one shared folder was rebuilt by each in turn. The same install and checkout keep their key."""
    here = loader.build_key(b"sources", ["-O3"], loader.HERE)
    assert loader.build_key(b"sources", ["-O3"], loader.HERE) == here
    assert loader.build_key(b"sources", ["-O3"], tmp_path / "worktree/moetune/engine/kernels") != here
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "venv2/site-packages/torch/__init__.py"))
    assert loader.build_key(b"sources", ["-O3"], loader.HERE) != here


def test_build_failure_falls_back_to_the_torch_path_with_one_warning(monkeypatch, caplog):
    """A failed build (no compiler, a compile error): one logged warning naming the cause and the torch path,
    load_fused() None, and engines resolve the torch path."""
    from torch.utils import cpp_extension

    def broken(**_: object) -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(loader, "_state", {})  # this process's build result, restored afterwards
    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(loader, "cpu_info", lambda: AMX)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger=loader.__name__):
        assert load_fused() is None and load_fused() is None
    warnings = [r.getMessage() for r in caplog.records if r.name == loader.__name__]
    assert len(warnings) == 1, warnings
    assert "Ninja is required" in warnings[0] and "torch path" in warnings[0]
    int8 = FORMATS.get("int8").from_dense(*gaussian(e=1))
    path = resolve_gemm_path(int8, torch.bfloat16, AMX)
    assert path.fused_rows == 0 and "fused" not in path.describe()
    y, _ = ExpertEngine(int8, options=EngineOptions(compute_dtype=torch.bfloat16)).forward(
        *make_routing(T=4, E=1, k=1, H=gaussian(e=1)[0].shape[2], dtype=torch.bfloat16), save=False
    )
    assert torch.isfinite(y).all()


def test_a_build_finding_the_lock_taken_names_the_lock_file(monkeypatch, tmp_path, capsys):
    """torch's builder waits for its lock file without a word (for ever where a killed build left it): before it
    waits, the build says it is compiling and which lock it waits for, and how to release a stale one; a build with
    no lock file says only that it is compiling; a load of a built library names the lock only once it is stale."""
    from torch.utils import cpp_extension

    built: list[str] = []

    def fake_load(name: str, **_: object) -> None:
        built.append(name)
        raise RuntimeError("stop here")  # the rest of a build is the other tests'

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    variant = variant_named("AVX2")
    assert variant is not None
    for held in (False, True):
        if held:
            (tmp_path / built[0]).mkdir()
            (tmp_path / built[0] / "lock").touch()
        module, why = loader._build_variant(variant)
        assert module is None and "stop here" in why
        err = capsys.readouterr().err
        assert "compiling the AVX2 kernels" in err
        assert ("waiting for the build lock" in err) is held, err
    assert str(tmp_path / built[0] / "lock") in err and "delete that file" in err
    # built already: torch still takes the lock for its up-to-date check, so only a stale one is named
    lock = tmp_path / built[0] / "lock"
    (tmp_path / built[0] / f"{built[0]}.so").touch()
    for age, named in ((1.0, False), (loader._STALE_LOAD_LOCK_S + 5, True)):
        os.utime(lock, (time.time() - age, time.time() - age))
        loader._build_variant(variant)
        err = capsys.readouterr().err
        assert "compiling" not in err and ("waiting for the build lock" in err) is named, (age, err)


def test_env_turns_the_kernels_off_and_rejects_other_values(monkeypatch):
    int8 = FORMATS.get("int8").from_dense(*gaussian(e=1))
    monkeypatch.setenv(KERNELS_ENV, "off")
    assert resolve_gemm_path(int8, torch.bfloat16, AMX).fused_rows == 0
    assert fused_unavailable() == f"{KERNELS_ENV}=off"
    monkeypatch.setenv(KERNELS_ENV, "maybe")
    with pytest.raises(ConfigError, match=f"{KERNELS_ENV} must be 'on' or 'off'.*'maybe'"):
        resolve_gemm_path(int8, torch.bfloat16, AMX)
