"""``moetune.load_model``: a checkpoint loaded by ``moetune.loading``, with a saved adapter attached when asked.

Loading knows nothing about adapters; this is where the two meet. The adapter folder is checked before the
checkpoint is read, so a wrong path costs no model load.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.errors import ConfigError

if TYPE_CHECKING:
    import torch


def check_adapter_dir(adapter: str | Path) -> Path:
    """``adapter`` as a Path if it is an adapter folder (it holds ``adapter_config.json``), else ``ConfigError``."""
    path = Path(adapter)
    if not (path / "adapter_config.json").is_file():
        raise ConfigError(
            f"adapter {str(path)!r} is not an adapter directory: no adapter_config.json in it "
            "(pass the output_dir of `moetune train`, or a PEFT save_pretrained directory)"
        )
    return path


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
    ``adapter_trainable``. Bad adapter arguments raise ``ConfigError`` before any weight is read."""
    from moetune.loading import load_model as load_checkpoint

    if not isinstance(adapter_trainable, bool):
        raise ConfigError(f"adapter_trainable must be True or False; got {adapter_trainable!r}")
    folder = None if adapter is None else check_adapter_dir(adapter)
    model = load_checkpoint(path, device=device, dtype=dtype, **options)
    if folder is None:
        return model
    from moetune.adapters.save import load_adapter

    return load_adapter(model, folder, is_trainable=adapter_trainable)
