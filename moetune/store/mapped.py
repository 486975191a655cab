"""One safetensors file memory-mapped, its tensors views of the mapping: nothing is copied.

safetensors' ``safe_open(...).get_tensor`` copies every tensor it returns into fresh (anonymous) memory.
Here the file is mapped once with ``torch.UntypedStorage.from_file(shared=False)``, a private mapping
(``MAP_PRIVATE``) of the file: its pages come from the page cache on first touch, are counted as file
pages (``RssFile``), never as anonymous memory unless written (moetune never writes expert weights), and
the kernel may drop and re-read them. Each tensor is a view at its byte offset in the data section.

Residency is managed per file: ``populate`` faults every page in ahead of use (``MADV_POPULATE_READ``; a
page-by-page read where the kernel lacks it), ``release`` drops the pages from the process
(``MADV_DONTNEED``) and from the page cache (``POSIX_FADV_DONTNEED``), so a released file costs no memory
until it is touched again. Both take views instead of the whole file (a rank's experts of a store layer,
``expert_parallel: sharded``): ``populate`` then brings in only the pages under those views, ``release`` drops
only their pages from the page cache (the file's other bytes are other ranks' business). ``sha256`` hashes the bytes through the mapping (hashlib releases the GIL, so a
background thread can hash while the engine computes), which also populates it.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import mmap
import os
from pathlib import Path
from typing import cast

import torch

from moetune.errors import LoadError
from moetune.tensorfile import TORCH_DTYPES, read_header

HASH_CHUNK = 64 << 20  # bytes hashed per hashlib call: large enough to run without the GIL, small for RAM

_MADV_DONTNEED = 4
_MADV_POPULATE_READ = 22  # Linux >= 5.14: fault pages in (reading them from disk) without touching them here
_libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL around each call
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def page_rounded(nbytes: int) -> int:
    """Memory a mapping of ``nbytes`` occupies when resident: whole pages."""
    return -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE


class MappedFile:
    """``path`` mapped into memory; ``tensors`` are views of the mapping (nothing read until touched)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        infos = read_header(path)  # LoadError naming the file if it is short or a tensor runs past its end
        self.nbytes = path.stat().st_size
        # from_file(shared=False): MAP_PRIVATE of a read-only descriptor; torch keeps the mapping alive as
        # long as any view of it lives.
        self._storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=self.nbytes)
        base = torch.empty(0, dtype=torch.uint8).set_(cast(torch.UntypedStorage, self._storage))
        self.tensors: dict[str, torch.Tensor] = {}
        for key, info in infos.items():
            dtype = TORCH_DTYPES.get(info.dtype)
            if dtype is None or math.prod(info.shape) * dtype.itemsize != info.nbytes:
                raise LoadError(
                    f"{path}: tensor {key!r} ({info.dtype} {list(info.shape)}, {info.nbytes} bytes) is corrupt"
                )
            if info.offset % dtype.itemsize:
                raise LoadError(
                    f"{path}: tensor {key!r} starts at byte {info.offset}, not a multiple of its "
                    f"{dtype.itemsize}-byte dtype {info.dtype}; rewrite the store with `moetune convert --overwrite`"
                )
            self.tensors[key] = base[info.offset : info.offset + info.nbytes].view(dtype).view(info.shape)

    @property
    def address(self) -> int:
        """Where the mapping starts (page aligned)."""
        return self._storage.data_ptr()

    def _bytes(self) -> ctypes.Array[ctypes.c_ubyte]:
        return (ctypes.c_ubyte * self.nbytes).from_address(self.address)

    def sha256(self) -> str:
        """Hex SHA-256 of the whole file, read through the mapping (which it populates)."""
        h = hashlib.sha256()
        view = memoryview(self._bytes())
        for off in range(0, self.nbytes, HASH_CHUNK):
            h.update(view[off : off + HASH_CHUNK])
        return h.hexdigest()

    def span(self, view: torch.Tensor) -> tuple[int, int]:
        """The whole pages ``[start, end)`` of the file holding ``view`` (one of ``tensors`` or a contiguous
        part of one): what bringing it in or releasing it touches."""
        start = view.data_ptr() - self.address
        end = start + view.numel() * view.element_size()
        assert 0 <= start <= end <= self.nbytes and view.is_contiguous(), "not a view of this mapping"
        return start - start % mmap.PAGESIZE, page_rounded(end)  # madvise takes a page-aligned address

    def populate(self, view: torch.Tensor | None = None) -> None:
        """Fault every page in now (from the page cache or the disk), so the engine's reads do not wait; with
        ``view`` (one of ``tensors`` or a contiguous part of one), only the pages holding its bytes."""
        start, end = (0, self.nbytes) if view is None else self.span(view)
        end = min(end, self.nbytes)  # the byte loop below reads no further than the file
        if end == start:
            return
        if _libc.madvise(self.address + start, end - start, _MADV_POPULATE_READ) == 0:
            return
        # older kernels: touch one byte per page (a C loop inside bytes(); holds the GIL while it faults)
        bytes(memoryview(self._bytes())[start : end : mmap.PAGESIZE])

    def release(self, views: list[torch.Tensor] | None = None) -> None:
        """Drop the file's pages from this process and from the page cache; the next touch re-reads them.

        With ``views`` (a rank's experts), the page cache keeps the rest of the file (other ranks on this host
        map the same file) and drops the pages under ``views``; this process still drops every page of its
        mapping, so pages the kernel mapped around the views (its read-around) do not stay resident."""
        if self.nbytes == 0:
            return
        if _libc.madvise(self.address, page_rounded(self.nbytes), _MADV_DONTNEED) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"madvise(MADV_DONTNEED) of {self.path}: {os.strerror(err)}")
        # fadvise's length 0 means "to the end of the file": the whole file, and never for an empty view
        spans = [(0, 0)] if views is None else [s for s in map(self.span, views) if s[1] > s[0]]
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for start, end in spans:
                os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
