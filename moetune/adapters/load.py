"""``moetune.load_model``: a checkpoint loaded by ``moetune.loading``, with a saved adapter attached when asked.

Loading knows nothing about adapters; this is where the two meet. The adapter folder is checked before any
weight is read (``moetune.adapters.check``: files, config, headers, and every tensor's name and shape against
the model built on the meta device from the checkpoint's config, the one the load then fills), so a bad adapter
costs no model load.
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
    from moetune.loading.load import plan_load
    from moetune.loading.options import LoadOptions

    folder = check_adapter_folder(adapter).folder  # the folder alone first: no checkpoint header read for it
    # the load planned once: its meta-device model serves the adapter check and becomes the loaded model
    planned = plan_load(path, LoadOptions.create(device=device, dtype=dtype, **options))
    scan_adapter_values(check_adapter_folder(folder, planned.model.config, meta_model=planned.model))
    model = load_checkpoint(path, device=device, dtype=dtype, planned=planned, **options)
    from moetune.adapters.save import load_adapter

    return load_adapter(model, folder, is_trainable=adapter_trainable)
