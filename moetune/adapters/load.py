"""``moetune.load_model``: a checkpoint loaded by ``moetune.loading``, with a saved adapter attached when asked.

Loading knows nothing about adapters; this is where the two meet. The adapter folder is checked before any
weight is read (``moetune.adapters.check``: files, config, headers, and every tensor's name and shape against
the model built on the meta device from the checkpoint's config), so a bad adapter costs no model load.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.adapters.check import check_adapter_folder, scan_adapter_values
from moetune.errors import ConfigError

if TYPE_CHECKING:
    import torch


def load_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "bfloat16",
    adapter: str | Path | None = None,
    adapter_trainable: bool = False,
    **options: Any,
) -> Any:
    """:func:`moetune.loading.load_model` (same arguments and result), then, with ``adapter`` (a saved
    moetune/PEFT adapter folder), that adapter attached: a ``PeftModel`` whose LoRA is trainable when
    ``adapter_trainable``. A bad ``adapter_trainable`` raises ``ConfigError``, a bad adapter ``AdapterError``,
    both before any weight is read."""
    from moetune.loading import load_model as load_checkpoint

    if not isinstance(adapter_trainable, bool):
        raise ConfigError(f"adapter_trainable must be True or False; got {adapter_trainable!r}")
    if adapter is None:
        return load_checkpoint(path, device=device, dtype=dtype, **options)
    from moetune.loading import hf
    from moetune.loading.checkpoint import Checkpoint

    folder = check_adapter_folder(adapter).folder  # the folder alone first: no checkpoint header read for it
    config = hf.load_config(Checkpoint.open(path), bool(options.get("trust_remote_code", False)))
    scan_adapter_values(check_adapter_folder(folder, config))
    model = load_checkpoint(path, device=device, dtype=dtype, **options)
    from moetune.adapters.save import load_adapter

    return load_adapter(model, folder, is_trainable=adapter_trainable)
