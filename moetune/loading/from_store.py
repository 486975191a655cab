"""Engines over a pre-quantized store (``load_model(..., expert_path=DST)``), resident in RAM or paged from disk.

``expert_residency``:

* ``ram`` (default): each layer's file is memory-mapped and read once while loading (the SHA-256 pass,
  which brings its pages in); the formats hold views of the mappings. The pages are clean file pages: they
  count as the process's ``RssFile``, not as anonymous memory, and nothing is copied.
* ``disk``: nothing is read while loading but the headers (and fp8's finiteness scan, released again).
  Every layer is wrapped in ``PagedExperts`` under one ``ResidencyWindow`` of ``expert_residency_budget``
  bytes (default: the least that works, the two largest layers' files): the layer computing and the one
  prefetched. Each file is hashed the first time the prefetcher reads it.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moetune.engine import EngineOptions, ExpertEngine, get_activation
from moetune.engine.residency import PagedExperts, ResidencyWindow
from moetune.errors import ConfigError
from moetune.loading.checkpoint import Checkpoint
from moetune.loading.manifest import SourceIdentity
from moetune.loading.progress import LayerProgress
from moetune.loading.store import ExpertStore, StorePages

if TYPE_CHECKING:
    from moetune.arch import ExpertsSite
    from moetune.loading.expert_plan import LayerPlan
    from moetune.loading.options import LoadOptions

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


class ExpertResidency(str, enum.Enum):
    """Where routed experts read from a store live while training."""

    RAM = "ram"  # every layer's pages in memory
    DISK = "disk"  # paged in just in time, at most the budget at once


def parse_bytes(value: object) -> int | None:
    """``1073741824``, ``"64GB"``, ``"1.5 GiB"``, ``"512MB"`` -> bytes; None if it is none of these."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else None
    if not isinstance(value, str):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if m is None or m.group(2).lower() not in _UNITS:
        return None
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return n if n > 0 else None


def residency_problems(
    expert_path: object, expert_residency: object, expert_residency_budget: object
) -> list[tuple[str, str]]:
    """``(option, what is wrong and what is allowed)`` for each bad store option; shared by ``load_model``'s
    keyword arguments and the YAML's ``moetune:`` section."""
    problems = []
    if expert_path is not None and not isinstance(expert_path, (str, Path)):
        problems.append(("expert_path", f"must be a directory path; got {expert_path!r}"))
    allowed = [r.value for r in ExpertResidency]
    if expert_residency not in allowed and not isinstance(expert_residency, ExpertResidency):
        problems.append(("expert_residency", f"got {expert_residency!r}; allowed: {', '.join(allowed)}"))
    elif ExpertResidency(expert_residency) is ExpertResidency.DISK and expert_path is None:
        problems.append(
            (
                "expert_residency",
                "'disk' pages experts from a converted store: convert once (moetune convert SRC DST --format "
                "int8) and set expert_path to DST",
            )
        )
    if expert_residency_budget is not None:
        if parse_bytes(expert_residency_budget) is None:
            problems.append(
                (
                    "expert_residency_budget",
                    f"got {expert_residency_budget!r}; allowed: a positive number of bytes, or a size such as '64GB' or '512MiB'",
                )
            )
        elif expert_residency != ExpertResidency.DISK:
            problems.append(
                (
                    "expert_residency_budget",
                    f"is set ({expert_residency_budget!r}) but applies to expert_residency disk only",
                )
            )
    return problems


def open_store(opts: LoadOptions, checkpoint: Checkpoint, sites: list[ExpertsSite]) -> ExpertStore:
    """``opts.expert_path`` opened and checked against the model about to load (``LoadError`` naming the file),
    including an ``expert_format`` and int4 options given explicitly."""
    assert opts.expert_path is not None
    store = ExpertStore.open(opts.expert_path)
    asked = {"group_size": opts.int4_group_size, "symmetric": opts.int4_symmetric}
    store.check_model(
        checkpoint.model_type,
        sites,
        SourceIdentity.of(checkpoint),
        None if opts.expert_format == "auto" else opts.expert_format,
        {k: v for k, v in asked.items() if v is not None},
    )
    return store


def store_engines(
    store: ExpertStore,
    layers: list[LayerPlan],
    dtype: torch.dtype,
    options: EngineOptions,
    residency: ExpertResidency = ExpertResidency.RAM,
    budget: int | None = None,
    *,
    progress: bool = True,
) -> Iterator[tuple[LayerPlan, ExpertEngine]]:
    """Yield ``(layer, engine)`` in plan order over ``store``'s files (checked with ``check_model`` before).

    Biases are copied in ``dtype``; the expert weights stay as stored (views of the mappings).
    ``ConfigError`` before anything is read if a disk ``budget`` cannot hold the two largest layers.
    """
    window = None
    if residency is ExpertResidency.DISK:
        largest = sorted(store.layer_resident_bytes(layer.site.path) for layer in layers)[-2:]
        if budget is not None and budget < sum(largest):
            raise ConfigError(
                f"expert_residency_budget {budget} bytes cannot hold the two largest layers of {store.root} "
                f"({' + '.join(map(str, largest))} bytes: the layer computing and the one prefetched); "
                f"set it to at least {sum(largest)}"
            )
        window = ResidencyWindow(sum(largest) if budget is None else budget)
    total = sum(store.layer_nbytes(layer.site.path) for layer in layers)
    with LayerProgress(len(layers), total, "moetune: routed experts (store)", progress) as bar:
        for layer in layers:
            path, lay = layer.site.path, layer.site.layout
            mapped = store.map_layer(path)
            if window is None:
                store.verify_mapped(mapped)  # the pass that brings the pages in
            fmt, gate_up_bias, down_bias = store.build(path, mapped)
            if window is not None:
                fmt = PagedExperts(fmt, window, StorePages(store, mapped))
                mapped.release()  # whatever building touched (fp8's NaN scan): paged in when used
            engine = ExpertEngine(
                fmt,
                activation=get_activation(lay.activation, **dict(lay.activation_kwargs)),
                # biases are small: owned copies, so no engine tensor but the paged weights maps the store
                gate_up_bias=None if gate_up_bias is None else gate_up_bias.to(dtype, copy=True),
                down_bias=None if down_bias is None else down_bias.to(dtype, copy=True),
                options=options,
                name=path,
            )
            bar.advance(store.layer_nbytes(path))
            yield layer, engine
