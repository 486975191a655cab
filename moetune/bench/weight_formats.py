"""The weight formats the benchmarks compare, by label: how each is built from one layer's fp32 weights.

``bench/formats.py`` (engine steps) and ``bench/products.py`` (kernels per product) take their labels from here:
bf16 in the layout the loader fills, int8, int4 with groups of 64, fp8_block, mxfp4, int4 from compressed-tensors
bytes through the loader's re-pack, and the ``-a8`` labels, int8 / int4 with ``int8_activations``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil
import torch

from moetune.bench.runners import as_loaded
from moetune.engine import ExpertFormat
from moetune.engine.formats import FORMATS, DenseExperts, Int4Experts
from moetune.engine.gemm import int8_rows_problem
from moetune.loading.quant.compressed_tensors import repack
from moetune.testing.kimi import INT4_GROUP, quantize_int4

Build = Callable[
    [torch.Tensor, torch.Tensor], ExpertFormat
]  # gate_up [E, 2I, H], down [E, H, I] fp32 -> format


def dense_as_loaded(gate_up: torch.Tensor, down: torch.Tensor) -> ExpertFormat:
    """Dense experts in the layout the loader fills (``DenseExperts.empty``: bf16 rows of 4 KiB padded)."""
    return DenseExperts(*as_loaded(gate_up, down))


def from_compressed_int4(gate_up: torch.Tensor, down: torch.Tensor) -> ExpertFormat:
    """int4 from compressed-tensors INT4 bytes of these weights, through the loader's unpack and re-pack."""
    i = down.shape[2]
    stored: dict[str, list[torch.Tensor]] = {}
    for e in range(down.shape[0]):
        for role, w in (("gate", gate_up[e, :i]), ("up", gate_up[e, i:]), ("down", down[e])):
            packed, scale = quantize_int4(w)
            stored.setdefault(role, []).append(packed)
            stored.setdefault(f"{role}_scale", []).append(scale)
    t0 = time.perf_counter()
    int4 = {k: v if k.endswith("_scale") else [repack(p) for p in v] for k, v in stored.items()}
    fmt = Int4Experts.from_per_expert(**int4, group_size=INT4_GROUP)
    packed_mb = sum(p.nbytes for k, v in stored.items() if not k.endswith("_scale") for p in v) / 1e6
    print(
        f"compressed-int4: re-packing {packed_mb:.1f} MB of codes took {(time.perf_counter() - t0) * 1e3:.1f} ms"
    )
    return fmt


def int4_g64(gate_up: torch.Tensor, down: torch.Tensor) -> ExpertFormat:
    """int4 with groups of 64, symmetric (the format's defaults, named)."""
    return Int4Experts.from_dense(gate_up, down, group_size=64)


FORMAT_BUILDS: dict[str, tuple[Build, torch.dtype]] = {  # label -> (build, dtype of the weights it is given)
    "bf16": (dense_as_loaded, torch.bfloat16),
    "int8": (FORMATS.get("int8").from_dense, torch.float32),
    "int4-g64": (int4_g64, torch.float32),
    "fp8_block": (FORMATS.get("fp8_block").from_dense, torch.float32),
    "compressed-int4": (from_compressed_int4, torch.float32),
    "mxfp4": (FORMATS.get("mxfp4").from_dense, torch.float32),
}
# labels whose engines take options of their own, each built as the label it extends: int8-a8 is int8 with
# int8_activations (its torch path is int8's)
LABEL_OPTIONS: dict[str, dict[str, object]] = {
    "int8-a8": {"int8_activations": True},
    "int4-g64-a8": {"int8_activations": True},
}
FORMAT_BUILDS.update({label: FORMAT_BUILDS[label.removesuffix("-a8")] for label in LABEL_OPTIONS})
# the format (``ExpertFormat.name``) each label with options of its own builds: what the engine's checks name
LABEL_FORMATS: dict[str, str] = {"int8-a8": "int8", "int4-g64-a8": "int4"}


def label_refused(label: str, compute_dtype: torch.dtype, isa: tuple[str, ...]) -> str:
    """Why an engine computing in ``compute_dtype`` on a CPU with ``isa`` would refuse ``label``'s own options (an
    ``-a8`` label's ``int8_activations``: the engine's own message), or "" (labels without options included);
    builds nothing, so a benchmark asks it before it builds any weights."""
    if label not in LABEL_OPTIONS:
        return ""
    return int8_rows_problem(LABEL_FORMATS[label], compute_dtype, isa)


def room_for_the_rest(tokens: int, grew: int, more: int, available: int | None = None) -> None:
    """``SystemExit`` before ``more`` engines warm up at T = ``tokens`` when they would not fit: each holds about
    what the first one's warm-up added (``grew`` bytes of resident memory: its workspaces and saved activations;
    the formats' own differ a little), against 90% of the memory ``psutil`` says is available (or ``available``).
    The engines of a run are warmed and timed in turn and each keeps its workspaces, so without this a run past
    the machine's memory ends at the operating system's out-of-memory kill, with no word of why."""
    free = psutil.virtual_memory().available if available is None else available
    need = max(grew, 0) * more
    if need > 0.9 * free:
        gib = 2.0**30
        raise SystemExit(
            f"bench/formats.py: --tokens {tokens}: the first engine's step took {grew / gib:.2f} GiB; the other "
            f"{more} engines need about {need / gib:.1f} GiB more, and {free / gib:.1f} GiB is available. Run fewer "
            "--formats, or fewer --tokens / --experts per run"
        )
