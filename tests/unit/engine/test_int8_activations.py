"""The int8 and int4 formats' opt-in ``int8_activations``: the AVX512-BF16 variant's ``int8_gemm_a8`` and
``int4_gemm_a8`` (``kernels/int8_rows.h``) and the AVX2 variant's ``int4_gemm_a8`` (``kernels/avx2_int8.h``, fp32
operands) against float64 references, the engine on them, and the options and errors around them.

The kernel rounds each row of a (x forward; g times the row scales backward) to 8-bit integers, q = round(v * (127 /
max |v|)) in fp32 (ties to even), step = max |v| / 127 (``int16_rows`` with qmax 127), and multiplies q with the
codes exactly. Two references:

* the same rounding in float64, step * (q @ codes) (* the row scales forward): the kernel's int32 sums are exact, so
  it may differ only by the output's rounding to its dtype (bf16: 2^-8 |ref|; fp32: 2^-23) and fp32 roundings after
  the integer sums (bounded by K * 2^-22 times the product of magnitudes of q and the biased codes |c| + 128, the
  operands vpdpbusd takes);
* the unrounded product a @ W: off by at most half a step per value of a, (step / 2) * sum |W| per output, plus the
  same output rounding: the error the option documents.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetune.config.experts import ExpertOptions
from moetune.engine import EngineOptions, ExpertEngine
from moetune.engine.formats import FORMATS, Int8Experts
from moetune.engine.gemm import int8_rows_problem, resolve_gemm_path
from moetune.engine.kernels import KERNELS_ENV, load_variant
from moetune.engine.kernels.loader import VARIANTS, variant_named
from moetune.errors import ConfigError, EngineError
from moetune.loading import LoadOptions
from moetune.sysinfo import CpuInfo, cpu_info
from tests.unit.engine.test_formats import _lora, _module, gaussian
from tests.unit.engine.test_fused_kernels import AMX, HAS_COMPILER, engine_case, int16_rows
from tests.unit.engine_cases import run_errors, run_module

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[3]


def _variant_or_why(name: str) -> str:
    """Why the kernel variant ``name`` cannot run here, or ""."""
    if not HAS_COMPILER:
        return "no C++ compiler (c++/g++) on PATH"
    variant = variant_named(name)
    assert variant is not None
    if variant.isa not in cpu_info().isa:
        return f"the CPU has no {variant.isa} ({', '.join(cpu_info().isa)}): its int8_activations are refused here"
    return ""


def _runs_here(name: str) -> pytest.MarkDecorator:
    """Skip unless the kernel variant ``name`` runs here."""
    return pytest.mark.skipif(bool(_variant_or_why(name)), reason=_variant_or_why(name))


needs_a8 = _runs_here("AVX512-BF16")
# the variants with int4_gemm_a8, each skipped where it cannot run
INT4_A8 = [pytest.param(v.name, marks=_runs_here(v.name)) for v in VARIANTS if "int4" in v.int8_rows]
AVX2 = CpuInfo(model="test", isa=("AVX2",), logical_cpus=2, physical_cores=2, numa_nodes=1)


def _codes(o: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-127, 128, (o, k), generator=gen, dtype=torch.int8)
    codes[0, : min(k, 3)] = -128  # codes from elsewhere may hold -128: read as they are
    return codes, torch.rand(o, generator=gen) * 0.02 + 1e-3


def _assert_rounded(out: torch.Tensor, ref: torch.Tensor, mag: torch.Tensor, before, terms: int) -> None:
    """out within the output's rounding to its dtype (bf16: 2^-8 |ref|, fp32: 2^-23) and fp32 roundings after the
    exact integer sums (terms 2^-22 mag) of ref (plus ``before``, out's values before an accumulating product)."""
    if before is not None:
        ref, mag = ref + before, mag + before.abs()
    rounding = 2.0**-8 if out.dtype == torch.bfloat16 else 2.0**-23
    bound = rounding * ref.abs() + terms * 2.0**-22 * mag + 1e-30
    worst = float(((out.double() - ref).abs() / bound).max())
    assert worst <= 1.0, worst


def _run(forward: bool, a: torch.Tensor, out: torch.Tensor, codes, scale, accumulate: bool) -> None:
    load_variant("AVX512-BF16").int8_gemm_a8(forward, a, out, codes, scale, accumulate)


@needs_a8
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
@pytest.mark.parametrize("o,k", [(64, 128), (37, 100), (130, 70), (96, 640), (300, 64), (5, 4200)])
@pytest.mark.parametrize("n", [1, 3, 4, 5, 8, 13, 15, 70])
@pytest.mark.parametrize("accumulate", [False, True])
def test_a8_kernel_is_the_rounded_product(forward, o, k, n, accumulate):
    codes, scale = _codes(o, k, seed=o + k)
    gen = torch.Generator().manual_seed(n)
    a = (torch.randn(n, k if forward else o, generator=gen) * torch.rand(n, 1, generator=gen) * 4).bfloat16()
    out = torch.randn(n, o if forward else k, generator=gen).bfloat16()
    before = out.double()
    _run(forward, a, out, codes, scale, accumulate)
    c, s = codes.double(), scale.double()
    biased = c.abs() + 128
    if forward:
        q, step = int16_rows(a, None, 127)
        ref, mag = step * (q @ c.t()) * s, step * (q.abs() @ biased.t()) * s
    else:
        q, step = int16_rows(a, scale, 127)
        ref, mag = step * (q @ c), step * (q.abs() @ biased)
    _assert_rounded(out, ref, mag, before if accumulate else None, k if forward else o)


@needs_a8
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
def test_a8_error_is_at_most_half_a_step_per_value(forward):
    """Against the unrounded product: |out - a @ W| <= (step / 2) sum |W| (+ the output's rounding), per output."""
    o, k, n = 192, 320, 6
    codes, scale = _codes(o, k, seed=3)
    gen = torch.Generator().manual_seed(4)
    a = torch.randn(n, k if forward else o, generator=gen).bfloat16()
    out = torch.zeros(n, o if forward else k, dtype=torch.bfloat16)
    _run(forward, a, out, codes, scale, False)
    w = codes.double() * scale.double()[:, None]
    if forward:
        exact = a.double() @ w.t()
        step = a.double().abs().amax(1, keepdim=True) / 127
        room = step / 2 * w.abs().sum(1)[None, :]
    else:
        v = a.double() * scale.double()  # g times the row scales, then rounded
        exact = a.double() @ w
        step = v.abs().amax(1, keepdim=True) / 127
        room = step / 2 * codes.double().abs().sum(0)[None, :]
    err = (out.double() - exact).abs()
    assert float((err / (room + 2.0**-8 * exact.abs() + 1e-6 * room.max())).max()) <= 1.0
    # and the rounding is really there: coarser than the default's 16-bit rows by orders of magnitude
    assert float(err.max()) > 1e-3 * float(room.max())


@needs_a8
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
def test_a8_nan_row_stays_in_its_row(forward):
    o, k, n = 64, 128, 3
    codes, scale = _codes(o, k, seed=5)
    a = torch.randn(n, k if forward else o).bfloat16()
    a[1, 7] = float("nan")
    out = torch.zeros(n, o if forward else k, dtype=torch.bfloat16)
    _run(forward, a, out, codes, scale, False)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


@needs_a8
def test_a8_refuses_more_weight_rows_than_its_int32_sums_hold():
    codes = torch.zeros(66312, 64, dtype=torch.int8)
    a = torch.zeros(1, 64, dtype=torch.bfloat16)
    out = torch.zeros(1, 66312, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="at most 66311 weight rows"):
        _run(True, a, out, codes, torch.ones(66312), False)


@needs_a8
def test_a8_gives_the_same_bits_on_two_threads():
    codes, scale = _codes(256, 512, seed=6)
    a = torch.randn(9, 512).bfloat16()
    g = torch.randn(9, 256).bfloat16()
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        y, dx = torch.zeros(9, 256, dtype=torch.bfloat16), torch.zeros(9, 512, dtype=torch.bfloat16)
        _run(True, a, y, codes, scale, False)
        _run(False, g, dx, codes, scale, False)
        results.append((y, dx))
    assert all(torch.equal(p, q) for p, q in zip(*results))


def _int4(
    o: int, k: int, group: int, symmetric: bool, seed: int
) -> tuple[tuple, torch.Tensor, torch.Tensor, torch.Tensor]:
    """int4_gemm's operands for a random [o, k] weight (packed, scale, zero or None, group) and, float64 [o, k] each,
    its codes u - z, u + z (the magnitudes the kernel's sums carry) and its scales per column: W = s (u - z)."""
    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (o, k // 2), generator=gen, dtype=torch.uint8)
    scale = ((torch.rand(o, k // group, generator=gen) - 0.3) * 0.05).bfloat16()  # some negative
    zero = None if symmetric else torch.randint(0, 16, (o, k // group), generator=gen, dtype=torch.uint8)
    u = torch.cat((packed & 15, packed >> 4), dim=1).double()  # byte j: column j (low nibble), j + K/2 (high)
    z = torch.full_like(u, 8.0) if zero is None else zero.double().repeat_interleave(group, 1)
    return (packed, scale, zero, group), u - z, u + z, scale.double().repeat_interleave(group, 1)


def _int4_reference(
    forward: bool, a: torch.Tensor, v: torch.Tensor, uz: torch.Tensor, s: torch.Tensor, group: int
):
    """(the product as the int4 kernel rounds a, its product of magnitudes) in float64: forward x's rows as 8-bit rows
    against W = s v; backward, per group of columns, g times that group's scales as 8-bit rows against v."""
    if forward:
        q, step = int16_rows(a, None, 127)
        return step * (q @ (s * v).t()), step * (q.abs() @ (s.abs() * uz).t())
    ref = torch.empty(a.shape[0], v.shape[1], dtype=torch.float64)
    mag = torch.empty_like(ref)
    for c in range(0, v.shape[1], group):
        q, step = int16_rows(a, s[:, c].float(), 127)
        ref[:, c : c + group] = step * (q @ v[:, c : c + group])
        mag[:, c : c + group] = step * (q.abs() @ uz[:, c : c + group])
    return ref, mag


def _int4_a8(variant: str, forward: bool, a, out, operands, accumulate: bool) -> None:
    load_variant(variant).int4_gemm_a8(forward, a, out, *operands, accumulate)


def _unrounded_backward(variant: str, forward: bool, k: int) -> bool:
    """The AVX2 variant's int4 backward keeps g unrounded where K / 2 is not a multiple of 32 (``avx2_int8.h``)."""
    return variant == "AVX2" and not forward and (k // 2) % 32 != 0


@pytest.mark.parametrize("variant", INT4_A8)
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
@pytest.mark.parametrize(
    "o,k,group,symmetric",
    [
        (64, 128, 32, True),
        (37, 96, 32, False),
        (130, 160, 32, True),
        (48, 256, 64, False),
        (40, 384, 128, True),
        (20, 4096, 32, False),
        (70, 1408, 128, False),
    ],
)
@pytest.mark.parametrize("n", [1, 3, 8, 9, 13, 33, 300])
@pytest.mark.parametrize("accumulate", [False, True])
def test_int4_a8_kernel_is_the_rounded_product(variant, forward, o, k, group, symmetric, n, accumulate):
    """K / 2 = 48 and 80: a packed chunk shorter than 64 bytes, groups across K / 2 (the AVX2 backward: its fp32
    loops, the exact product); K = 1408 with groups of 128: a group across K / 2 = 704; O not a multiple of 4 or 16;
    128 groups (the AVX512 backward quantizes each chunk's groups as it reaches them; groups of 128 span two
    chunks). Operands in the variant's compute dtype (AVX2: fp32)."""
    dtype = variant_named(variant).compute
    operands, v, uz, s = _int4(o, k, group, symmetric, seed=o + k + n)
    gen = torch.Generator().manual_seed(n)
    a = (torch.randn(n, k if forward else o, generator=gen) * torch.rand(n, 1, generator=gen) * 4).to(dtype)
    out = torch.randn(n, o if forward else k, generator=gen).to(dtype)
    before = out.double()
    _int4_a8(variant, forward, a, out, operands, accumulate)
    if _unrounded_backward(variant, forward, k):
        ref, mag = a.double() @ (s * v), a.double().abs() @ (s.abs() * v.abs())
    else:
        ref, mag = _int4_reference(forward, a, v, uz, s, group)
    _assert_rounded(out, ref, mag, before if accumulate else None, k if forward else o)


@pytest.mark.parametrize("variant", INT4_A8)
@pytest.mark.parametrize("forward", [True, False], ids=["forward", "backward"])
def test_int4_a8_error_is_at_most_half_a_step_per_value(variant, forward):
    o, k, group, n = 96, 256, 64, 5
    dtype = variant_named(variant).compute
    operands, v, _, s = _int4(o, k, group, False, seed=9)
    a = torch.randn(n, k if forward else o, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = torch.zeros(n, o if forward else k, dtype=dtype)
    _int4_a8(variant, forward, a, out, operands, False)
    w = s * v
    if forward:
        exact = a.double() @ w.t()
        room = a.double().abs().amax(1, keepdim=True) / 254 * w.abs().sum(1)[None, :]
    else:
        exact = a.double() @ w
        room = torch.empty_like(exact)
        for c in range(0, k, group):  # each group's step: max |g s| / 127, against sum_o |u - z|
            half_step = (a.double() * s[:, c]).abs().amax(1, keepdim=True) / 254
            room[:, c : c + group] = half_step * v[:, c : c + group].abs().sum(0)[None, :]
    err = (out.double() - exact).abs()
    assert float((err / (room + 2.0**-8 * exact.abs() + 1e-6 * room.max())).max()) <= 1.0
    assert float(err.max()) > 1e-3 * float(room.max())


@pytest.mark.parametrize("variant", INT4_A8)
def test_int4_a8_gives_the_same_bits_on_two_threads(variant):
    dtype = variant_named(variant).compute
    operands, *_ = _int4(256, 512, 64, False, seed=6)
    a = torch.randn(9, 512).to(dtype)
    g = torch.randn(9, 256).to(dtype)
    results = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        y, dx = torch.zeros(9, 256, dtype=dtype), torch.zeros(9, 512, dtype=dtype)
        _int4_a8(variant, True, a, y, operands, False)
        _int4_a8(variant, False, g, dx, operands, False)
        results.append((y, dx))
    assert all(torch.equal(p, q) for p, q in zip(*results))


def test_int4_a8_nan_row_stays_in_its_row():
    """AVX2 (the variant every x86-64 CPU here runs): a row with a nan gives nan in its row only, both ways."""
    if _variant_or_why("AVX2"):
        pytest.skip(_variant_or_why("AVX2"))
    operands, *_ = _int4(64, 256, 64, False, seed=3)
    for forward in (True, False):
        a = torch.randn(3, 256 if forward else 64)
        a[1, 5] = float("nan")
        out = torch.zeros(3, 64 if forward else 256)
        _int4_a8("AVX2", forward, a, out, operands, False)
        assert out[1].isnan().all() and not out[0].isnan().any() and not out[2].isnan().any()


@pytest.mark.parametrize(
    "name,variant",
    [pytest.param(name, v.name, marks=_runs_here(v.name)) for v in VARIANTS for name in v.int8_rows],
)
@pytest.mark.parametrize("with_lora", [True, False], ids=["lora", "frozen"])
def test_engine_with_int8_activations_stays_near_the_default(name, variant, with_lora):
    """The engine module with int8_activations, computing in the variant's dtype (the AVX2 variant's: fp32), against
    the same weights on the default path (int8: 16-bit rows; int4 with groups of 32 and zero points: bf16 or fp32):
    forward and every gradient within 2^-4 of each quantity's max (measured: 5e-3 to 2.3e-2), and not equal to it
    (the rounding is really taken); the path says so."""
    fmt, x, ids, w, gy = engine_case(name, group=32)
    results = []
    for a8 in (True, False):
        opts = {"compute_dtype": variant_named(variant).compute, "int8_activations": a8}
        if with_lora:
            module = _module(fmt, _lora(), **opts)
        else:
            from moetune.layer import CpuExperts

            module = CpuExperts(ExpertEngine(fmt, options=EngineOptions(**opts)))
        path = module.engine.gemm.path
        assert path.int8_rows is a8 and (path.fused_variant == variant or not a8)
        assert ("8-bit integer rows" in path.describe()) is a8
        results.append(run_module(module, x, ids, w, gy))
    for label, err in run_errors(*results).items():
        assert 0 < err <= 2.0**-4, (label, err)


@needs_a8
def test_amx_cpus_take_the_avx512_kernels_for_int8_activations():
    int8 = Int8Experts.from_dense(*gaussian())
    path = resolve_gemm_path(int8, torch.bfloat16, AMX, int8_rows=True)
    assert path.int8_rows and path.fused_variant == "AVX512-BF16" and path.fused_rows == 256
    assert path.kernel("int8_gemm") == "int8_gemm_a8" and path.kernel("int8_gemm_run") == "int8_gemm_a8_run"
    assert resolve_gemm_path(int8, torch.bfloat16, AMX).kernel("int8_gemm_run") == "int8_gemm_run"


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler (c++/g++) on PATH")
def test_avx2_int4_takes_more_rows_with_int8_activations():
    """The AVX2 variant's int4 products with 8-bit rows beat the fp32 GEMMs on dequantized weights past the default
    kernels' 256 rows (``Int4Experts.INT8_ROWS_MAX_ROWS``); without the option, and on AVX512, 256 stays."""
    from moetune.engine.formats import Int4Experts
    from moetune.engine.kernels import fused_kernels

    int4 = Int4Experts.from_dense(*gaussian(), group_size=32)
    a8 = resolve_gemm_path(int4, torch.float32, AVX2, int8_rows=True)
    assert a8.int8_rows and a8.fused_variant == "AVX2" and a8.fused_rows == 512
    # the default path takes the variant this machine loads: on an AVX512 CPU it computes in bf16, not fp32
    kernels = fused_kernels()
    here = str(kernels.variant) if kernels is not None else ""
    default = resolve_gemm_path(int4, torch.float32, AVX2)
    assert (default.fused_rows, default.fused_variant) == ((256, "AVX2") if here == "AVX2" else (0, ""))
    if not _variant_or_why("AVX512-BF16"):
        assert resolve_gemm_path(int4, torch.bfloat16, AMX, int8_rows=True).fused_rows == 256


def test_int8_activations_errors_name_what_is_missing(monkeypatch):
    int8 = Int8Experts.from_dense(*gaussian())
    fp8 = FORMATS.get("fp8_block").from_dense(*gaussian())
    with pytest.raises(
        EngineError,
        match="no kernel variant computes 'fp8_block' experts with 8-bit activations; allowed: expert_format int4, int8",
    ):
        resolve_gemm_path(fp8, torch.bfloat16, AMX, int8_rows=True)
    with pytest.raises(EngineError, match=r"needs the AVX512-BF16 kernels \(a CPU with AVX512-BF16"):
        resolve_gemm_path(int8, torch.bfloat16, AVX2, int8_rows=True)
    with pytest.raises(EngineError, match="computes in torch.float32"):
        resolve_gemm_path(int8, torch.float32, AMX, int8_rows=True)
    with pytest.raises(EngineError, match="fused kernels, which are off"):
        resolve_gemm_path(int8, torch.bfloat16, AMX, fused=False, int8_rows=True)
    # int4: the AVX2 variant computes in fp32 (an AVX2-only CPU, or a float32 load on an AVX512 one); bf16 needs
    # AVX512-BF16
    assert not int8_rows_problem("int4", torch.float32, AVX2.isa)
    assert not int8_rows_problem("int4", torch.float32, AMX.isa)
    assert not int8_rows_problem("int4", torch.bfloat16, AMX.isa)
    assert "AVX512-BF16 kernels (a CPU with AVX512-BF16, computing in torch.bfloat16) or AVX2 kernels" in (
        int8_rows_problem("int4", torch.bfloat16, AVX2.isa)
    )
    monkeypatch.setenv(KERNELS_ENV, "off")
    with pytest.raises(EngineError, match=f"which are off \\({KERNELS_ENV}=off\\)"):
        resolve_gemm_path(int8, torch.bfloat16, AMX, int8_rows=True)
    assert "which are off" in int8_rows_problem("int4", torch.float32, AVX2.isa)


def test_int8_activations_option(tmp_path):
    from moetune.config import parse_config

    assert LoadOptions.create(
        device="cpu", expert_format="int8", int8_activations=True
    ).engine.int8_activations
    assert not LoadOptions.create(device="cpu", expert_format="int8").engine.int8_activations
    with pytest.raises(
        ConfigError, match="int8_activations is true but applies to expert_format int8 or int4 only"
    ):
        ExpertOptions.create(expert_format="mxfp4", int8_activations=True)
    assert ExpertOptions.create(expert_format="int4", int8_activations=True).int8_activations
    with pytest.raises(ConfigError, match="expert_format is 'auto'"):
        ExpertOptions.create(int8_activations=True)
    with pytest.raises(ConfigError, match="int8_activations got 'yes'; allowed: true or false"):
        ExpertOptions.create(expert_format="int8", int8_activations="yes")
    ExpertOptions.create(expert_format="fp8", int8_activations=False)  # false: nothing asked
    raw = {
        "model_name_or_path": "m",
        "dataset": "demo_train",
        "dataset_dir": str(ROOT / "examples/data"),
        "output_dir": str(tmp_path / "o"),
        "moetune": {
            "expert_format": "int8",
            "int8_activations": "true",
        },  # as LLaMA-Factory's parser reads it
    }
    assert parse_config(raw, check_model_path=False).engine.experts.int8_activations is True
    raw["moetune"] = {"expert_format": "fp8", "int8_activations": True}
    with pytest.raises(
        ConfigError, match=r"moetune\.int8_activations: is true but applies to expert_format int8"
    ):
        parse_config(raw, check_model_path=False)


def test_int8_activations_refused_before_any_weight_is_read(tmp_path, monkeypatch):
    """The load's plan (``plan_load``: the meta-device model, no tensor data read) refuses the option where the
    engines could not take it: int8 in a float32 load (the experts compute in float32) or on a CPU without
    AVX512-BF16, the kernels turned off (int4, which the AVX2 variant also takes: the errors test below)."""
    from moetune.loading.load import plan_load
    from moetune.train.demo import make_demo_model

    model = make_demo_model(tmp_path / "m", ROOT / "examples/data/demo_tokenizer")

    def refused(match: str, dtype: str = "bfloat16") -> None:
        opts = LoadOptions.create(device="cpu", dtype=dtype, expert_format="int8", int8_activations=True)
        with pytest.raises(ConfigError, match=match):
            plan_load(model, opts)

    refused("computes in torch.float32", dtype="float32")
    monkeypatch.setenv(KERNELS_ENV, "off")
    refused(f"which are off \\({KERNELS_ENV}=off\\)")
    monkeypatch.delenv(KERNELS_ENV)
    monkeypatch.setattr("moetune.sysinfo.cpu_info", lambda: AVX2)
    refused(
        r"needs the AVX512-BF16 kernels \(a CPU with AVX512-BF16, computing in torch.bfloat16\); this CPU has AVX2"
    )
