"""Disk residency: experts larger than RAM, each layer's weights paged in just in time within a byte budget.

Each layer's stored weights live in memory-mapped pages (``Pageable``: a store file, see
``moetune.store.mapped``) and are wrapped in :class:`PagedExperts`, a format that tells the shared
:class:`ResidencyWindow` whenever the engine starts reading a different layer. The window then

1. waits for that layer's pages (prefetched in the background, or faulted in now: a miss);
2. predicts the layer read next and prefetches it on one background thread, so its disk reads overlap
   the current layer's GEMMs;
3. releases least recently used layers until the current one plus the prefetched one fit the budget.

The prediction learns from the order seen: after layer ``b`` followed ``a``, it predicts what came after
``(a, b)`` last time. Training reads layers 0..L-1 forward, L-1..0 backward and 0.. again, so after one
step every turn is known; before that it continues in the direction of the last move. A wrong guess costs
one synchronous read (a miss), never a wrong result: the pages are file-backed and clean, so a released
layer that is read anyway is faulted in again from its file. Full mode (writing base weights) is refused by
the engine for any format but ``DenseExperts``, so paged weights are never written.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from moetune.engine.formats.base import ExpertFormat, Projection
from moetune.errors import EngineError


class Pageable(Protocol):
    """One layer's stored bytes that can be brought into memory and dropped again."""

    nbytes: int

    def warm(self) -> None:
        """Bring every page into memory (may check the bytes; raises if they are wrong)."""

    def release(self) -> None:
        """Drop the pages from memory; they are read again when touched."""


@dataclass
class ResidencyStats:
    """What the window did: ``hits`` (the layer was prefetched), ``misses`` (read synchronously),
    ``wait_seconds`` (time the engine waited for pages), ``bytes_read`` (pages warmed), ``peak_bytes``
    (the most bytes held or being prefetched at once, by the window's accounting)."""

    hits: int = 0
    misses: int = 0
    wait_seconds: float = 0.0
    bytes_read: int = 0
    peak_bytes: int = 0


class ResidencyWindow:
    """The layers whose pages are in memory, at most ``budget`` bytes; shared by every ``PagedExperts``.

    ``budget`` must hold the two largest layers at once: the one computing and the one being prefetched.
    """

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.current: int | None = None  # the layer read last
        self.stats = ResidencyStats()
        self._pages: list[Pageable] = []
        self._resident: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._jobs: dict[int, Future[None]] = {}  # prefetches submitted, not yet waited for
        self._after: dict[tuple[int | None, int], int] = {}  # (previous, current) -> layer read next
        self._previous: int | None = None
        self._lock = threading.Lock()
        self._entering = threading.Lock()  # the engine's pool workers of one pass enter their layer once
        self._ready: int | None = None  # the layer ``ensure`` entered last, once its pages were in
        self._pool: ThreadPoolExecutor | None = None

    def add(self, pages: Pageable) -> int:
        """Register one layer's pages (not resident yet); returns its index."""
        if 2 * pages.nbytes > self.budget:
            raise EngineError(
                f"residency budget {self.budget} bytes cannot hold two layers of {pages.nbytes} bytes "
                "(the one computing and the one prefetched)"
            )
        self._pages.append(pages)
        return len(self._pages) - 1

    @property
    def resident_bytes(self) -> int:
        """Bytes of the layers held or being prefetched."""
        return sum(self._pages[i].nbytes for i in (*self._resident, *self._jobs))

    def ensure(self, index: int) -> None:
        """``enter(index)`` unless layer ``index`` is the one being read. Threads reading the same layer at once
        (the engine's expert pool) enter it once: the others wait for that, then read."""
        if self._ready == index == self.current:
            return
        with self._entering:
            if not self._ready == index == self.current:
                self.enter(index)  # sets current first, so another thread must not take current as ready
                self._ready = index

    def enter(self, index: int) -> None:
        """Layer ``index`` is about to be read: make it resident, prefetch the next, release the oldest."""
        with self._lock:
            previous, self.current = self.current, index
            if previous is not None and previous != index:
                self._after[(self._previous, previous)] = index
                self._previous = previous
            job = self._jobs.pop(index, None)
            resident = index in self._resident
        start = time.perf_counter()
        try:
            if job is not None:
                job.result()  # re-raises what the prefetch raised (e.g. an altered store file)
            elif not resident:
                self._pages[index].warm()
        except BaseException:
            self.current = None  # not entered: the next read of this layer tries (and checks) again
            raise
        self.stats.wait_seconds += time.perf_counter() - start
        self.stats.hits += resident or job is not None
        self.stats.misses += not resident and job is None
        self.stats.bytes_read += 0 if resident else self._pages[index].nbytes
        with self._lock:
            self._resident[index] = None
            self._resident.move_to_end(index)
            nxt = self._predict(index)
            self._evict(keep={index, nxt})
            if nxt not in self._resident and nxt not in self._jobs:
                self._jobs[nxt] = self._executor().submit(self._pages[nxt].warm)
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.resident_bytes)

    def _predict(self, index: int) -> int:
        learned = self._after.get((self._previous, index))
        if learned is not None:
            return learned
        step = 1 if self._previous is None or self._previous < index else -1
        nxt = index + step
        return nxt if 0 <= nxt < len(self._pages) else index - step if len(self._pages) > 1 else index

    def _evict(self, keep: set[int]) -> None:
        """Release least recently used layers (never those in ``keep``) until ``keep`` fits the budget."""
        incoming = sum(self._pages[i].nbytes for i in keep if i not in self._resident and i not in self._jobs)
        for victim in [*self._resident, *self._jobs]:
            if self.resident_bytes + incoming <= self.budget:
                return
            if victim in keep:
                continue
            job = self._jobs.pop(victim, None)
            if job is not None:
                job.exception()  # a wrong guess still prefetching: let it finish; its error no longer matters
            self._resident.pop(victim, None)
            self._pages[victim].release()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:  # one thread: prefetches are disk reads, one at a time is what the disk wants
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moetune-prefetch")
        return self._pool

    def close(self) -> None:
        """Wait for prefetches in flight and release every layer."""
        with self._lock:
            for job in self._jobs.values():
                job.exception()
            for index in [*self._resident, *self._jobs]:
                self._pages[index].release()
            self._resident.clear()
            self._jobs.clear()
            self.current = None
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None


