"""The final output of a full or freeze run: the trained model as a checkpoint in the base model's own layout.

``model.save_pretrained`` writes it (the routed experts come from ``CpuExperts.export_weights``, in the
transformers module's layout) and reverts the key conversions that loading applied, as recorded in the model's
``_weight_conversions``. transformers' loader records there the conversions that matched the checkpoint's keys;
moetune reads the routed experts itself, so the expert conversions (per-expert ``experts.N.gate_proj.weight``
-> fused ``experts.gate_up_proj``) are added here when the base checkpoint's keys match them: a per-expert base
gets per-expert keys back, a fused one stays fused.

Files go to a staging folder inside the output folder and are renamed into place, weight shards first, the shard
index after them and ``config.json`` last, so a folder with a config has every weight file its index names. A
staging folder a kill left is removed when ``moetune train`` next starts (:func:`recover_model_save`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

from moetune.atomic import fsync

logger = logging.getLogger(__name__)

_LAST = ("config.json",)
STAGING_PREFIX = ".model.tmp-"  # save_model's staging folder inside the output folder


def recover_model_save(output_dir: str | Path) -> list[str]:
    """Remove the staging folders of :func:`save_model` calls a kill interrupted (full-size copies of the model; the
    files already renamed into place are whole); returns what was done, in words, each also logged. ``moetune
    train`` runs it at start."""
    root = Path(output_dir)
    done = []
    for path in sorted(root.glob(STAGING_PREFIX + "*")) if root.is_dir() else []:
        if path.is_dir():
            shutil.rmtree(path)
            done.append(f"removed {path} (left by an interrupted save of the model)")
            logger.warning("moetune: %s", done[-1])
    return done


def _order(path: Path) -> tuple[int, str]:
    """Shards, then the index, then other files, then config.json."""
    if path.name in _LAST:
        return (3, path.name)
    if path.name.endswith(".index.json"):
        return (1, path.name)
    return (0 if path.suffix == ".safetensors" else 2, path.name)


def _record_base_conversions(model: Any) -> None:
    """Add to ``model._weight_conversions`` transformers' conversions for this model whose source keys the base
    checkpoint (``config.name_or_path``) has, as ``from_pretrained`` would have recorded them."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    from moetune.loading.checkpoint import Checkpoint

    keys = list(Checkpoint.open(model.config.name_or_path).tensors)
    recorded = list(getattr(model, "_weight_conversions", None) or [])
    for conversion in get_model_conversion_mapping(model, add_legacy=False):
        patterns = [re.compile(re.escape(p).replace(r"\*", r"\d+")) for p in conversion.source_patterns]
        used = any(p.search(k) for p in patterns for k in keys)
        if used and all(repr(conversion) != repr(r) for r in recorded):
            recorded.append(conversion)
    model._weight_conversions = recorded


def save_model(model: Any, output_dir: str | Path, state_dict: dict[str, Any] | None = None) -> Path:
    """Write ``model`` (a transformers model whose experts export their weights) to ``output_dir``; returns it.
    ``state_dict``: the model's, gathered whole (FSDP2 shards the dense part: ``moetune.train.fsdp``)."""
    _record_base_conversions(model)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out))
    try:
        model.save_pretrained(staged, state_dict=state_dict)
        for path in sorted(staged.iterdir(), key=_order):
            os.replace(path, out / path.name)
        fsync(out)
    finally:
        shutil.rmtree(staged, ignore_errors=True)
    return out
