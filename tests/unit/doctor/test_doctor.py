"""``moetune doctor``: each verdict from injected facts, the engine self-test for real, and the command's output."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from functools import partial

import pytest
import torch
import torch.nn.functional as F

from moetune.cli import doctor as cli
from moetune.doctor import (
    Check,
    GpuFacts,
    Status,
    check_cpu,
    check_engine,
    check_gpu,
    check_install,
    check_memory,
    check_packages,
    check_python,
    check_threads,
    guarded,
    run_checks,
)
from moetune.sysinfo import CpuInfo
from moetune.testing.reference import expert_loop
from moetune.testing.selftest import SELFTEST_TOLERANCE, engine_selftest_case

REQS = ["torch>=2.6", "transformers<5.25,>=5.0", "numpy", 'pytest>=8; extra == "dev"']
GOOD = {"torch": "2.13.0+cpu", "transformers": "5.24.0", "numpy": "2.4.6"}
EXPECTED_NAMES = ["install", "python", "packages", "cpu", "threads", "memory", "gemm", "gpu"]


def cpu(isa=("AVX2",), logical=8, physical=4, numa=1) -> CpuInfo:
    return CpuInfo(model="Test CPU", isa=isa, logical_cpus=logical, physical_cores=physical, numa_nodes=numa)


@pytest.fixture(scope="module")
def all_checks() -> list[Check]:
    return run_checks(selftest=True)


# ---- verdicts from facts


def test_packages_ok_skips_extras():
    c = check_packages(REQS, GOOD.get)
    assert c.status is Status.OK
    assert "torch 2.13.0+cpu" in c.summary and "pytest" not in c.summary  # dev extra is not needed to run


@pytest.mark.parametrize(
    "versions,needle,fix",
    [
        ({**GOOD, "transformers": "5.25.0"}, "transformers 5.25.0 is installed", '"transformers<5.25,>=5.0"'),
        ({**GOOD, "torch": "2.5.1"}, "torch 2.5.1 is installed; moetune needs >=2.6", '"torch>=2.6"'),
        ({k: v for k, v in GOOD.items() if k != "numpy"}, "numpy is missing (needs any version)", '"numpy"'),
    ],
)
def test_packages_fail_names_package_version_and_fix(versions, needle, fix):
    c = check_packages(REQS, versions.get)
    assert c.status is Status.FAIL
    assert needle in c.summary
    assert c.fix.startswith("pip install") and fix in c.fix


def test_packages_unknown_without_install():
    assert check_packages(None).status is Status.WARN


def test_python_version():
    assert check_python(">=3.10", "3.11.7").status is Status.OK
    bad = check_python(">=3.10", "3.9.18")
    assert bad.status is Status.FAIL and "3.9.18 does not satisfy >=3.10" in bad.summary


@pytest.mark.parametrize(
    "imported,dist,status,needle",
    [
        ("0.1.0", "0.1.0", Status.OK, "moetune 0.1.0 from /src/moetune"),
        (None, "0.1.0", Status.FAIL, "namespace package"),
        ("0.2.0", "0.1.0", Status.FAIL, "installed metadata is for 0.1.0"),
        ("0.1.0", None, Status.WARN, "not installed as a package"),
    ],
)
def test_install(imported, dist, status, needle):
    c = check_install(imported, "/src/moetune", dist)
    assert c.status is status and needle in c.summary
    assert bool(c.fix) == (status is not Status.OK)


def test_cpu_isa():
    assert check_cpu(cpu(), "x86_64", "AVX2", torch.float32).status is Status.OK
    no_avx2 = check_cpu(cpu(isa=()), "x86_64", "DEFAULT", torch.float32)
    assert no_avx2.status is Status.WARN and "no AVX2" in no_avx2.summary
    # x86 flags mean nothing on ARM: their absence is not a warning there
    assert check_cpu(cpu(isa=()), "aarch64", "DEFAULT", torch.float32).status is Status.OK
    native = check_cpu(cpu(isa=("AMX-BF16", "AVX512F", "AVX2")), "x86_64", "AVX512", torch.bfloat16)
    assert any("compute in bfloat16 (native" in d for d in native.details)


def test_memory_reports_the_kernels_huge_page_mode_and_torchs_allocator():
    on = check_memory("madvise", True)
    assert on.status is Status.OK and not on.fix
    assert on.details == ("transparent huge pages: kernel mode madvise; torch's allocator advises them: yes "
                          "(THP_MEM_ALLOC_ENABLE)",)  # fmt: skip
    off = check_memory("never", False)
    assert off.status is Status.OK and off.details[0].endswith("kernel mode never; torch's allocator advises them: "
                                                               "no (THP_MEM_ALLOC_ENABLE)")  # fmt: skip


def test_the_command_reports_torchs_huge_pages_as_the_process_started():
    """``moetune doctor`` in a fresh process (the command's own entry point): torch advises huge pages when the
    environment sets THP_MEM_ALLOC_ENABLE=1, not when it leaves it unset (torch's default)."""
    base = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    entry = "import sys; from moetune.cli.main import main; sys.exit(main(sys.argv[1:]))"
    seen = {}
    for label, env in (("unset", {}), ("1", {"THP_MEM_ALLOC_ENABLE": "1"})):
        run = subprocess.run(
            [sys.executable, "-c", entry, "doctor", "--json", "--skip-selftest"],
            env={**base, **env}, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert run.returncode == 0, run.stderr[-2000:]
        (memory,) = [c for c in json.loads(run.stdout)["checks"] if c["name"] == "memory"]
        seen[label] = memory["details"][0]
    assert seen["unset"].endswith("advises them: no (THP_MEM_ALLOC_ENABLE)"), seen
    assert seen["1"].endswith("advises them: yes (THP_MEM_ALLOC_ENABLE)"), seen


def test_threads_against_quota():
    assert check_threads(cpu(), 4, 8, None).status is Status.OK
    assert check_threads(cpu(), 4, 8, 4.0).status is Status.OK
    c = check_threads(cpu(), 4, 8, 1.5)
    assert c.status is Status.WARN and "quota allows only 1.5" in c.summary
    assert "num_threads=1" in c.fix


def test_gpu_verdicts():
    assert check_gpu("2.13.0+cpu", None, []).status is Status.WARN
    none_seen = check_gpu("2.13.0", "12.8", [])
    assert none_seen.status is Status.WARN and "CUDA_VISIBLE_DEVICES" in none_seen.fix
    h200 = GpuFacts(0, "NVIDIA H200", 141 * 1024**3, (9, 0))
    ok = check_gpu("2.13.0", "12.8", [h200])
    assert ok.status is Status.OK and ok.details == ("cuda:0 NVIDIA H200, 141.0 GiB, compute capability 9.0",)
    t4 = GpuFacts(1, "Tesla T4", 15 * 1024**3, (7, 5))
    old = check_gpu("2.13.0", "12.8", [h200, t4])
    assert old.status is Status.WARN and "cuda:1 lack bf16" in old.summary and "cuda:0" not in old.summary


def test_guarded_turns_a_broken_probe_into_a_failure():
    def broken() -> Check:
        raise RuntimeError("CUDA driver initialization failed")

    c = guarded("gpu", broken)
    assert c.status is Status.FAIL and c.name == "gpu"
    assert "RuntimeError: CUDA driver initialization failed" in c.summary


# ---- engine self-test, for real


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_selftest_passes_on_this_machine(storage):
    res = engine_selftest_case(storage)
    assert set(res.errors) == {"y", "grad_x", "grad_w"} | {
        f"grad_{n}" for n in ("gate_up_A", "gate_up_B", "down_A", "down_B")
    }
    assert max(res.errors.values()) <= SELFTEST_TOLERANCE[storage], res.errors
    assert check_engine([res]).status is Status.OK


@pytest.mark.parametrize("storage", [torch.float32, torch.bfloat16])
def test_selftest_catches_a_wrong_activation(storage):
    wrong = partial(expert_loop, act=lambda gate, up: F.gelu(gate) * up)  # the engine computes silu
    c = check_engine([engine_selftest_case(storage, reference=wrong)])
    assert c.status is Status.FAIL and "y off by" in c.summary


def test_selftest_catches_a_one_percent_lora_error():
    # a LoRA scaling off by 1% must not hide inside the fp32 tolerance
    def off(*args, scaling, **kw):
        return expert_loop(*args, scaling=scaling * 1.01, **kw)

    c = check_engine([engine_selftest_case(torch.float32, reference=off)])
    assert c.status is Status.FAIL and "grad_gate_up_B off by" in c.summary


# ---- all checks and the command


def test_run_checks_reports_every_check(all_checks):
    assert [c.name for c in all_checks] == [*EXPECTED_NAMES, "engine"]
    by_name = {c.name: c for c in all_checks}
    assert by_name["engine"].status is Status.OK, by_name["engine"]
    if not torch.cuda.is_available():
        assert by_name["gpu"].status is Status.WARN
    for c in all_checks:
        assert c.summary and (c.status is Status.OK or c.fix or c.name == "packages"), c


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_run_checks_on_a_gpu_machine(all_checks):
    by_name = {c.name: c for c in all_checks}
    assert by_name["gpu"].status is Status.OK
    assert any("on cuda" in d for d in by_name["engine"].details)
    assert by_name["engine"].status is Status.OK, by_name["engine"]


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    parser = argparse.ArgumentParser(prog="moetune")
    cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["doctor", *argv])
    rc = args.func(args)
    return rc, capsys.readouterr().out


def test_cli_json(capsys):
    rc, out = run_cli(capsys, "--json", "--skip-selftest")
    report = json.loads(out)
    assert [c["name"] for c in report["checks"]] == EXPECTED_NAMES
    failed = any(c["status"] == "fail" for c in report["checks"])
    assert report["ok"] is not failed and rc == int(failed)
    assert set(report["checks"][0]) == {"name", "status", "summary", "details", "fix"}


def test_text_format():
    checks = [
        Check("cpu", Status.OK, "Test CPU", ("torch CPU kernels: AVX2",)),
        Check("gpu", Status.WARN, "no GPU", fix="install a CUDA build"),
        Check("engine", Status.FAIL, "y off by 1.0e+00"),
    ]
    lines = cli.format_text(checks).splitlines()
    assert lines == [
        "[ ok ] cpu     Test CPU",
        "               torch CPU kernels: AVX2",
        "[warn] gpu     no GPU",
        "               fix: install a CUDA build",
        "[fail] engine  y off by 1.0e+00",
        "3 checks: 1 failed, 1 with warnings",
    ]


def test_onednn_verbose_parsing_and_gemm_verdict():
    from moetune.doctor import Status, check_gemm, parse_onednn_matmul

    line = (
        "onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx512_core_amx,undef,"
        "src:bf16::blocked:ab::f0 wei:bf16::blocked:ab::f0 dst:bf16::blocked:ab::f0,,,256x2048:2048x256,0.1"
    )
    assert parse_onednn_matmul("onednn_verbose,info,cpu,isa:AMX\n" + line) == "brg_matmul:avx512_core_amx"
    assert parse_onednn_matmul("nothing here") is None
    amx = check_gemm(2.1, 0.4, "brg_matmul:avx512_core_amx")
    assert amx.status is Status.OK and "runs on AMX" in amx.summary
    emulated = check_gemm(0.015, 0.09, None)
    assert emulated.status is Status.WARN and "does not run on AMX" in emulated.summary
    assert "fp32 tiles" in " ".join(emulated.details)


def test_gemm_speed_is_measured_within_its_time_budget():
    """A GEMM taking longer than the budget (emulated bf16 on an AVX2-only CPU: ~2 s a call) is timed by its
    warm-up call alone; a fast one by the best of its reps after the warm-up, as before."""
    from moetune.doctor.cpu import gemm_tflops

    def fake(seconds):
        calls = []

        def matmul(a, b):
            calls.append((a.shape, b.shape, a.dtype))
            time.sleep(seconds[min(len(calls), len(seconds)) - 1])
            return a.new_empty(a.shape[0], b.shape[1])

        return calls, matmul

    flops = 2 * 64 * 32 * 16
    calls, slow = fake([0.2])
    rate = gemm_tflops(torch.bfloat16, 64, 32, 16, reps=5, budget_s=0.1, matmul=slow)
    assert calls == [((64, 32), (32, 16), torch.bfloat16)] and 0 < rate <= flops / 0.2 / 1e12
    calls, fast = fake([0.001, 0.02])  # the warm-up fastest: not a measurement when the reps fit the budget
    rate = gemm_tflops(torch.float32, 64, 32, 16, reps=5, budget_s=10.0, matmul=fast)
    assert len(calls) == 6 and 0 < rate <= flops / 0.02 / 1e12
    calls, steady = fake([0.04])  # the budget spent after the warm-up and one or two reps
    gemm_tflops(torch.float32, 64, 32, 16, reps=5, budget_s=0.1, matmul=steady)
    assert 2 <= len(calls) <= 3


@pytest.mark.skipif(not shutil.which("c++") and not shutil.which("g++"), reason="no C++ compiler on PATH")
def test_gemm_paths_name_the_avx2_variant_on_an_avx2_cpu(monkeypatch):
    """On a CPU whose isa is only AVX2 (mocked; this machine runs AVX2 code too) quantized experts compute in fp32
    on the AVX2 variant, and the doctor's lines say so."""
    from moetune.doctor.engine import gemm_paths
    from moetune.engine import gemm, plan
    from moetune.engine.kernels import KERNELS_ENV, loader

    avx2 = cpu()
    for module in (plan, gemm, loader):
        monkeypatch.setattr(module, "cpu_info", lambda: avx2)
    monkeypatch.setattr(loader, "_state", {})
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    if loader.fused_unavailable():
        pytest.skip(f"the AVX2 variant does not run here: {loader.fused_unavailable()}")
    lines = gemm_paths()
    int8 = next(line for line in lines if line.startswith("int8:"))
    assert "computes in float32" in int8 and "fused kernel (AVX2," in int8, lines
    # the opt-in int8_activations: int4's on the AVX2 kernels, int8's refused (AVX512-BF16 only), saying why
    int4_a8 = next(line for line in lines if line.startswith("int4 with int8_activations:"))
    assert "fused kernel (AVX2, codes times the activations rounded to 8-bit integer rows" in int4_a8, lines
    int8_a8 = next(line for line in lines if line.startswith("int8 with int8_activations:"))
    assert "refused here (int8_activations needs the AVX512-BF16 kernels" in int8_a8, lines
    assert (
        lines[-1]
        == "fused kernels: AVX2 variant built and used, with each expert's op sequences (kernels/ops.h)"
    )
