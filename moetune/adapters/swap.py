"""Replace an adapter's two files inside a folder together, so that no crash mixes an old and a new one.

An adapter is ``adapter_config.json`` + ``adapter_model.safetensors`` (+ moetune's own files beside them, e.g.
``moetune_lora_experts.safetensors``: :data:`OPTIONAL_NAMES`) in a folder that also holds other files
(a ``moetune train`` output_dir: tokenizer, run summary, loss curve, checkpoints), so the folder itself cannot
be swapped. :func:`save_pair` instead

1. writes all its files into ``<folder>/.moetune-adapter.partial/``, with a list of their names (``.files``), and
   fsyncs them;
2. renames that folder to ``.moetune-adapter.new`` (the commit point: from here on the new pair is whole);
3. removes the folder's old config and any optional file the new adapter does not have (an old adapter's LoRA
   experts never pair with a new adapter), moves the new weights and optional files in, then the new config
   (each a rename), and removes ``.moetune-adapter.new``.

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

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from moetune.atomic import TMP_SUFFIX, fsync
from moetune.errors import AdapterError

logger = logging.getLogger(__name__)

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PARTIAL = ".moetune-adapter.partial"
COMMITTED = ".moetune-adapter.new"
LORA_EXPERTS_NAME = "moetune_lora_experts.safetensors"  # moetune.adapters.lora_experts
OPTIONAL_NAMES = (LORA_EXPERTS_NAME,)  # files an adapter may have beside the two stock ones
FILES = ".files"  # in a staged/committed adapter: the JSON list of its file names


def save_pair(
    folder: Path,
    config_text: str,
    write_weights: Callable[[Path], object],
    optional: Mapping[str, Callable[[Path], object]] | None = None,
) -> None:
    """Put a new ``adapter_config.json`` (``config_text``) and ``adapter_model.safetensors`` (written by
    ``write_weights(path)``), and the ``optional`` files (name in :data:`OPTIONAL_NAMES` -> writer), into
    ``folder`` together (module docstring); an optional file of the old adapter that the new one lacks is
    removed, other files in the folder are kept."""
    optional = dict(optional or {})
    assert set(optional) <= set(OPTIONAL_NAMES), f"unknown optional adapter files {sorted(optional)}"
    rank = _other_rank()
    if rank is not None:
        logger.info("moetune rank %d: the main process (rank 0) writes the adapter in %s", rank, folder)
        return
    folder.mkdir(parents=True, exist_ok=True)
    recover_adapter(folder)
    partial = folder / PARTIAL
    partial.mkdir()
    names = [WEIGHTS_NAME, *optional, CONFIG_NAME]  # the config last: it is moved in last
    try:
        write_weights(partial / WEIGHTS_NAME)
        for name, write in optional.items():
            write(partial / name)
        (partial / CONFIG_NAME).write_text(config_text, encoding="utf-8")
        (partial / FILES).write_text(json.dumps(names), encoding="utf-8")
        for name in (*names, FILES):
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
    # saved by an older moetune without the list: the two stock files
    names = json.loads((new / FILES).read_text()) if (new / FILES).exists() else [WEIGHTS_NAME, CONFIG_NAME]
    if (new / CONFIG_NAME).exists():  # the old config goes first: the folder never pairs old and new
        (folder / CONFIG_NAME).unlink(missing_ok=True)
        fsync(folder)
    for name in OPTIONAL_NAMES:  # the old adapter's, when the new one has none
        if name not in names:
            (folder / name).unlink(missing_ok=True)
    for name in names:
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
    for name in (WEIGHTS_NAME, CONFIG_NAME, *OPTIONAL_NAMES):
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
