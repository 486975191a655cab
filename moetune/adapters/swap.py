"""Replace an adapter's two files inside a folder together, so that no crash mixes an old and a new one.

An adapter is ``adapter_config.json`` + ``adapter_model.safetensors`` in a folder that also holds other files
(a ``moetune train`` output_dir: tokenizer, run summary, loss curve, checkpoints), so the folder itself cannot
be swapped. :func:`save_pair` instead

1. writes both files into ``<folder>/.moetune-adapter.partial/`` and fsyncs them;
2. renames that folder to ``.moetune-adapter.new`` (the commit point: from here on the new pair is whole);
3. removes the folder's old config, moves the new weights in, then the new config (each a rename), and removes
   the empty ``.moetune-adapter.new``.

A kill before 2 leaves the old pair untouched (and a partial folder that the next save or load removes); a
kill after 2 is finished by the next save or load (:func:`recover_adapter` rolls forward). In between the
renames of 3 the folder has no ``adapter_config.json``, so no loader, stock PEFT included, can read the new
weights with the old config or the other way round: it fails on the missing file instead, and moetune recovers.
:func:`recover_adapter` also removes what older moetune versions left (``.<name>.tmp-*`` folders beside the
folder, restoring a previous adapter that one moved aside, and ``<file>.tmp`` files inside it).

In a run of several processes (``torch.distributed`` set up) the main process alone writes: on the others
:func:`save_pair` logs that it leaves the save to rank 0, and :func:`recover_adapter` only looks, raising
``AdapterError`` if it finds an interrupted save (which the main process finishes; ``moetune train`` has it
recover before the other ranks look).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from moetune.atomic import TMP_SUFFIX, fsync
from moetune.errors import AdapterError

logger = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PARTIAL = ".moetune-adapter.partial"
COMMITTED = ".moetune-adapter.new"


def save_pair(folder: Path, config_text: str, write_weights: Callable[[Path], object]) -> None:
    """Put a new ``adapter_config.json`` (``config_text``) and ``adapter_model.safetensors`` (written by
    ``write_weights(path)``) into ``folder`` together (module docstring); other files in it are kept."""
    rank = _other_rank()
    if rank is not None:
        logger.info("moetune rank %d: the main process (rank 0) writes the adapter in %s", rank, folder)
        return
    folder.mkdir(parents=True, exist_ok=True)
    recover_adapter(folder)
    partial = folder / PARTIAL
    partial.mkdir()
    try:
        write_weights(partial / WEIGHTS_NAME)
        (partial / CONFIG_NAME).write_text(config_text, encoding="utf-8")
        for name in (WEIGHTS_NAME, CONFIG_NAME):
            fsync(partial / name)
        fsync(partial)
        os.rename(partial, folder / COMMITTED)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    fsync(folder)
    _roll_forward(folder)


def _roll_forward(folder: Path) -> None:
    """Move a committed pair into place; safe to repeat after a kill at any point of it."""
    new = folder / COMMITTED
    if (new / CONFIG_NAME).exists():  # the old config goes first: the folder never pairs old and new
        (folder / CONFIG_NAME).unlink(missing_ok=True)
        fsync(folder)
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        if (new / name).exists():
            os.replace(new / name, folder / name)
    fsync(folder)
    shutil.rmtree(new)


def recover_adapter(folder: Path) -> list[str]:
    """Finish or clean up what an interrupted adapter save left in or beside ``folder``; returns what was
    done, in words (each also logged). Changes nothing when nothing was interrupted. On a process other than
    the main one of a multi-process run, ``AdapterError`` instead of any change."""
    done: list[str] = []
    parent, prefix = folder.parent, f".{folder.name}.tmp-"
    legacy = sorted(p for p in parent.iterdir() if p.name.startswith(prefix)) if parent.is_dir() else []
    rank = _other_rank()
    if rank is not None:
        leftovers = [*legacy, folder / COMMITTED, folder / PARTIAL]
        leftovers += [folder / (name + TMP_SUFFIX) for name in (WEIGHTS_NAME, CONFIG_NAME)]
        found = [str(p) for p in leftovers if p.exists()]
        if found:
            raise AdapterError(
                f"rank {rank} found an interrupted adapter save ({', '.join(found)}); only the main process "
                "(rank 0) recovers it: recover it first there (moetune train does), or load once in one process"
            )
        return done
    asides = [p for p in legacy if p.name.endswith("-old") and (p / CONFIG_NAME).is_file()]
    if asides and not folder.exists():  # an older moetune was killed between its two folder renames
        os.rename(asides[-1], folder)
        done.append(f"restored the previous adapter {folder} from {asides[-1].name}")
    for p in legacy:
        if p.exists():
            shutil.rmtree(p)
            done.append(f"removed {p} (left by an interrupted adapter save)")
    if (folder / COMMITTED).is_dir():
        _roll_forward(folder)
        done.append(f"finished an interrupted save of the adapter in {folder}")
    if (folder / PARTIAL).exists():
        shutil.rmtree(folder / PARTIAL)
        done.append(
            f"removed {folder / PARTIAL} (an adapter save that did not finish; the previous one is kept)"
        )
    for name in (WEIGHTS_NAME, CONFIG_NAME):
        leftover = folder / (name + TMP_SUFFIX)
        if leftover.is_file():
            leftover.unlink()
            done.append(f"removed {leftover} (left by an interrupted adapter save)")
    for line in done:
        logger.warning("moetune: %s", line)
    return done


def _other_rank() -> int | None:
    """This process's rank when it is not the main process of a ``torch.distributed`` group, else None."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return dist.get_rank()
    return None
