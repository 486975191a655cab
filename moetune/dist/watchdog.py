"""An exception on any rank ends every rank within seconds, each printing the cause.

Without this, the ranks that did not fail wait in their next collective (a DDP all-reduce, a save barrier) until
its timeout (``ddp_timeout``, 30 minutes by default) and then die with a timeout that does not name the cause.
Instead:

- :func:`failures_end_every_rank` wraps a rank's whole run; an exception leaving it writes
  ``"rank R: <type>: <message>"`` under one key of the process group's key-value store (the first failure wins),
  waits (at most ``ACK_WAIT_S``) for the other ranks to acknowledge, and is re-raised, so the failing rank prints
  its traceback and exits non-zero;
- a daemon thread on every rank (:func:`start_watchdog`) polls that key every ``POLL_S`` seconds; when it
  appears, the thread prints ``moetune rank R: stopping: rank F failed: ...`` to stderr, acknowledges and ends
  its process with exit status 1 (``os._exit``: the main thread may be blocked inside a collective, where no
  Python exception can reach it).

A rank that hangs without raising is ended by the collective timeout (``ddp_timeout``), which then raises on the
ranks waiting for it and takes the path above. The store is the one the process group was created with (under
``torchrun`` and ``accelerate launch`` it lives in the launcher's agent, so it outlives any rank).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from moetune.dist.group import Ranks, barrier

FAILED = "moetune/failed"
ACK = "moetune/ack/"
POLL_S = 0.2  # how soon another rank's failure is seen; a store check is one small TCP round trip
ACK_WAIT_S = 20.0  # how long a failing rank waits for the others to print the cause before it exits

_thread: threading.Thread | None = None
_stop = threading.Event()


def _store() -> Any:
    """The default process group's key-value store."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _end(ranks: Ranks, line: str) -> None:
    print(f"moetune rank {ranks.rank}: stopping: {line}", file=sys.stderr, flush=True)
    os._exit(1)


def _watch(ranks: Ranks, store: Any) -> None:
    while not _stop.wait(POLL_S):
        try:
            failed = store.check([FAILED])
            cause = store.get(FAILED).decode() if failed else None
        except Exception as err:  # the store is gone: the process that held it ended
            if _stop.is_set() or sys.is_finalizing():  # or this process is ending: nothing to stop
                return
            _end(ranks, f"lost the process group's store ({type(err).__name__}: {err}); another rank ended")
        if cause is not None and not _stop.is_set():
            try:
                store.set(ACK + str(ranks.rank), "1")
            finally:
                _end(ranks, cause)


def start_watchdog(ranks: Ranks) -> None:
    """Start this rank's watchdog thread (once per process)."""
    global _thread
    if _thread is not None:
        return
    _stop.clear()
    _thread = threading.Thread(target=_watch, args=(ranks, _store()), name="moetune-watchdog", daemon=True)
    _thread.start()


def stop_watchdog() -> None:
    """Stop this rank's watchdog thread (at the end of a run, or before this rank announces its own failure)."""
    global _thread
    _stop.set()
    if _thread is not None:
        _thread.join()
        _thread = None


def announce_failure(ranks: Ranks, exc: BaseException) -> None:
    """Tell every rank that this one failed with ``exc`` and wait (bounded) until they have seen it."""
    stop_watchdog()
    cause = f"rank {ranks.rank} failed: {type(exc).__name__}: {exc}".splitlines()[0]
    print(f"moetune rank {ranks.rank}: {cause.split(': ', 1)[1]}", file=sys.stderr, flush=True)
    try:
        store = _store()
        store.compare_set(FAILED, "", cause)  # the first failure is the one every rank reports
        others = [ACK + str(r) for r in range(ranks.world) if r != ranks.rank]
        store.wait(others, timedelta(seconds=ACK_WAIT_S))
    except Exception as err:  # a rank that already ended cannot acknowledge; the launcher ends the rest
        print(f"moetune rank {ranks.rank}: not every rank acknowledged the failure ({err})", file=sys.stderr)


@contextmanager
def failures_end_every_rank(ranks: Ranks) -> Iterator[None]:
    """Run the body; an exception from it ends every rank (module docstring). A body that finishes stops the
    watchdog and waits for every rank, so no rank exits while another could still report a failure."""
    if not ranks.distributed:
        yield
        return
    try:
        yield
    except BaseException as exc:
        announce_failure(ranks, exc)
        raise
    stop_watchdog()
    barrier(ranks)
