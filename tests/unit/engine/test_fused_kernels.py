"""The compiled fused kernels (``moetune.engine.kernels``) against float64 references, and their fallback.

Each kernel product is compared with float64 arithmetic on the format's own weights: int8 as ``codes`` times the
fp32 row scale (the backward's ``g * scale`` rounded once to bf16, the torch path's definition), int4 as
``dequantize(bf16)`` (each weight rounded once to bf16, as the torch path's tiles are). Bound per element:
``2^-8 |ref|`` (the output's one rounding to bf16, half an ulp) plus ``K * 2^-22 * (|a| @ |W|^T + |out before|)``
(fp32 sums over K terms, with room). A dropped scale, a wrong nibble, another row's codes or a lost accumulation
are off by the quantization step or by O(1), far outside it.

The engine end to end (lora and frozen mode) with the kernels on is compared with the same engine on the torch
path; ``test_gemm_paths`` also runs the fused path against a float64 engine.

Without a C++ compiler the kernel tests are skipped (the reason names it); on a CPU without AMX-BF16 the
build is still checked, and the kernel products are skipped naming the CPU.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import replace

import pytest
import torch

from moetune.engine import EngineOptions, ExpertEngine, ExpertFormat
from moetune.engine.formats import FORMATS, Int4Experts, Int8Experts
from moetune.engine.gemm import resolve_gemm_path
from moetune.engine.kernels import KERNELS_ENV, fused_unavailable, load_fused, loader
from moetune.errors import ConfigError
from moetune.sysinfo import CpuInfo
from tests.unit.engine.test_formats import _lora, _module, gaussian
from tests.unit.engine_cases import make_routing, run_module

pytestmark = pytest.mark.usefixtures("one_thread")

HAS_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
needs_compiler = pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler (c++/g++) on PATH")
needs_kernels = pytest.mark.skipif(
    not HAS_COMPILER or load_fused() is None,
    reason=f"the fused kernels do not run here: {fused_unavailable() if HAS_COMPILER else 'no C++ compiler'}",
)
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


def _reference(fmt: ExpertFormat, forward: bool, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a @ W^T or a @ W in float64, the same product of magnitudes) for gate_up of expert 0."""
    if isinstance(fmt, Int8Experts):
        codes, scale = fmt.gate_up[0].double(), fmt.gate_up_scale[0].double()
        if forward:
            ref = (a.double() @ codes.t()) * scale
            mag = (a.double().abs() @ codes.abs().t()) * scale
        else:
            scaled = (a.double() * scale).to(torch.bfloat16).double()  # g * scale, rounded once
            ref, mag = scaled @ codes, scaled.abs() @ codes.abs()
        return ref, mag
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
@pytest.mark.parametrize("n", [1, 7, 16, 33, 64, 65, 150, 300])  # past 64 rows: several passes over the tiles
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
        ("int4-g64-sym", 1536, 2048),
        ("int4-g32-asym", 64, 96),  # K/2 = 48: a 32-column step spans the low and high nibbles
        ("int4-g32-sym", 192, 32),  # K = 32: one step, half of it high nibbles
    ],
)
@pytest.mark.parametrize("accumulate", [False, True])
def test_kernel_shapes(name, o, k, accumulate):
    fmt = _weights(name, o, k)
    for forward in (True, False):
        for n in (5, 64):
            _check(fmt, forward, n, accumulate)


@needs_kernels
def test_kernel_is_the_same_on_two_threads():
    """Each output element is summed by one thread in one order: 2 intra-op threads give the same bits."""
    fmt = _weights("int4-g64-asym", 256, 512)
    a = torch.randn(40, 512).bfloat16()
    g = torch.randn(40, 256).bfloat16()
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        y, gx = torch.empty(40, 256, dtype=torch.bfloat16), torch.empty(40, 512, dtype=torch.bfloat16)
        fmt.fused_gemm(load_fused(), True, "gate_up", 0, a, y, False)
        fmt.fused_gemm(load_fused(), False, "gate_up", 0, g, gx, False)
        results.append((y, gx))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@needs_kernels
@pytest.mark.parametrize("name", ["int8", "int4-g64-asym"])
@pytest.mark.parametrize("with_lora", [True, False], ids=["lora", "frozen"])
@pytest.mark.parametrize("workers", [1, 4])
def test_engine_with_kernels_matches_torch_path(name, with_lora, workers, four_threads):
    """Forward and every gradient of the engine module, kernels on vs off, same weights and routing: both
    compute in bf16 with fp32 sums, so they differ by bf16 roundings of intermediates only. Bound: 2^-6 of each
    quantity's max (measured: at most 1.3e-2, y in lora mode; int4 frozen bit-identical); kernels computing
    another weight (a lost scale, a wrong expert) would be off by the quantization error or O(1)."""
    gate_up, down = gaussian()
    fmt = (
        Int8Experts.from_dense(gate_up, down)
        if name == "int8"
        else Int4Experts.from_dense(gate_up, down, group_size=64, symmetric=False)
    )
    x, ids, w = make_routing(T=40, E=gate_up.shape[0], k=2, H=gate_up.shape[2], dtype=torch.float32)
    gy = torch.randn(40, gate_up.shape[2], generator=torch.Generator().manual_seed(5))
    results = []
    for fused in (True, False):
        opts = {"compute_dtype": torch.bfloat16, "expert_workers": workers}
        module = _module(fmt, _lora(), **opts) if with_lora else _frozen(fmt, EngineOptions(**opts))
        module.engine.gemm.path = resolve_gemm_path(fmt, torch.bfloat16, AMX, fused=fused)
        assert bool(module.engine.gemm.path.fused_rows) is fused
        results.append(run_module(module, x, ids, w, gy))
    (y_on, g_on), (y_off, g_off) = results
    pairs = [("y", y_on, y_off)] + [(n, g_on[n], g_off[n]) for n in g_off]
    for label, on, off in pairs:
        err = float((on.double() - off.double()).abs().max() / off.double().abs().max())
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
    monkeypatch.setattr(loader, "cpu_info", lambda: replace(AMX, isa=("AVX2",)))
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert load_fused() is None
    wanted = ", ".join(v.isa for v in loader.VARIANTS)
    assert fused_unavailable() == f"the CPU has none of {wanted} (found: AVX2)"


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


def test_env_turns_the_kernels_off_and_rejects_other_values(monkeypatch):
    int8 = FORMATS.get("int8").from_dense(*gaussian(e=1))
    monkeypatch.setenv(KERNELS_ENV, "off")
    assert resolve_gemm_path(int8, torch.bfloat16, AMX).fused_rows == 0
    assert fused_unavailable() == f"{KERNELS_ENV}=off"
    monkeypatch.setenv(KERNELS_ENV, "maybe")
    with pytest.raises(ConfigError, match=f"{KERNELS_ENV} must be 'on' or 'off'.*'maybe'"):
        resolve_gemm_path(int8, torch.bfloat16, AMX)
