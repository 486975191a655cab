"""Host facts the engine's defaults depend on: the cgroup CPU quota, the default thread count, and transparent huge
pages (the kernel's mode, and whether torch's allocator asks for them)."""

from __future__ import annotations

import os
import subprocess
import sys

from moetune import sysinfo
from moetune.sysinfo import CpuInfo, cgroup_cpu_quota, default_num_threads, parse_cpu_quota


def test_parse_cpu_quota():
    assert parse_cpu_quota("max", "100000") is None
    assert parse_cpu_quota("-1\n", "100000\n") is None
    assert parse_cpu_quota("250000", "100000") == 2.5


def test_cgroup_quota_files(tmp_path):
    assert cgroup_cpu_quota(tmp_path) is None  # nothing readable: unknown, not zero
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 3.0  # v1
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5  # v2 wins over v1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_default_threads_are_capped_by_the_cgroup_quota(monkeypatch):
    sysinfo.cpu_info.cache_clear()
    monkeypatch.setattr(sysinfo, "cpu_info", lambda: CpuInfo("test", (), 32, 16, 1))
    monkeypatch.setattr(sysinfo, "cgroup_cpu_quota", lambda: None)
    assert default_num_threads() == 16  # physical cores, not the 32 SMT siblings
    monkeypatch.setattr(sysinfo, "cgroup_cpu_quota", lambda: 4.5)
    assert default_num_threads() == 4  # whole CPUs of the quota
    monkeypatch.setattr(sysinfo, "cgroup_cpu_quota", lambda: 0.5)
    assert default_num_threads() == 1


def test_a_child_does_not_report_its_parents_peak() -> None:
    """``ru_maxrss`` survives fork + exec; the child's own peak must not: a large parent, a small child."""
    import subprocess
    import sys

    from moetune.sysinfo import peak_rss_bytes

    ballast = bytearray(512 << 20)  # 512 MiB, touched below so it is resident in this process
    ballast[::4096] = b"x" * len(ballast[::4096])
    assert peak_rss_bytes() >= 512 << 20
    code = "from moetune.sysinfo import peak_rss_bytes; print(peak_rss_bytes())"
    child = int(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    del ballast
    assert child < 256 << 20, child  # a bare interpreter plus moetune.sysinfo: tens of MiB


def test_thp_mode_is_the_bracketed_word(tmp_path):
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert sysinfo.thp_mode(f) == "madvise"
    f.write_text("[always] madvise never\n")
    assert sysinfo.thp_mode(f) == "always"
    f.write_text("garbled\n")
    assert sysinfo.thp_mode(f) == "unknown"
    assert sysinfo.thp_mode(tmp_path / "missing") == "unknown"


def _advised(env: dict[str, str], before: str = "") -> bool:
    """torch_advises_huge_pages() in a fresh process started with ``env`` (THP_MEM_ALLOC_ENABLE removed first),
    after ``before`` (Python run first)."""
    script = (
        f"{before}\nfrom moetune.sysinfo import torch_advises_huge_pages\nprint(torch_advises_huge_pages())"
    )
    base = {k: v for k, v in os.environ.items() if k != sysinfo.THP_ENV}
    run = subprocess.run(
        [sys.executable, "-c", script], env={**base, **env}, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return {"True": True, "False": False}[run.stdout.split()[-1]]


def test_torch_advises_huge_pages_as_torch_read_the_environment_at_its_first_allocation():
    assert _advised({sysinfo.THP_ENV: "1"}) is True
    assert _advised({}) is False and _advised({sysinfo.THP_ENV: "0"}) is False
    # set after torch's first allocation: torch never sees it, and the check says so
    late = "import os, torch\nx = torch.empty(1 << 20)\nos.environ['THP_MEM_ALLOC_ENABLE'] = '1'"
    assert _advised({}, before=late) is False
