"""The final output of a full or freeze run: the trained model as a checkpoint in the base model's own layout.

``model.save_pretrained`` (transformers reverts its load-time conversions, so per-expert checkpoints get
per-expert keys back; the routed experts come from ``CpuExperts.export_weights``) writes into a staging folder
inside the output folder; then the files are renamed into place, weight shards first, the shard index after
them and ``config.json`` last, so a folder with a config always has every weight file its index names.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from moetune.atomic import fsync_folder

_LAST = ("config.json",)


def _order(path: Path) -> tuple[int, str]:
    """Shards, then the index, then other files, then config.json."""
    if path.name in _LAST:
        return (3, path.name)
    if path.name.endswith(".index.json"):
        return (1, path.name)
    return (0 if path.suffix == ".safetensors" else 2, path.name)


def save_model(model: Any, output_dir: str | Path) -> Path:
    """Write ``model`` (a transformers model whose experts export their weights) to ``output_dir``; returns it."""
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=".model.tmp-", dir=out))
    try:
        model.save_pretrained(staged)
        for path in sorted(staged.iterdir(), key=_order):
            os.replace(path, out / path.name)
        fsync_folder(out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out
