"""An MXFP4 checkpoint's routed experts take their shipped bytes of host memory, within 3%, with no bf16 copy
of them at any point of the load.

The checkpoint (``moetune.testing.mxfp4_checkpoint``): gpt-oss with 2 layers x 32 experts x H = I = 1024, 102 MB
of MXFP4 experts (blocks, scales and bf16 biases; 3.8x that in bf16) and 1.3 MB of everything else. It is
written by a spawned process and loaded by another (``moetune.testing.rss.measure_load``) after a tiny
gpt-oss MXFP4 checkpoint, so the baseline already holds gpt-oss's modules and moetune's code paths:

* held = resident size after the load - baseline - the non-expert bytes (bf16, as stored) ~ the shipped
  expert bytes (measured 1.015x);
* peak - baseline <= 1.1x the checkpoint (measured 1.03x): one expert's bytes at a time on top of the
  engines, where a dequantized layer alone would add 3.8x a layer's bytes.
"""

from __future__ import annotations

import multiprocessing

import pytest

from moetune.loading.checkpoint import Checkpoint
from moetune.testing.mxfp4_checkpoint import save_mxfp4_checkpoint
from moetune.testing.rss import measure_load

SIZES = {"hidden_size": 1024, "intermediate_size": 1024, "num_local_experts": 32}


@pytest.mark.slow
def test_mxfp4_experts_hold_their_shipped_bytes(tmp_path):
    # the writer builds an 800 MB float32 model: keep it out of this process (its size would become the
    # loading child's high-water mark at fork)
    spawn = multiprocessing.get_context("spawn")
    writer = spawn.Process(target=save_mxfp4_checkpoint, args=(tmp_path / "big",), kwargs=SIZES)
    writer.start()
    writer.join()
    assert writer.exitcode == 0
    warm = save_mxfp4_checkpoint(tmp_path / "tiny")
    tensors = Checkpoint.open(tmp_path / "big").tensors
    shipped = sum(info.nbytes for key, info in tensors.items() if ".mlp.experts." in key)
    rest = sum(info.nbytes for key, info in tensors.items() if ".mlp.experts." not in key)
    assert shipped > 100e6 and rest < 0.02 * shipped
    got = measure_load(tmp_path / "big", dtype="bfloat16", warmup=warm)
    held = got["final"] - got["baseline"] - rest
    mb = {k: round(v / 2**20, 1) for k, v in got.items() if k != "seconds"}
    assert abs(held - shipped) <= 0.03 * shipped, (held / shipped, mb)
    assert got["peak"] - got["baseline"] <= 1.1 * (shipped + rest), mb
