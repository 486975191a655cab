"""Host facts the engine's defaults depend on: the cgroup CPU quota and the default thread count."""

from __future__ import annotations

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
