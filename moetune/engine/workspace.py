"""Scratch buffers reused across calls.

Large fresh allocations on the CPU cost page faults on every step (a bf16 -> fp32 tile conversion into a
new tensor measured 6.4 ms here, into a reused one 1.0 ms). Buffers named here grow to the largest size
asked for and are then handed out as views.
"""

from __future__ import annotations

import math
import threading

import torch

MAX_VIEWS = 4096  # views kept per workspace (a few hundred bytes each)


class Workspace:
    """Named, growable scratch buffers. A view handed out is valid until the same name is asked for again with
    more elements (then a larger buffer replaces it); asked for with as many or fewer, the name hands out the same
    memory, also to threads asking at once (the engine's chunks on the expert pool each write their own part).

    The views are kept per (name, dtype, shape, inference mode) and handed out again while their buffer stays:
    the engine asks for a few hundred scratch views per expert and step, and each new view is two torch ops
    (a slice and a view; each takes the GIL back when it returns). Callers may write into a view, never change
    its shape or strides in place."""

    def __init__(self) -> None:
        self._bufs: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._views: dict[tuple[str, torch.dtype, tuple[int, ...], bool], torch.Tensor] = {}
        self._lock = threading.Lock()

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # a view made under inference_mode must not be written outside it (and the other way round is fine, but
        # one key per mode keeps the two apart simply)
        vkey = (name, dtype, tuple(shape), torch.is_inference_mode_enabled())
        view = self._views.get(vkey)  # a dict read is atomic under the GIL; entries only go under the lock
        if view is not None:
            return view
        if len(self._views) >= MAX_VIEWS:  # row counts vary per expert: bound what is kept
            with self._lock:
                self._views = {}
        numel = math.prod(shape)
        key = (name, dtype)
        with self._lock:  # two threads growing one name at once would each get a buffer of their own
            buf = self._bufs.get(key)
            if buf is None or buf.numel() < numel:
                # a normal tensor even when first asked for under torch.inference_mode: an inference tensor could
                # not be written again by a later call outside it (generate after an inference-mode evaluation)
                with torch.inference_mode(False):
                    buf = torch.empty(numel, dtype=dtype)
                self._bufs[key] = buf
                # views of the replaced buffer stay valid for whoever holds them, but are not handed out again
                self._views = {k: v for k, v in self._views.items() if k[:2] != key}
            view = self._views[vkey] = buf[:numel].view(shape)
        return view

    def __getstate__(self) -> dict[str, object]:
        # a copy (copy.deepcopy of a model, its engines with it) gets a lock of its own: locks cannot be copied
        state = self.__dict__.copy()
        del state["_lock"]
        state["_views"] = {}  # views of the copy's buffers are made again on demand
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._bufs.values())


_local = threading.local()


def thread_workspace() -> Workspace:
    """The calling thread's own workspace, for per-expert scratch (weight tiles, dequantization chunks) that
    experts computed in parallel (``moetune.engine.threads.ExpertPool``) must not share."""
    ws = getattr(_local, "workspace", None)
    if ws is None:
        ws = _local.workspace = Workspace()
    return ws
