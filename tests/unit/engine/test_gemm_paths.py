"""Every GEMM path (``gemm.resolve_gemm_path``) against a float64 reference, forward and every gradient.

The path an engine takes depends on the CPU (whole converted matrices with AMX-BF16, cache-sized row blocks
elsewhere) and on the format (int8's codes with the per-row scale moved onto the GEMM's small side, or
dequantized tiles), so each is pinned here in turn on any machine. The reference is a float64 engine on the
format's own dequantized weights: whatever path runs, the effective weights must be the format's.

Bounds (max-abs error over the reference's max-abs, per quantity): fp32 compute 1e-5 (rounding only; 5e-4 for
the fused kernels of a variant taking the format's activations as 16-bit integer rows, the AVX2 variant's int8:
half a step, 2^-16 of a row's largest magnitude, per value; measured 7e-5 to 1e-4);
bf16 compute 2e-2, and at most twice the error of a dense bf16 engine holding ``dequantize(bf16)`` (the
accuracy bf16 compute has anyway: 5-8e-3 here, measured). Experts with few rows and with many (which take
other branches: the weight-left GEMM, scaled codes only up to ``SMALL_ROWS``) both run. A path that dropped the scale, applied it on the
wrong side, or read another expert's rows is off by the quantization error (~1e-2 for int8) or by O(1).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from moetune.doctor.engine import KERNELS_LINE, gemm_paths
from moetune.engine import DenseExperts, EngineOptions, ExpertEngine, ExpertFormat
from moetune.engine import gemm as gemm_module
from moetune.engine.formats import FORMATS, Int8Experts
from moetune.engine.formats.dense import BF16_FUSED_MAX_ROWS
from moetune.engine.gemm import Conversion, GemmPath, resolve_gemm_path
from moetune.engine.kernels import KERNELS_ENV, fused_variant, load_fused, variant_named
from moetune.engine.kernels.loader import int8_rows_formats
from moetune.layer import CpuExperts
from moetune.sysinfo import CpuInfo, cpu_info
from tests.unit.engine.test_formats import QUANTIZED, E, H, _lora, _module, gaussian
from tests.unit.engine_cases import make_routing, run_module

pytestmark = pytest.mark.usefixtures("one_thread")

K = 2
T_POOL = 64  # ~32 rows per expert: the scaled-codes branch


def _cpu(*isa: str) -> CpuInfo:
    return CpuInfo(model="test", isa=isa, logical_cpus=2, physical_cores=2, numa_nodes=1)


def _variant_compute() -> torch.dtype | None:
    """The compute dtype of the kernel variant that loads here (bf16, or fp32 for AVX2), None without one."""
    spec = variant_named(fused_variant())
    return spec.compute if spec is not None else None


def _variant_cpu() -> CpuInfo:
    """A CPU with the ISA of the variant that loads here and nothing better (an AMX one where none loads)."""
    spec = variant_named(fused_variant())
    if spec is None or spec.isa == "AMX-BF16":
        return _cpu("AMX-BF16", "AVX512-BF16", "AVX512F", "AVX2")
    return _cpu(spec.isa, "AVX512F", "AVX2") if spec.isa == "AVX512-BF16" else _cpu(spec.isa)


def _paths(fmt: ExpertFormat, compute: torch.dtype) -> list[GemmPath]:
    conversions = [Conversion.DEQUANTIZED]
    if compute in fmt.SCALED_TILE_DTYPES:
        conversions.append(Conversion.SCALED_CODES)
    return [GemmPath(c, whole_tiles=w) for c in conversions for w in (True, False)]


def _fused_paths(fmt: ExpertFormat, compute: torch.dtype) -> list[GemmPath]:
    """The fused kernels' path where this machine runs them (experts above the variant's ``FUSED_MAX_ROWS`` take
    the torch one)."""
    variant = fused_variant()
    rows = fmt.FUSED_MAX_ROWS.get(variant, 0)
    if compute != _variant_compute() or not rows:
        return []
    return [GemmPath(p.conversion, p.whole_tiles, rows, variant) for p in _paths(fmt, compute)[-1:]]


def _int16_rows(path: GemmPath, fmt: ExpertFormat) -> bool:
    """Whether ``path``'s fused kernels take ``fmt``'s activations as 16-bit integer rows."""
    spec = variant_named(path.fused_variant)
    return bool(path.fused_rows) and spec is not None and fmt.name in spec.int16_rows


def _errors(y, grads, ref_y, ref_grads) -> dict[str, float]:
    pairs = [("y", y, ref_y)] + [(n, grads[n], ref_grads[n]) for n in ref_grads]
    return {
        n: float((got.double() - ref.double()).abs().max() / ref.double().abs().max())
        for n, got, ref in pairs
    }


@pytest.fixture(scope="module")
def formats() -> dict[str, ExpertFormat]:
    gate_up, down = gaussian()
    return {c.id: c.build(gate_up, down) for c in QUANTIZED}


def _build(weights: ExpertFormat, lora: dict[str, torch.Tensor] | None, compute: torch.dtype) -> CpuExperts:
    """The engine module on ``weights``, with expert LoRA (lora mode) or without (frozen mode: the forward
    GEMMs then write their output instead of adding to the LoRA term)."""
    if lora is not None:
        return _module(weights, lora, compute_dtype=compute)
    return CpuExperts(ExpertEngine(weights, options=EngineOptions(compute_dtype=compute)))


@pytest.mark.parametrize(
    "case", [c for c in QUANTIZED if c.id in ("int8", "int4-g64-asym", "fp8_block")], ids=str
)
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [24, 300])  # ~12 rows per expert, and ~150 > gemm.SMALL_ROWS
@pytest.mark.parametrize("with_lora", [True, False], ids=["lora", "frozen"])
def test_every_gemm_path_matches_float64(case, compute, T, with_lora, formats):
    fmt = formats[case.id]
    x, ids, w = make_routing(T=T, E=E, k=K, H=H, dtype=torch.float32)
    gy = torch.randn(T, H, generator=torch.Generator().manual_seed(5))
    lora = _lora() if with_lora else None
    lora64 = {n: t.double() for n, t in lora.items()} if lora is not None else None
    ref = run_module(
        _build(DenseExperts(*fmt.dequantize(torch.float64)), lora64, torch.float64),
        x.double(),
        ids,
        w.double(),
        gy.double(),
    )
    dense = _errors(
        *run_module(_build(DenseExperts(*fmt.dequantize(compute)), lora, compute), x, ids, w, gy), *ref
    )
    for path in _paths(fmt, compute) + _fused_paths(fmt, compute):
        module = _build(fmt, lora, compute)
        module.engine.gemm.path = path
        errors = _errors(*run_module(module, x, ids, w, gy), *ref)
        for name, err in errors.items():
            if compute == torch.float32:
                assert err <= (5e-4 if _int16_rows(path, fmt) else 1e-5), (path, name, err)
            else:
                assert err <= min(2e-2, max(2 * dense[name], 1e-3)), (path, name, err, dense[name])


def test_int8_scaled_codes_path_and_its_dtypes(formats):
    """int8's scaled tile is its codes (exactly) and row scales: their product is ``dequantize``'s weight."""
    fmt = formats["int8"]
    assert isinstance(fmt, Int8Experts)
    full = fmt.dequantize(torch.float32)[0]  # the fp32 product of code and scale
    for dtype in Int8Experts.SCALED_TILE_DTYPES:
        buf = torch.empty(fmt.shape("gate_up"), dtype=dtype)
        codes, scale = fmt.scaled_tile("gate_up", 2, dtype, buf, slice(None))
        assert codes.data_ptr() == buf.data_ptr() and torch.equal(codes.double(), fmt.gate_up[2].double())
        assert scale.dtype == torch.float32 and torch.equal(codes.float() * scale[:, None], full[2])
        part, part_scale = fmt.scaled_tile(
            "gate_up", 2, dtype, torch.empty(16, H, dtype=dtype), slice(16, 32)
        )
        assert torch.equal(part.double(), fmt.gate_up[2, 16:32].double())
        assert torch.equal(part_scale, fmt.gate_up_scale[2, 16:32])


def test_resolve_gemm_path_per_format_dtype_and_cpu(formats):
    gate_up, down = gaussian()
    amx, avx512 = _cpu("AMX-BF16", "AVX512-BF16", "AVX512F", "AVX2"), _cpu("AVX512-BF16", "AVX512F", "AVX2")
    bf16 = DenseExperts(gate_up.bfloat16(), down.bfloat16())
    assert resolve_gemm_path(bf16, torch.bfloat16, amx).conversion is Conversion.VIEW
    assert resolve_gemm_path(bf16, torch.float32, avx512, fused=False) == GemmPath(
        Conversion.DEQUANTIZED, whole_tiles=False, dense=True
    )
    int8, int4 = formats["int8"], formats["int4-g64-sym"]
    assert resolve_gemm_path(int8, torch.bfloat16, amx, fused=False) == GemmPath(
        Conversion.SCALED_CODES, whole_tiles=True
    )
    assert resolve_gemm_path(int8, torch.bfloat16, avx512, fused=False) == GemmPath(
        Conversion.SCALED_CODES, whole_tiles=False
    )
    assert resolve_gemm_path(int8, torch.float32, amx, fused=False) == GemmPath(
        Conversion.SCALED_CODES, whole_tiles=False
    )
    assert resolve_gemm_path(int4, torch.bfloat16, amx, fused=False) == GemmPath(
        Conversion.DEQUANTIZED, whole_tiles=True
    )
    assert resolve_gemm_path(int4, torch.float32, _cpu("AVX2")).whole_tiles is False
    assert "per-row scale" in resolve_gemm_path(int8, torch.bfloat16, amx, fused=False).describe()
    # the fused kernels where a variant loads, with the format's row threshold for it; never in the other compute
    # dtype (the AVX2 variant computes in fp32, the others in bf16), nor for a CPU without the variant's ISA
    variant, own = fused_variant(), _variant_cpu()
    compute = _variant_compute() or torch.bfloat16
    other = torch.float32 if compute == torch.bfloat16 else torch.bfloat16
    for fmt in (int8, int4):
        path = resolve_gemm_path(fmt, compute, own)
        assert path.fused_rows == fmt.FUSED_MAX_ROWS.get(variant, 0)
        assert path.fused_variant == (variant if path.fused_rows else "")
        assert (f"fused kernel ({variant}," in path.describe()) is bool(variant)
        assert resolve_gemm_path(fmt, other, own).fused_rows == 0
        assert resolve_gemm_path(fmt, compute, _cpu("SSE4.2")).fused_rows == 0
        spec = variant_named(variant)
        int16 = spec is not None and fmt is int8 and "int8" in spec.int16_rows  # int16_rows.h, avx2_int16.h
        assert not path.dense and path.int16_rows is int16
        assert ("codes dequantized in registers" in path.describe()) is (bool(variant) and not int16)
        assert ("16-bit integer rows" in path.describe()) is int16
    # dense weights have no codes: on the fp32 variant (AVX2) the kernels widen bf16 weights in registers
    dense = resolve_gemm_path(bf16, torch.float32, _cpu("AVX2"))
    assert dense.dense and "codes" not in dense.describe()
    fused_dense = GemmPath(
        Conversion.DEQUANTIZED, whole_tiles=False, fused_rows=256, fused_variant="AVX2", dense=True
    )
    assert "fused kernel (AVX2, weights widened to fp32 in registers)" in fused_dense.describe()


@pytest.mark.parametrize(
    "isa,int8_line",
    [
        (("AMX-BF16", "AVX512-BF16", "AVX2"), "int8: computes in bfloat16; experts with <= 128 rows: codes"),
        (("AVX512-BF16", "AVX2"), "int8: computes in bfloat16; experts with <= 128 rows: codes"),
        (("AVX2",), "int8: computes in float32; experts with <= 128 rows: codes"),
    ],
)
def test_doctor_names_each_formats_path(monkeypatch, isa, int8_line):
    monkeypatch.setenv(KERNELS_ENV, "off")  # the torch path's lines (the fused kernels': next test)
    cpu = _cpu(*isa)
    monkeypatch.setattr("moetune.engine.plan.cpu_info", lambda: cpu)
    monkeypatch.setattr("moetune.engine.gemm.cpu_info", lambda: cpu)
    lines = gemm_paths()
    by_name = {line.split(":")[0]: line for line in lines}
    assert by_name.pop(KERNELS_LINE) == (
        f"{KERNELS_LINE}: not used ({KERNELS_ENV}=off); the torch path runs, each expert's op sequences in Python"
    )
    a8 = {
        f"{n} with int8_activations" for n in int8_rows_formats()
    }  # the opt-in's lines: refused, kernels off
    assert set(by_name) == {"bf16 (dense)" if n == "dense" else n for n in FORMATS.names()} | a8
    assert all(
        f"refused here (int8_activations needs the fused kernels, which are off ({KERNELS_ENV}=off)"
        in by_name[n]
        for n in a8
    )
    assert by_name["int8"].startswith(int8_line)
    whole = "AMX-BF16" in isa
    assert by_name["int4"].endswith("in whole matrices" if whole else "in cache-sized row blocks")
    native = "AVX512-BF16" in isa
    assert by_name["bf16 (dense)"].endswith(
        "no conversion)" if native else "weights dequantized, in cache-sized row blocks"
    )


@pytest.mark.skipif(load_fused() is None, reason="the fused kernels do not load here (see the logged reason)")
def test_doctor_names_the_fused_kernels(monkeypatch):
    own = _variant_cpu()  # a CPU whose compute dtype is the loaded variant's
    monkeypatch.setattr("moetune.engine.plan.cpu_info", lambda: own)
    monkeypatch.setattr("moetune.engine.gemm.cpu_info", lambda: own)
    by_name = {line.split(":")[0]: line for line in gemm_paths()}
    variant = fused_variant()
    assert by_name[KERNELS_LINE] == (
        f"{KERNELS_LINE}: {variant} variant built and used, with each expert's op sequences (kernels/ops.h)"
    )
    for name in ("int8", "int4", "fp8_block", "mxfp4"):
        rows = FORMATS.get(name).FUSED_MAX_ROWS[variant]
        assert f"experts with <= {rows} rows: fused kernel ({variant}, codes" in by_name[name]
    # dense bf16 weights: their own kernel where the variant has an entry for them (AVX512-BF16, AVX2)
    assert (f"kernel ({variant}," in by_name["bf16 (dense)"]) is (variant in BF16_FUSED_MAX_ROWS)


def test_scaled_codes_on_the_expert_pool_equal_one_expert_at_a_time(formats, four_threads):
    """Per-thread scratch (code tiles, the transposed result, the scaled gradient) must not leak between experts
    computed at once: four workers give exactly what one expert at a time gives."""
    fmt = formats["int8"]
    x, ids, w = make_routing(T=T_POOL, E=E, k=K, H=H, dtype=torch.float32)
    gy = torch.randn(T_POOL, H, generator=torch.Generator().manual_seed(5))
    results = []
    for workers in (1, 4):
        module = _module(fmt, _lora(), compute_dtype=torch.bfloat16, expert_workers=workers)
        module.engine.gemm.path = GemmPath(Conversion.SCALED_CODES, whole_tiles=True)
        results.append(run_module(module, x, ids, w, gy))
    (y1, g1), (y4, g4) = results
    assert torch.equal(y1, y4)
    for name in g1:
        assert torch.equal(g1[name], g4[name]), name


def test_replacing_the_weights_resolves_the_path_again(formats):
    """An engine whose int8 weights are swapped for dense ones (as a reference in the loading tests is) must not
    keep reading them as scaled codes."""
    engine = ExpertEngine(formats["int8"], options=EngineOptions(compute_dtype=torch.bfloat16))
    assert engine.gemm.path.conversion is Conversion.SCALED_CODES
    dense = DenseExperts(*formats["int8"].dequantize(torch.bfloat16))
    engine.weights = dense
    assert engine.weights is dense and engine.gemm.path.conversion is Conversion.VIEW
    x, ids, w = make_routing(T=8, E=E, k=K, H=H, dtype=torch.bfloat16)
    y, _ = engine.forward(x, ids, w, save=False)
    y_ref, _ = ExpertEngine(dense, options=EngineOptions(compute_dtype=torch.bfloat16)).forward(
        x, ids, w, save=False
    )
    assert torch.equal(y, y_ref)


def test_a_float32_asked_for_keeps_int8_off_the_16_bit_rows(formats, monkeypatch):
    """The AVX2 variant computes in fp32 and takes int8's activations as 16-bit integer rows. Where fp32 is the
    dtype resolved for a CPU without bf16 (a bf16 load on an AVX2-only CPU) int8 takes those kernels; where it was
    asked for (a float32 load: ``exact``) int8 keeps the torch path, unrounded, as the float32 load promises. Other
    formats take the kernels either way. The AVX2 variant stands in as the loaded one (no build: the path is only
    resolved)."""
    monkeypatch.setattr(gemm_module, "fused_kernels", lambda: SimpleNamespace(variant="AVX2"))
    avx2 = _cpu("AVX2")
    int8, int4 = formats["int8"], formats["int4-g64-sym"]
    resolved = resolve_gemm_path(int8, torch.float32, avx2)
    assert resolved.fused_rows == int8.FUSED_MAX_ROWS["AVX2"] and resolved.int16_rows
    exact = resolve_gemm_path(int8, torch.float32, avx2, exact=True)
    assert exact.fused_rows == 0 and not exact.int16_rows and "fused" not in exact.describe()
    assert resolve_gemm_path(int4, torch.float32, avx2, exact=True).fused_rows == int4.FUSED_MAX_ROWS["AVX2"]
    # the engine is exact where its options ask for float32 (what a float32 load sets)
    for fmt, rows in ((int8, 0), (int4, int4.FUSED_MAX_ROWS["AVX2"] if "AVX2" in cpu_info().isa else 0)):
        asked = ExpertEngine(fmt, options=EngineOptions(compute_dtype=torch.float32))
        assert asked.gemm.path.fused_rows == rows, fmt.name
