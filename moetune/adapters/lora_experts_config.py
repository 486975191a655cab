"""PEFT's own ``save_pretrained`` of a model with LoRA experts writes them too: :class:`LoraExpertsConfig`.

``PeftModel.save_pretrained(dir)`` writes the adapter's LoRA tensors (selected by the substring ``lora_``, which
the LoRA experts' names avoid: ``moetune.adapters.lora_experts``) and then calls the live adapter config's
``save_pretrained(dir)``. Without more, a model with LoRA experts saved that way (a notebook's
``run.model.save_pretrained(dir)``, a Trainer's checkpoint) left a folder without
``moetune_lora_experts.safetensors`` that ``moetune.load_model(adapter=dir)`` loaded as a model without LoRA
experts, silently computing something else; and a model without LoRA experts saved that way over a folder that
held some left the old file beside the new adapter, which then loaded with another adapter's LoRA experts. Every
``PeftModel`` moetune builds (``adapters.apply.peft_model_with``: ``attach_lora``, ``load_adapter``) and
:func:`attach_lora_experts` therefore put a :class:`LoraExpertsConfig` in the place of each live ``LoraConfig``:
the same dataclass fields (the same ``adapter_config.json``, so stock PEFT reads it as before), and a
``save_pretrained`` that first writes the model's LoRA experts into the folder (atomically), or removes an old
file when the model has none, then writes the config. This subclasses PEFT's config; no PEFT class is changed.

Stock ``PeftModel.from_pretrained`` on an unmodified transformers model still loads the two stock files only: a
transformers model has no place for LoRA experts (``docs/architecture.md``); load such a folder with
``moetune.load_model(..., adapter=dir)``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import weakref
from pathlib import Path
from typing import Any

from peft import LoraConfig
from torch import nn

from moetune.atomic import write_atomically
from moetune.errors import SaveError

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class LoraExpertsConfig(LoraConfig):
    """A ``LoraConfig`` whose ``save_pretrained`` also writes the LoRA experts of the model it belongs to, or
    removes an old LoRA-experts file when the model has none (module docstring). Made by
    :func:`carry_lora_experts`; its dataclass fields are ``LoraConfig``'s."""

    # set by carry_lora_experts: a weak reference to the model (the config must not keep it alive; deep copies of
    # the config, which PEFT makes, share it). Not annotated, so no dataclass field: never in adapter_config.json
    _model = None

    def __deepcopy__(self, memo: dict[int, Any]) -> LoraExpertsConfig:
        # a deep copy of the whole PeftModel (its modules are copied before its peft_config) saves the copy's LoRA
        # experts, not the original's; a copy of the config alone still belongs to the same model
        new = copy.copy(self)
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            if key != "_model":
                setattr(new, key, copy.deepcopy(value, memo))
        ref = getattr(self, "_model", None)
        model = ref() if ref is not None else None
        if model is not None:
            new._model = weakref.ref(memo.get(id(model), model))  # type: ignore[assignment]
        return new

    def to_dict(self) -> dict[str, Any]:
        """``LoraConfig``'s, with ``target_modules`` sorted: PEFT holds them as a set, whose order follows each
        process's string hashing, so two runs (or ranks) would write the same adapter's config differently."""
        values = super().to_dict()
        if isinstance(values.get("target_modules"), (set, list, tuple)):
            values["target_modules"] = sorted(values["target_modules"])
        return values

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        from moetune.adapters.lora_experts import FILE_NAME, spec_of, write_lora_experts

        ref = getattr(self, "_model", None)
        model = ref() if ref is not None else None
        if model is None:
            raise SaveError(
                f"adapter config for {save_directory}: the model whose LoRA experts it saves is gone (the config "
                "outlived its model), so saving it would drop moetune_lora_experts.safetensors; save with "
                "moetune.adapters.save_adapter(model, dir) from the model itself"
            )
        folder = Path(save_directory)
        if spec_of(model) is not None:
            folder.mkdir(parents=True, exist_ok=True)
            write_atomically(folder / FILE_NAME, lambda path: write_lora_experts(model, path))
        elif (folder / FILE_NAME).is_file():  # an earlier adapter's: it never pairs with this one
            (folder / FILE_NAME).unlink()
            logger.warning(
                "moetune: removed %s (an earlier adapter's LoRA experts; this model has none)",
                folder / FILE_NAME,
            )
        super().save_pretrained(save_directory, **kwargs)


def carry_lora_experts(peft_model: Any, base: nn.Module) -> None:
    """Replace every live ``LoraConfig`` of ``peft_model`` by a :class:`LoraExpertsConfig` (the same field values)
    that saves ``base``'s LoRA experts (or none); idempotent, and run again when LoRA experts are attached. A model without PEFT configs (``peft_config``) is left alone."""
    configs = getattr(peft_model, "peft_config", None)
    if not isinstance(configs, dict):
        return
    for name, config in list(configs.items()):
        if isinstance(config, LoraConfig) and not isinstance(config, LoraExpertsConfig):
            values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
            configs[name] = LoraExpertsConfig(**values)
        if isinstance(configs[name], LoraExpertsConfig):
            configs[name]._model = weakref.ref(base)