class PagedExperts(ExpertFormat):
    """A stored format whose weights are memory-mapped and paged by a :class:`ResidencyWindow`.

    Same contract as the wrapped format (``tile`` and ``scaled_tile`` return what it returns); every read first
    tells the window which layer it is in. Not registered in ``FORMATS``: it stores nothing itself.
    """

    def __init__(self, inner: ExpertFormat, window: ResidencyWindow, pages: Pageable) -> None:
        self.inner = inner
        self.window = window
        self.index = window.add(pages)
        self.name = inner.name
        self.SCALED_TILE_DTYPES = inner.SCALED_TILE_DTYPES  # the GEMMs read it as the wrapped format's
        # the fused kernels read the wrapped format's (memory-mapped) codes as they read them in RAM: an engine
        # over the paged store takes the same GEMM path, so it computes the same numbers
        self.FUSED_MAX_ROWS = inner.FUSED_MAX_ROWS
        self.num_experts, self.hidden_size = inner.num_experts, inner.hidden_size
        self.intermediate_size = inner.intermediate_size

    @classmethod
    def from_dense(cls, gate_up: torch.Tensor, down: torch.Tensor, **options: Any) -> ExpertFormat:
        """Not a storage format: quantize with the wrapped format's ``from_dense`` and store that."""
        raise EngineError(
            "PagedExperts pages a stored format and quantizes nothing: build the format (FORMATS[name]."
            "from_dense), write it to a store (moetune convert) and load it with expert_residency='disk'"
        )

    def _enter(self) -> None:
        self.window.ensure(self.index)

    def tile(
        self,
        proj: Projection,
        expert: int,
        dtype: torch.dtype,
        buf: torch.Tensor | None,
        rows: slice | None = None,
    ) -> torch.Tensor:
        self._enter()
        return self.inner.tile(proj, expert, dtype, buf, rows)

    def scaled_tile(
        self, proj: Projection, expert: int, dtype: torch.dtype, buf: torch.Tensor, rows: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._enter()
        return self.inner.scaled_tile(proj, expert, dtype, buf, rows)

    def fused_operands(self, proj: Projection, expert: int) -> tuple[str, tuple[Any, ...]]:
        self._enter()
        return self.inner.fused_operands(proj, expert)

    def fused_run_operands(self, proj: Projection) -> tuple[str, tuple[Any, ...]]:
        self._enter()
        return self.inner.fused_run_operands(proj)

    def stored_in(self, proj: Projection, dtype: torch.dtype) -> torch.Tensor | None:
        self._enter()
        return self.inner.stored_in(proj, dtype)

    def dequantize(
        self, dtype: torch.dtype = torch.float32, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._enter()
        return self.inner.dequantize(dtype, out)

    def row_align(self, proj: Projection) -> int:
        return self.inner.row_align(proj)

    def needs_buffer(self, dtype: torch.dtype) -> bool:
        return self.inner.needs_buffer(dtype)

    def params(self) -> dict[str, Any]:
        return self.inner.params()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.inner.state_tensors()

    @property
    def nbytes(self) -> int:
        """The stored bytes (memory-mapped; at most the window's budget of them are resident at once)."""
        return self.inner.nbytes

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.inner.storage_dtype
