"""``convert_checkpoint``: a checkpoint's routed experts, quantized once, written as a store (``store``).

The checkpoint is planned exactly as ``load_model`` plans it (``load.plan_load``: headers, config, the
model on the meta device, experts sites, which tensor feeds which layer, each layer's format), then
``stream_experts`` reads and quantizes one layer at a time and each layer is written and dropped before the
next is read. Peak memory: one layer's dense experts (in the checkpoint's float dtype; bf16 for an FP8
checkpoint dequantized to another format) plus the same layer quantized.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from moetune.config.experts import AUTO
from moetune.engine.threads import set_engine_threads
from moetune.errors import ConfigError
from moetune.loading.expert_plan import FLOAT_DTYPES
from moetune.loading.load import plan_load
from moetune.loading.options import LoadOptions
from moetune.loading.stream import stream_experts
from moetune.progress import format_bytes
from moetune.store.files import StoreWriter
from moetune.store.manifest import Manifest, SourceIdentity

logger = logging.getLogger(__name__)


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    expert_format: str,
    *,
    int4_group_size: int | None = None,
    int4_symmetric: bool | None = None,
    overwrite: bool = False,
    num_threads: int | None = None,
    progress: bool = True,
) -> Manifest:
    """Write ``src``'s routed experts to store ``dst`` in ``expert_format`` (``int8``, ``int4``, ``fp8``/
    ``fp8_block``, ``mxfp4``, or ``bf16``/``dense``: unquantized bf16, for disk residency). FP8 and MXFP4
    checkpoints written in their own format keep their bytes as shipped.

    Every check (destination, options, checkpoint headers, int4 group size against H and I) runs before
    anything is read or removed; ``dst`` must be new, empty, or a store (``moetune.store.destination``). The
    store is written beside ``dst`` and swapped in whole at the end, so a failure, NaN/Inf source weights
    included (``LoadError`` naming file, tensor and layer), leaves ``dst`` as it was. Returns the manifest.
    """
    if expert_format == AUTO:
        raise ConfigError(
            "a store needs an explicit expert format: int8, int4, fp8, mxfp4 or bf16 (not 'auto')"
        )
    writer = StoreWriter.prepare(dst, overwrite=overwrite)
    opts = LoadOptions.create(
        device="cpu",
        dtype="bfloat16",
        num_threads=num_threads,
        progress=progress,
        expert_format=expert_format,
        int4_group_size=int4_group_size,
        int4_symmetric=int4_symmetric,
    )
    planned = plan_load(src, opts)
    source = SourceIdentity.of(planned.checkpoint)
    # process-wide, once: quantizing runs on torch's intra-op pool
    set_engine_threads(opts.experts.num_threads)
    writer.begin()
    try:  # a failure (NaN source weights, a full disk, Ctrl-C) leaves dst as it was; a kill -9, the staging
        for layer, engine in stream_experts(  # folder, which the next convert to dst removes
            planned.checkpoint,
            planned.plan.layers,
            planned.formats,
            _stream_dtype(planned, opts),
            opts.engine,
            progress=progress,
        ):
            writer.add(layer.site.path, engine.weights, engine.gate_up_bias, engine.down_bias)
        manifest = writer.finish(planned.checkpoint.model_type, source)
    except BaseException:
        writer.abort()
        raise
    stored = sum(f.size for f in manifest.files.values())
    logger.info(
        "moetune: %d experts modules of %s written to %s as %s (%s)",
        len(manifest.layers),
        planned.checkpoint.path,
        writer.root,
        manifest.format,
        format_bytes(stored),
    )
    return manifest


def _stream_dtype(planned, opts: LoadOptions) -> torch.dtype:
    """The dtype dense experts are read in: bf16 for a bf16 store, else the checkpoint's own float dtype
    (quantizing from it exactly as ``load_model`` does), bf16 for FP8 and MXFP4 checkpoints."""
    if opts.experts.expert_format == "dense":
        return torch.bfloat16
    codes = {s.info.dtype for layer in planned.plan.layers for s in layer.sources}
    floats = [FLOAT_DTYPES[c] for c in codes if c in FLOAT_DTYPES]
    return max(floats, key=lambda d: d.itemsize) if floats else torch.bfloat16
