"""transformers ``TrainingArguments`` keys a LLaMA-Factory YAML passes through, and its ``deepspeed`` key.

LLaMA-Factory hands every ``TrainingArguments`` field it does not own to transformers (``optim``,
``adam_beta2``, ``dataloader_pin_memory``, ...). moetune does the same for the fields it does not set itself:
each value is coerced to the field's type here, and the whole set is checked by constructing the real
``TrainingArguments`` (plus the learning-rate scheduler on a dummy optimizer when ``lr_scheduler_kwargs`` is
set) before anything loads. Fields moetune sets itself are refused with the key to use instead; fields that
only matter with several processes (``ddp_*``) are accepted with one logged line: they take effect when moetune
is launched as several processes (torchrun / accelerate launch: docs/distributed.md).

``deepspeed: CONFIG.json`` is read as the FSDP2 setting that shards the dense part the same way (ZeRO-3 -> FSDP2
full shard, ZeRO-2 -> FSDP2 without resharding after forward, stages 0-1 -> DDP; ``moetune.train.fsdp``), one line
says so; the routed experts live in moetune's CPU engines and are not sharded. Settings in the JSON that ask for
something moetune does not do (ZeRO offload, fp16) are refused, naming the setting and what moetune does
instead.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moetune.config.fields import Problems, _BadValue, coerce

log = logging.getLogger(__name__)

# TrainingArguments fields moetune sets itself: what to use instead
OWNED: dict[str, str] = {
    "activation_checkpointing": "use gradient_checkpointing (or disable_gradient_checkpointing)",
    "activation_checkpointing_kwargs": "moetune checkpoints non-reentrantly (its CPU experts' forward is reused)",
    "gradient_checkpointing_kwargs": "moetune checkpoints non-reentrantly (its CPU experts' forward is reused)",
    "include_num_input_tokens_seen": "moetune always counts the non-padding tokens it trains on",
    "disable_tqdm": "moetune draws its own progress bar",
    "use_cpu": "set `moetune: {device: cpu}`",
    "remove_unused_columns": "moetune's datasets hold exactly the model inputs",
    "label_names": "moetune's datasets hold exactly the model inputs",
    "accelerator_config": "moetune sets up its processes itself (moetune.dist)",
    "parallelism_config": "moetune's multi-process runs are data-parallel with replicated experts (docs/distributed.md)",
    "torch_compile_backend": "moetune runs the model eagerly (torch.compile is not applied)",
    "torch_compile_mode": "moetune runs the model eagerly (torch.compile is not applied)",
    "liger_kernel_config": "kernel patches are not applied",
    "hub_token": "moetune does not push to the hub",
    "hub_private_repo": "moetune does not push to the hub",
    "hub_strategy": "moetune does not push to the hub",
    "hub_always_push": "moetune does not push to the hub",
    "hub_revision": "moetune does not push to the hub",
    "local_rank": "the launcher sets it (torchrun / accelerate launch set LOCAL_RANK)",
    "logging_nan_inf_filter": "moetune logs every loss as computed; `on_divergence: stop | skip` says what a NaN does",
}
# fields that only matter with several processes (torchrun / accelerate launch): accepted, logged
MULTI_PROCESS = (
    "ddp_find_unused_parameters",
    "ddp_bucket_cap_mb",
    "ddp_broadcast_buffers",
    "ddp_static_graph",
    "ddp_backend",
    "log_on_each_node",
    "log_level_replica",
    "save_on_each_node",
    "eval_use_gather_object",
    "average_tokens_across_devices",
)


@functools.cache
def _fields() -> dict[str, Any]:
    """TrainingArguments' init fields -> type hints (imports transformers: only when a YAML needs it)."""
    from transformers import TrainingArguments

    hints = typing.get_type_hints(TrainingArguments)
    return {f.name: hints.get(f.name, Any) for f in dataclasses.fields(TrainingArguments) if f.init}


def is_training_argument(key: str) -> bool:
    """True when ``key`` is a field of transformers' ``TrainingArguments``."""
    return key in _fields()


def passthrough(key: str, value: Any, problems: Problems) -> Any:
    """``value`` coerced for TrainingArguments field ``key``; problems are reported (and None returned)."""
    if key in OWNED:
        problems.add(key, f"is set by moetune itself: {OWNED[key]}. Remove it")
        return None
    if key in MULTI_PROCESS:
        log.info("%s: %r takes effect when moetune is launched as several processes", key, value)
    if key == "fsdp" and isinstance(value, bool):  # transformers' `fsdp: true`; false asks for nothing
        return value or None
    tp = _fields()[key]
    simple = _simple(tp)
    if simple is None or value is None:
        return value
    try:
        return coerce(value, simple)
    except _BadValue as err:
        problems.add(key, f"got {value!r}; {err} (transformers TrainingArguments.{key})")
        return None


