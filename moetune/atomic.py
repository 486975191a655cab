"""Saves that a crash cannot leave half-written: write beside the target, then rename onto it.

One implementation for every file moetune writes for a user (store shards and manifests, adapters, run
summaries, loss curves, benchmark records, checkpoints) instead of one per caller:

- :func:`write_atomically`: ``write(tmp)`` into ``<name>.tmp`` in the target's folder, fsync, ``os.replace``
  onto the target, fsync the folder. A reader sees the old file or the new one, never a mix; the temporary
  file is removed when ``write`` fails, and a fixed name means a crash leftover is overwritten by the rerun.
- :func:`replace_folder`: put a completely written folder in the place of ``final`` (an existing ``final``
  is moved aside first, since a rename cannot replace a non-empty folder, and removed after).
  :func:`recover_folder` undoes what a process killed during it, or while writing the staged folder, left:
  run it before the next write of ``final`` (and before reading ``final``, so a kill between the two renames
  never shows as a missing folder).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

TMP_SUFFIX = ".tmp"  # <name>.tmp beside <name>: recognisable as a leftover of this module's writes


def fsync(path: Path) -> None:
    """Make ``path`` durable: a file's content, or a folder's entries (a rename inside it; POSIX fsyncs the
    folder entry itself)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(final: Path) -> Path:
    """Where :func:`write_atomically` stages ``final``."""
    return final.with_name(final.name + TMP_SUFFIX)


def write_atomically(final: str | Path, write: Callable[[Path], object], *, durable: bool = True) -> Path:
    """Call ``write(tmp)`` to produce the file, then rename it onto ``final``; returns ``final``.

    ``durable``: fsync the file and its folder (stores and adapters); off for files that only matter while
    the process runs on (benchmark records), where fsync would only cost time.
    """
    final = Path(final)
    tmp = temp_path(final)
    try:
        write(tmp)
        if durable:
            fsync(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if durable:
        fsync(final.parent)
    return final


def write_text_atomically(final: str | Path, text: str, *, durable: bool = True) -> Path:
    """:func:`write_atomically` for a text file (UTF-8)."""
    return write_atomically(final, lambda tmp: tmp.write_text(text, encoding="utf-8"), durable=durable)


def replace_folder(staged: str | Path, final: str | Path, aside: str | Path) -> None:
    """Rename the complete folder ``staged`` to ``final``. An existing ``final`` is first renamed to ``aside``
    (a path on the same file system that does not exist yet) and removed once ``staged`` is in place."""
    staged, final, aside = Path(staged), Path(final), Path(aside)
    moved = final.exists()
    if moved:
        os.rename(final, aside)
    os.rename(staged, final)
    fsync(final.parent)
    if moved:
        shutil.rmtree(aside, ignore_errors=True)


def recover_folder(final: str | Path, staged: str | Path, aside: str | Path) -> list[str]:
    """Clean up after a :func:`replace_folder` of ``final`` from ``staged`` via ``aside`` that a kill interrupted
    (or a kill while ``staged`` was still being written); returns what was done, in words, each also logged.

    - ``final`` missing and ``aside`` present: the kill came between the two renames; ``aside`` is the previous
      ``final``, complete, and is renamed back (the interrupted write must then be redone).
    - ``final`` and ``aside`` present: the swap finished and only the removal of ``aside`` was cut short.
    - ``staged`` present: an unfinished (or never swapped-in) write; removed.
    """
    final, staged, aside = Path(final), Path(staged), Path(aside)
    done = []
    if aside.exists() and not final.exists():
        os.rename(aside, final)
        fsync(final.parent)
        done.append(f"restored {final} from {aside.name} (a replacement was interrupted between its renames)")
    elif aside.exists():
        shutil.rmtree(aside)
        done.append(f"removed {aside} (the previous {final.name}, already replaced)")
    if staged.exists():
        shutil.rmtree(staged)
        done.append(f"removed {staged} (left by an interrupted write)")
    for line in done:
        logger.warning("moetune: %s", line)
    return done
