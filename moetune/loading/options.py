"""``LoadOptions``: everything ``moetune.load_model`` accepts, parsed and validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from moetune.engine import EngineOptions
from moetune.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,  # reference runs only
}


def _dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        return DTYPES[value.removeprefix("torch.")]
    raise ConfigError(
        f"dtype {value!r} is not supported; use one of {', '.join(DTYPES)} (or the torch dtype)"
    )


def _device(value: str | torch.device | None) -> torch.device:
    if value is None:  # the documented default: the first GPU when there is one
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {value!r} is not a torch device (e.g. 'cuda:0', 'cpu'): {e}") from e
    if device.type == "meta":
        raise ConfigError("device 'meta' holds no weights; use 'cuda:N' or 'cpu'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {value!r} asks for CUDA, but torch sees no CUDA device; use device='cpu'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


@dataclass(frozen=True)
class LoadOptions:
    """How to load a checkpoint.

    Attributes:
        device: where embeddings, attention, norms, routers, shared experts, dense MLPs and lm_head live.
        dtype: dtype of those weights and of the stored routed experts (the engine computes bf16 experts in
            fp32 tiles where the CPU lacks bf16 dot products).
        num_threads: CPU threads of the expert engine (None: the physical cores visible to the process).
        progress: show tqdm bars while loading.
        adapter: a saved moetune/PEFT adapter directory to attach after loading (returns a ``PeftModel``).
        adapter_trainable: keep that adapter's LoRA trainable (to continue training it).
    """

    device: torch.device
    dtype: torch.dtype
    num_threads: int | None = None
    progress: bool = True
    adapter: Path | None = None
    adapter_trainable: bool = False

    @classmethod
    def create(
        cls, device: str | torch.device | None = None, dtype: str | torch.dtype = "bfloat16", **options: Any
    ) -> LoadOptions:
        """Parse ``load_model``'s keyword arguments; ``ConfigError`` names an unknown or invalid one."""
        known = {f.name for f in fields(cls)} - {"device", "dtype"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown load_model option(s) {unknown}; known: device, dtype, {', '.join(sorted(known))}"
            )
        threads = options.get("num_threads")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"num_threads must be a positive int or None; got {threads!r}")
        progress = options.get("progress", True)
        if not isinstance(progress, bool):
            raise ConfigError(f"progress must be True or False; got {progress!r}")
        adapter = options.get("adapter")
        if adapter is not None:
            adapter = Path(adapter)
            if not (adapter / "adapter_config.json").is_file():
                raise ConfigError(
                    f"adapter {str(adapter)!r} is not an adapter directory: no adapter_config.json in it "
                    "(pass the output_dir of `moetune train`, or a PEFT save_pretrained directory)"
                )
        trainable = options.get("adapter_trainable", False)
        if not isinstance(trainable, bool):
            raise ConfigError(f"adapter_trainable must be True or False; got {trainable!r}")
        return cls(
            device=_device(device),
            dtype=_dtype(dtype),
            num_threads=threads,
            progress=progress,
            adapter=adapter,
            adapter_trainable=trainable,
        )

    @property
    def engine(self) -> EngineOptions:
        """The expert engine's settings."""
        return EngineOptions(num_threads=self.num_threads)
