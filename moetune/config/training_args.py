"""The keyword arguments for transformers ``TrainingArguments`` (or TRL ``SFTConfig``) from a config.

Kept apart from the schema so that parsing a config never imports transformers' trainer stack; the caller
constructs ``TrainingArguments(**training_arguments_kwargs(config))`` when it is ready to train.
"""

from __future__ import annotations

import copy
from typing import Any

from moetune.config.schema import IntervalStrategy, MoetuneConfig


def _steps(value: float) -> int | float:
    """Whole step counts as int (transformers prints and compares them as steps), ratios as float."""
    return int(value) if float(value).is_integer() else value


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def training_arguments_kwargs(config: MoetuneConfig) -> dict[str, Any]:
    """Keyword arguments for ``transformers.TrainingArguments`` that carry out ``config.training``.

    Not included, because they are not TrainingArguments' business: ``resume_from_checkpoint`` (pass it to
    ``Trainer.train``), ``overwrite_output_dir`` (checked at parse time), ``plot_loss`` (moetune writes the PNG)
    and the data options.
    ``remove_unused_columns`` is off because moetune's datasets hold exactly the model inputs (packed
    datasets add ``position_ids``, which a PEFT-wrapped model's signature check would drop).
    """
    t = config.training
    warmup: int | float = 0
    if t.warmup_ratio is not None:
        warmup = t.warmup_ratio  # transformers v5 reads a float < 1 as a ratio of the total steps
    elif t.warmup_steps is not None:
        warmup = t.warmup_steps
    kwargs: dict[str, Any] = {
        "output_dir": str(t.output_dir),
        "do_train": True,
        "do_eval": config.finetune.do_eval,
        "per_device_train_batch_size": t.per_device_train_batch_size,
        "per_device_eval_batch_size": t.per_device_eval_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "learning_rate": t.learning_rate,
        "lr_scheduler_type": t.lr_scheduler_type,
        "warmup_steps": warmup,
        "num_train_epochs": t.num_train_epochs,
        "max_steps": t.max_steps,
        "weight_decay": t.weight_decay,
        "max_grad_norm": t.max_grad_norm,
        "logging_steps": _steps(t.logging_steps),
        "save_strategy": t.save_strategy.value,
        "save_steps": _steps(t.save_steps),
        "save_total_limit": t.save_total_limit,
        "save_only_model": t.save_only_model,
        "eval_strategy": t.eval_strategy.value,
        "seed": t.seed,
        "bf16": t.bf16,
        "activation_checkpointing": t.gradient_checkpointing,
        "report_to": list(t.report_to),
        "dataloader_num_workers": t.dataloader_num_workers,
        "ddp_timeout": t.ddp_timeout,
        "remove_unused_columns": False,
        "label_names": ["labels"],
        # no GPU to run on: `bf16: true` on a CPU-only machine needs use_cpu, or transformers refuses bf16
        "use_cpu": config.engine.device == "cpu"
        or (config.engine.device == "auto" and not _cuda_available()),
    }
    # TrainingArguments fields passed through from the YAML, copied: transformers rewrites mappings such as
    # fsdp_config in place (prefixes stripped, defaults added), which would change the config for later readers
    kwargs.update(copy.deepcopy(dict(t.extra_args)))
    if t.lr_scheduler_kwargs:
        kwargs["lr_scheduler_kwargs"] = dict(t.lr_scheduler_kwargs)
    if t.eval_strategy is IntervalStrategy.STEPS:
        kwargs["eval_steps"] = _steps(t.eval_steps if t.eval_steps is not None else t.logging_steps)
    if t.run_name is not None:
        kwargs["run_name"] = t.run_name
    return kwargs
