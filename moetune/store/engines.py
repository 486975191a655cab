"""Engines over a pre-quantized store (``load_model(..., expert_path=DST)``), resident in RAM or paged from disk.

``expert_residency``:

* ``ram`` (default): each layer's file is memory-mapped and read once while loading (the SHA-256 pass,
  which brings its pages in); the formats hold views of the mappings. The pages are clean file pages: they
  count as the process's ``RssFile``, not as anonymous memory, and nothing is copied.
* ``disk``: nothing is read while loading but the headers (and fp8's finiteness scan, released again).
  Every layer is wrapped in ``PagedExperts`` under one ``ResidencyWindow`` of ``expert_residency_budget``
  bytes (default: the least that works, the two largest layers' files): the layer computing and the one
  prefetched. Each file is hashed the first time the prefetcher reads it.

With ``expert_parallel: sharded`` a rank's layer is its experts' rows of each file (one byte range per tensor):
``ram`` maps the file and reads those ranges only; ``disk`` pages those ranges only (``StorePages`` over the
share), and the budget and its default count the rank's shares (per process, so a node's ranks together
hold up to their budgets' sum). Either way the rank's rows are checked against their per-expert hashes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from moetune.config.experts import AUTO, ExpertOptions, ExpertResidency
from moetune.engine import EngineOptions, ExpertEngine, get_activation
from moetune.engine.residency import PagedExperts, ResidencyWindow
from moetune.errors import ConfigError
from moetune.progress import LayerProgress
from moetune.store.files import ExpertStore, StorePages
from moetune.store.manifest import SourceIdentity

if TYPE_CHECKING:
    from moetune.arch import ExpertsSite


def open_store(
    experts: ExpertOptions, model_type: str, source: SourceIdentity, sites: list[ExpertsSite]
) -> ExpertStore:
    """``experts.expert_path`` opened and checked against the model about to load, of ``model_type`` from the
    checkpoint ``source`` (``LoadError`` naming the file), including an ``expert_format`` and int4 options
    given explicitly."""
    assert experts.expert_path is not None
    store = ExpertStore.open(experts.expert_path)
    asked = {"group_size": experts.int4_group_size, "symmetric": experts.int4_symmetric}
    store.check_model(
        model_type,
        sites,
        source,
        None if experts.expert_format == AUTO else experts.expert_format,
        {k: v for k, v in asked.items() if v is not None},
    )
    return store


def store_engines(
    store: ExpertStore,
    sites: list[ExpertsSite],
    dtype: torch.dtype,
    options: EngineOptions,
    residency: ExpertResidency = ExpertResidency.RAM,
    budget: int | None = None,
    *,
    progress: bool = True,
    experts: list[range] | None = None,
) -> Iterator[ExpertEngine]:
    """Yield one engine per site, in order, over ``store``'s files (checked with ``check_model`` before).

    Biases are copied in ``dtype``; the expert weights stay as stored (views of the mappings).
    ``ConfigError`` before anything is read if a disk ``budget`` cannot hold the two largest layers.
    ``experts``: per site, the experts this rank holds (``expert_parallel: sharded``): each engine holds those
    experts' rows and only their bytes are read (verified against the manifest's per-expert hashes: while
    loading in ``ram`` residency, at the first page-in in ``disk`` residency, whose window and ``budget`` then
    count this rank's shares, not whole files). None: every expert.
    """
    shares: list[range | None] = [None] * len(sites) if experts is None else list(experts)
    assert len(shares) == len(sites), "one range of experts per site"
    window = None
    if residency is ExpertResidency.DISK:
        largest = sorted(store.share_resident_bytes(site.path, share) for site, share in zip(sites, shares))[
            -2:
        ]
        if budget is not None and budget < sum(largest):
            whose = "" if experts is None else " (this process's experts of them: expert_parallel sharded)"
            raise ConfigError(
                f"expert_residency_budget {budget} bytes cannot hold the two largest layers of {store.root}"
                f"{whose} ({' + '.join(map(str, largest))} bytes: the layer computing and the one prefetched); "
                f"set it to at least {sum(largest)}"
            )
        window = ResidencyWindow(sum(largest) if budget is None else budget)
    total = sum(store.share_nbytes(site.path, share) for site, share in zip(sites, shares))
    with LayerProgress(len(sites), total, "moetune: routed experts (store)", progress) as bar:
        for site, share in zip(sites, shares):
            path, lay = site.path, site.layout
            mapped = store.map_layer(path)
            if window is None and share is not None:
                store.verify_share(mapped, share)  # the rank's bytes only, brought in by the hashing
            elif window is None:
                store.verify_mapped(mapped)  # the pass that brings the pages in
            fmt, gate_up_bias, down_bias = store.build(path, mapped, share)
            # biases are small: owned copies, so no engine tensor but the paged weights maps the store
            biases = [None if b is None else b.to(dtype, copy=True) for b in (gate_up_bias, down_bias)]
            if window is not None:
                pages = StorePages(store, mapped, share)
                fmt = PagedExperts(fmt, window, pages)
                pages.release()  # whatever building touched (fp8's NaN scan, the biases): paged in when used
            engine = ExpertEngine(
                fmt,
                activation=get_activation(lay.activation, **dict(lay.activation_kwargs)),
                gate_up_bias=biases[0],
                down_bias=biases[1],
                options=options,
                name=path,
            )
            bar.advance(store.share_nbytes(path, share))
            yield engine