def _simple(tp: Any) -> Any:
    """``tp`` when coerce handles it (bool/int/float/str and their Optional forms), else None."""
    if tp in (bool, int, float, str, dict):
        return tp
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and all(
        a in (bool, int, float, str, dict, type(None)) for a in args
    ):
        return tp if len([a for a in args if a is not type(None)]) == 1 else None
    return None


def check_training_arguments(kwargs: Mapping[str, Any], extra: tuple[str, ...]) -> tuple[Any, str | None]:
    """(``TrainingArguments(**kwargs)``, None), or (None, what transformers says is wrong with them). ``extra``
    names the keys that came through from the YAML (for the message)."""
    from transformers import TrainingArguments

    try:
        return TrainingArguments(**kwargs), None
    except (ValueError, TypeError, KeyError) as err:
        keys = f" (keys passed through to transformers: {', '.join(extra)})" if extra else ""
        return None, f"transformers refuses the training arguments{keys}: {err}"


def optimizer_problem(args: Any, trainer_optimizer: bool) -> tuple[str, str] | None:
    """(the key, what is wrong) with the optimizer ``args`` (``TrainingArguments``) ask for, or None: built on a
    dummy parameter now, as the Trainer builds it after the model loaded. ``trainer_optimizer``: whether the
    Trainer builds it (LoRA: the optimizer ``optim`` names, its package needed); full and freeze runs step every
    weight with moetune's AdamW (``optim`` chooses its state), whose hyperparameters are torch AdamW's."""
    import torch
    from transformers import Trainer

    cls: Any = torch.optim.AdamW
    options: dict[str, Any] = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2)}
    options.update(eps=args.adam_epsilon, weight_decay=args.weight_decay)
    if trainer_optimizer:
        try:
            cls, options = Trainer.get_optimizer_cls_and_kwargs(args)
        except (ImportError, ValueError) as err:  # a package the optimizer needs, or a bad optim_args
            return "optim", f"is {str(getattr(args.optim, 'value', args.optim))!r}: {err}"
    try:
        cls([torch.nn.Parameter(torch.zeros(1))], **options)
    except (ValueError, TypeError) as err:
        keys = (
            "adam_beta1, adam_beta2, adam_epsilon" if "beta" in str(err) or "epsilon" in str(err) else "optim"
        )
        return keys, f"the optimizer ({cls.__name__}) refuses its settings: {err}"
    return None


def scheduler_problem(name: str, kwargs: Mapping[str, Any]) -> str | None:
    """What is wrong with ``lr_scheduler_kwargs`` for scheduler ``name``: it is built on a dummy optimizer."""
    import inspect

    import torch
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION, SchedulerType, get_scheduler

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    try:
        get_scheduler(
            name, optimizer, num_warmup_steps=1, num_training_steps=10, scheduler_specific_kwargs=dict(kwargs)
        )
    except (TypeError, ValueError) as err:
        function: Any = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(name)]
        taken = [
            p
            for p in inspect.signature(function).parameters
            if p not in ("optimizer", "num_warmup_steps", "num_training_steps", "last_epoch")
        ]
        return (
            f"{f'got {dict(kwargs)!r}' if kwargs else 'without lr_scheduler_kwargs'}; the {name!r} scheduler "
            f"refuses it ({err}); it takes: "
            f"{', '.join(taken) or 'no extra arguments'}"
        )
    return None


# ZeRO stage -> the FSDP2 setting that shards the same (transformers' fsdp / fsdp_config); stages 0-1: DDP
ZERO_AS_FSDP: dict[int, dict[str, Any]] = {
    3: {"fsdp": True, "fsdp_config": {"version": 2, "reshard_after_forward": True}},  # parameters sharded
    2: {
        "fsdp": True,
        "fsdp_config": {"version": 2, "reshard_after_forward": False},
    },  # kept gathered fwd->bwd
}


def deepspeed_as_fsdp(value: Any, problems: Problems) -> dict[str, Any]:
    """A ``deepspeed`` JSON config read as the FSDP2 setting of the dense part (``ZERO_AS_FSDP``: ZeRO-3 ->
    ``fsdp`` full shard, ZeRO-2 -> FSDP2 without resharding after forward, else DDP), one line logged; refused
    settings go to ``problems``. Every finetuning_type takes it (full/freeze shard their dense part too, as
    LLaMA-Factory's full-SFT example with ``ds_z3_config.json`` asks; ``moetune.train.fsdp``)."""
    message = deepspeed_problem(value)
    if message is not None:
        problems.add("deepspeed", message)
        return {}
    stage = _zero_stage(value)
    as_fsdp = ZERO_AS_FSDP.get(stage, {})
    log.warning(
        "deepspeed: ZeRO stage %s is run as %s over several processes (the routed experts sit in CPU RAM, "
        "moetune's engine, and are not sharded; docs/distributed.md); bf16 follows the `bf16` key",
        stage,
        f"FSDP2 (fsdp_config {as_fsdp['fsdp_config']})" if as_fsdp else "DDP",
    )
    return dict(as_fsdp)


