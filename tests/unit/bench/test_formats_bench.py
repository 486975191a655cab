"""``bench/formats.py`` where the CPU has no kernels for the ``-a8`` labels (``MOETUNE_KERNELS=off`` stands in for an
AVX2-only CPU, on which the default run used to stop at the first one): run by default it skips them, naming the
engine's reason, and times every other label; named in ``--formats`` it stops with that reason before any weights are
built; a run whose engines would not fit in memory stops after the first one's warm-up, saying why.
Nothing here asserts a speed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from moetune.bench.weight_formats import room_for_the_rest
from tests.unit.bench.scripts import ROOT

TINY = ("--experts", "4", "--hidden", "128", "--inter", "64", "--tokens", "16", "--top-k", "2", "--reps", "1")
OFF = {**os.environ, "MOETUNE_KERNELS": "off"}


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "bench/formats.py", *TINY, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=OFF,
        timeout=600,
    )


def test_default_labels_skip_the_a8_ones_with_the_reason():
    run = _run()
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    for label in ("int8-a8", "int4-g64-a8"):
        assert any(
            line.startswith(f"  {label}: skipped (int8_activations needs the fused kernels, which are off")
            for line in lines
        ), run.stdout
        assert not any(line.startswith(f"{label} ") for line in lines), run.stdout  # no timing row
    timed = {
        line.split()[0] for line in lines if line and line.split()[0] in ("bf16", "int8", "int4-g64", "mxfp4")
    }
    assert timed == {"bf16", "int8", "int4-g64", "mxfp4"}, run.stdout


def test_a_named_a8_label_stops_the_run_with_the_reason():
    run = _run("--formats", "compressed-int4", "int8-a8")
    assert run.returncode != 0
    assert "bench/formats.py: --formats int8-a8: int8_activations needs the fused kernels, which are off" in (
        run.stderr
    ), run.stderr[-2000:]
    assert "re-packing" not in run.stdout  # before any weights were built (compressed-int4's prints it)
    assert "T=16" not in run.stdout


def test_a_run_that_would_not_fit_stops_saying_how_much_it_needs():
    gib = 2**30
    room_for_the_rest(8192, 2 * gib, 4, available=10 * gib)  # 8 GiB of 10: fits under 90%
    with pytest.raises(SystemExit) as stop:
        room_for_the_rest(8192, 2 * gib, 9, available=10 * gib)
    assert str(stop.value) == (
        "bench/formats.py: --tokens 8192: the first engine's step took 2.00 GiB; the other 9 engines need about "
        "18.0 GiB more, and 10.0 GiB is available. Run fewer --formats, or fewer --tokens / --experts per run"
    )
    room_for_the_rest(16, -4096, 9)  # a step that freed memory needs none; the machine's own figure
