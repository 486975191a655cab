"""Peak host RSS while loading stays <= 1.15x the resident size after loading, on 1.6 GB of routed experts.

The checkpoint (``moetune.testing.wide``: 4 Qwen3-MoE layers x 64 experts x 3 x 1024 x 1024, bf16) is written
tensor by tensor, once in 512 MB shards (layers straddle shards, as in hub releases) and once as a single
file (what ``save_pretrained`` writes by default in transformers 5). Each load runs in a fresh process
(``moetune.testing.rss.measure_load``): the peak is that process's own high-water mark (``moetune.sysinfo.peak_rss_bytes``), which
counts memory-mapped file pages as well as allocations.
"""

from __future__ import annotations

import shutil

import pytest

from moetune.testing.rss import measure_load
from moetune.testing.wide import WideShape, write_wide_checkpoint

PEAK_OVER_FINAL = 1.15  # issue 3's bound


@pytest.mark.slow
@pytest.mark.parametrize("shard_mb", [512, 4096], ids=["512MB-shards", "one-file"])
def test_peak_rss_while_loading(shard_mb, tmp_path):
    shape = WideShape()
    assert shape.expert_bytes >= 1e9
    path = write_wide_checkpoint(tmp_path / "wide", shape, shard_bytes=shard_mb << 20)
    try:
        got = measure_load(path, dtype="bfloat16")
    finally:
        shutil.rmtree(path)
    mb = {k: round(v / 2**20) for k, v in got.items() if k != "seconds"}
    assert got["final"] - got["baseline"] >= 0.95 * shape.expert_bytes, mb  # the experts are resident
    assert got["peak"] <= PEAK_OVER_FINAL * got["final"], mb