def _zero_stage(value: Any) -> int:
    config = (
        dict(value) if isinstance(value, Mapping) else json.loads(Path(str(value)).expanduser().read_text())
    )
    zero = config.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


def deepspeed_problem(value: Any) -> str | None:
    """Read a ``deepspeed`` JSON config: None (accepted) or why it is refused."""
    if isinstance(value, Mapping):
        config, where = dict(value), "the deepspeed mapping"
    else:
        path = Path(str(value)).expanduser()
        try:
            config, where = json.loads(path.read_text()), str(path)
        except OSError as err:
            return f"cannot read {path}: {err}; give the path of a DeepSpeed JSON config, or remove deepspeed"
        except ValueError as err:
            return f"{path} is not valid JSON: {err}"
    if not isinstance(config, dict):
        return f"{where} must hold a JSON object"
    zero = config.get("zero_optimization") or {}
    refused = [
        f"zero_optimization.{key} (device {zero[key].get('device')!r})"
        for key in ("offload_optimizer", "offload_param")
        if isinstance(zero.get(key), dict) and str(zero[key].get("device", "none")).lower() != "none"
    ]
    if refused:
        return (
            f"{where} sets {', '.join(refused)}: moetune has no DeepSpeed offload; its routed experts and their "
            f"LoRA already live in CPU RAM and the dense part stays on the GPU. Use a config without offload "
            f"(e.g. ds_z3_config.json) or remove deepspeed"
        )
    fp16 = config.get("fp16") or {}
    if isinstance(fp16, dict) and fp16.get("enabled") is True:
        return (
            f"{where} enables fp16: moetune trains in bf16 or fp32 (set bf16: true); set fp16.enabled to auto"
        )
    if isinstance(zero, dict) and str(zero.get("stage", 0)) not in ("0", "1", "2", "3"):
        return f"{where} sets zero_optimization.stage {zero.get('stage')!r}; ZeRO stages are 0, 1, 2 and 3"
    return None


# the fsdp_config keys transformers' TrainingArguments reads (5.24, `_process_fsdp_args`), after it strips
# accelerate's `fsdp_` prefix; any other key is kept and never read
FSDP_CONFIG_KEYS = frozenset(
    {
        "version",
        "min_num_params",
        "transformer_layer_cls_to_wrap",
        "auto_wrap_policy",
        "cpu_offload",
        "cpu_ram_efficient_loading",
        "state_dict_type",
        "activation_checkpointing",
        "reshard_after_forward",
        "forward_prefetch",
        "backward_prefetch",
        "use_orig_params",
        "sync_module_states",
        "limit_all_gathers",
    }
)


def fsdp_config_problems(fsdp: Any, fsdp_config: Any) -> list[tuple[str, str]]:
    """``(key, message)`` for what is wrong with the YAML's ``fsdp_config`` (a mapping, or a JSON file as
    transformers takes it) before transformers sees it: keys it does not read (accelerate's own spellings among
    them) would be dropped without a word, and without ``fsdp`` it reads none. The settings moetune refuses are
    checked on the plugin (``moetune.train.fsdp``)."""
    if not fsdp_config:
        return []
    if not fsdp:
        return [
            ("fsdp_config", "is set but fsdp is not: transformers reads it only with fsdp; set fsdp: true")
        ]
    if isinstance(fsdp_config, (str, Path)):
        try:
            fsdp_config = json.loads(Path(fsdp_config).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return [("fsdp_config", f"{str(fsdp_config)!r} is not a readable JSON file ({exc})")]
    if not isinstance(fsdp_config, Mapping):
        return [("fsdp_config", f"got {type(fsdp_config).__name__}; give a mapping of keys or a JSON file")]
    problems = []
    for raw in fsdp_config:
        key = str(raw)[5:] if str(raw).startswith("fsdp_") else str(raw)
        if key in FSDP_CONFIG_KEYS:
            continue
        if key in ("offload_params", "offload"):
            message = (
                "moetune refuses any offload (the routed experts already live in host RAM, and the dense part is "
                "what must stay on the GPU); transformers would not read this key either (its own is cpu_offload)"
            )
        elif key.startswith("xla"):
            message = "XLA's FSDP (TPUs) is not supported; moetune runs on CPUs and CUDA GPUs"
        else:
            message = (
                f"is not a key transformers reads (it would be ignored); known: {', '.join(sorted(FSDP_CONFIG_KEYS))}"
                ", each with or without accelerate's fsdp_ prefix"
            )
        problems.append((f"fsdp_config.{raw}", message))
    return problems
