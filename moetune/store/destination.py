"""Where ``moetune convert`` may write a store, and how a store is swapped in without losing what was there.

A destination ``DST`` is accepted when it is

- absent, or an empty folder;
- a finished store (its ``manifest.json`` parses as a store manifest and every other entry is a file the
  manifest lists, or such a file's ``.tmp``): replaced only with ``overwrite``;
- an unfinished store of an older moetune, which wrote layer by layer into ``DST`` itself: every entry is a
  store layer file whose safetensors metadata says ``moetune_store`` (or a manifest temporary saying so, or an
  empty temporary of either, created by a writer killed before it wrote a byte).

Anything else (a file, a folder holding a file moetune did not write, such as a weights backup named
``model.safetensors``) is a ``ConfigError`` naming the entries: ``convert`` never deletes a file it did not
write.

The store is written into ``.DST.moetune-convert`` beside ``DST`` and put in place whole once its manifest is
written (``atomic.replace_folder``; a previous ``DST`` waits in ``.DST.moetune-replaced`` and is removed
after). A kill at any point leaves ``DST`` as it was, or, between the two renames, the previous store aside;
the next ``convert`` to ``DST`` first restores or removes these (``atomic.recover_folder``) and starts over.
``ExpertStore.open`` never writes: it names what an interrupted conversion left (:func:`unfinished_note`).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

from moetune.atomic import TMP_SUFFIX, recover_folder
from moetune.errors import ConfigError, LoadError, listing
from moetune.store.manifest import MANIFEST, Manifest

SUFFIX = ".safetensors"
_STORE_FILE = re.compile(rf"(.+{re.escape(SUFFIX)}|{re.escape(MANIFEST)})({re.escape(TMP_SUFFIX)})?")
_MARKER = b'"moetune_store":"1"'  # StoreWriter's safetensors metadata, as the header stores it
_MAX_HEADER = 100 << 20  # a store layer file's header is a few KiB; more means it is not one


def staging_paths(root: Path) -> tuple[Path, Path]:
    """(the folder a conversion writes into, where a replaced store waits until the new one is in place)."""
    return root.with_name(f".{root.name}.moetune-convert"), root.with_name(f".{root.name}.moetune-replaced")


def recover(root: Path) -> list[str]:
    """Restore or remove what an interrupted conversion into ``root`` left beside it (logged, returned)."""
    staged, aside = staging_paths(root)
    return recover_folder(root, staged, aside)


def unfinished_note(root: Path) -> str:
    """A sentence on what an interrupted conversion into ``root`` left beside it ("" when nothing)."""
    staged, aside = staging_paths(root)
    if aside.exists() and not root.exists():
        return (
            f" A conversion replacing it was interrupted: the previous store is in {aside}; running moetune "
            f"convert to {root} again restores it first."
        )
    if staged.exists():
        return f" A conversion into it did not finish (its partial output is {staged}); run moetune convert again."
    return ""


def written_by_moetune(path: Path) -> bool:
    """Whether ``path`` is a file a moetune store writer produced: a layer file (or its temporary, possibly cut
    short by a kill) whose safetensors header carries the ``moetune_store`` metadata, or a manifest temporary
    that starts as a manifest does. Reads at most the header. An empty temporary of such a name counts too: a kill
    right after the writer created it leaves it so, and it holds nothing to lose."""
    if not path.is_file() or not _STORE_FILE.fullmatch(path.name):
        return False
    try:
        if path.name.endswith(TMP_SUFFIX) and path.stat().st_size == 0:
            return True
        with path.open("rb") as f:
            if path.name.startswith(MANIFEST):
                return b'"moetune_store"' in f.read(64)
            (size,) = struct.unpack("<Q", f.read(8))
            return size <= _MAX_HEADER and _MARKER in f.read(size)
    except (OSError, struct.error):
        return False


def check_destination(root: Path, *, overwrite: bool) -> None:
    """``ConfigError`` unless ``root`` may receive a store (module docstring); reads names and headers only."""
    if root.exists() and not root.is_dir():
        raise ConfigError(f"store destination {root} exists and is not a directory; choose a folder")
    entries = sorted(root.iterdir()) if root.exists() else []
    if not entries:
        return
    if (root / MANIFEST).exists():
        try:
            manifest = Manifest.read(root / MANIFEST)
        except LoadError as e:
            raise ConfigError(
                f"store destination {root} holds a {MANIFEST} that is not a moetune store manifest ({e}); "
                "moetune convert only replaces its own stores: choose a new or empty directory"
            ) from None
        ours = {MANIFEST, *manifest.files}
        foreign = [
            p.name for p in entries if p.name not in ours and p.name.removesuffix(TMP_SUFFIX) not in ours
        ]
        what = "is a moetune store but also holds"
    else:
        foreign = [p.name for p in entries if not written_by_moetune(p)]
        what = "holds"
    if foreign:
        raise ConfigError(
            f"store destination {root} {what} entries moetune convert did not write "
            f"({listing(foreign, inline=True)}); convert never deletes them: choose a new or empty directory, "
            "or move them out"
        )
    if (root / MANIFEST).exists() and not overwrite:
        raise ConfigError(
            f"{root} already holds a converted store ({MANIFEST}); pass --overwrite (overwrite=True) to "
            "replace it, or choose another destination"
        )
