"""YAML -> :class:`MoetuneConfig`: keys, types, ranges, cross-field rules and files, all checked up front.

Every problem found is reported in one ``ConfigError``, before any model or dataset is loaded. Relative
paths (model, dataset_dir, template, output_dir) are relative to the working directory, as in
LLaMA-Factory.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from moetune.config.chat_templates import NAMED_TEMPLATES, TEMPLATE_SUFFIXES
from moetune.config.datasets import resolve_datasets
from moetune.config.experts import ExpertOptions, ExpertParallel, expert_option_problems
from moetune.config.fields import Problems, coerce, parse_section, yaml_fields
from moetune.config.hf_args import (
    check_training_arguments,
    deepspeed_as_fsdp,
    fsdp_config_problems,
    is_training_argument,
    optimizer_problem,
    passthrough,
    scheduler_problem,
)
from moetune.config.ktransformers import translate_kt
from moetune.config.llamafactory import MEDIA_KNOBS, MEDIA_NOTE, is_rejected, rejection
from moetune.config.lora_experts import check_lora_expert_keys, translate_lora_expert_keys
from moetune.config.schema import (
    ENGINE_KEY,
    ENGINE_KEYS,
    ENGINE_OWN_KEYS,
    FLAT_SECTIONS,
    DataConfig,
    EngineConfig,
    FinetuneConfig,
    FinetuningType,
    IntervalStrategy,
    ModelConfig,
    MoetuneConfig,
    TrainingConfig,
)
from moetune.config.stage_rules import check_stage
from moetune.config.training_args import training_arguments_kwargs
from moetune.errors import ConfigError, listing

log = logging.getLogger(__name__)

_PLAIN_SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup")

# LLaMA-Factory spells "no gradient checkpointing" as a negative flag; read it as gradient_checkpointing
_NEGATED_ALIASES = {"disable_gradient_checkpointing": "gradient_checkpointing"}
# files whose presence in output_dir means a previous run lives there
_RUN_MARKERS = ("trainer_state.json", "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
# a model's weights (transformers' file names): an output_dir holding them and no run is some model's folder, which
# a full or freeze run's save would write over
_MODEL_WEIGHTS = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def load_config(path: str | Path, *, check_model_path: bool = True) -> MoetuneConfig:
    """Read and validate a YAML training config.

    ``check_model_path=False`` skips the check that ``model_name_or_path`` exists (for validating shipped
    example configs whose model a demo generates); every other check always runs.
    """
    path = Path(path)
    return parse_config(read_yaml(path), source=path, check_model_path=check_model_path)


def read_yaml(path: Path) -> Any:
    """The YAML document in ``path``; ``ConfigError`` for a file that cannot be read, is not UTF-8 or YAML, or sets
    a key twice in one mapping (YAML would keep the last silently)."""
    import yaml

    try:
        loader = _unique_keys_loader()(path.read_text(encoding="utf-8"))
        try:
            raw = loader.get_single_data()
        finally:
            loader.dispose()
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{path} is not UTF-8 text (byte {err.start} is {err.object[err.start : err.end]!r}); save the config "
            "as UTF-8"
        ) from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if loader.duplicates:
        raise ConfigError(
            f"{path}: {len(loader.duplicates)} key(s) set twice in one mapping; YAML would silently keep only the "
            "last value. Keep one of each:" + listing(loader.duplicates)
        )
    return raw


@functools.cache
def _unique_keys_loader() -> Any:
    """A PyYAML safe loader (its documented subclassing point) that records keys set twice in a mapping."""
    import yaml

    class UniqueKeys(yaml.SafeLoader):
        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.duplicates: list[str] = []

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                line = key_node.start_mark.line + 1
                if key in first:
                    self.duplicates.append(f"{key!r} on lines {first[key]} and {line}")
                else:
                    first[key] = line
            return super().construct_mapping(node, deep=deep)

    return UniqueKeys


def parse_config(
    raw: Any, *, source: str | Path | None = None, check_model_path: bool = True
) -> MoetuneConfig:
    """Validate an already-parsed YAML mapping (see :func:`load_config`)."""
    where = str(source) if source is not None else "config"
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(
            f"{where}: the top level must be a mapping of keys to values, got {type(raw).__name__}"
        )
    problems = Problems(where)
    flat = _translate_aliases(dict(raw), problems)
    engine_raw = flat.pop(ENGINE_KEY, None) or {}
    origins: dict[str, str] = {}
    if isinstance(engine_raw, Mapping):
        engine_raw = dict(engine_raw)
        origins = translate_kt(flat, engine_raw, problems)
    translate_lora_expert_keys(flat, problems)
    deepspeed = flat.pop("deepspeed", None)
    fsdp_given = "fsdp" in flat or "fsdp_config" in flat
    for key, message in fsdp_config_problems(flat.get("fsdp"), flat.get("fsdp_config")):
        problems.add(key, message)
    extra = _check_keys(flat, engine_raw, problems)

    model, finetune, data, training = (parse_section(cls, flat, problems) for cls in FLAT_SECTIONS)
    if deepspeed is not None:  # read as FSDP2 or DDP, by its ZeRO stage
        as_fsdp = deepspeed_as_fsdp(deepspeed, problems)
        if as_fsdp and fsdp_given:
            problems.add(
                "deepspeed", "is given with fsdp / fsdp_config; both ask for FSDP2: keep one of them"
            )
        extra = {**as_fsdp, **extra}
    training = dataclasses.replace(training, extra_args=tuple(extra.items()))
    engine = _parse_engine(engine_raw if isinstance(engine_raw, Mapping) else {}, problems, origins)
    _check_cross_fields(finetune, data, training, problems)
    if (
        engine.experts.expert_parallel is ExpertParallel.SHARDED
        and finetune.finetuning_type is not FinetuningType.LORA
    ):
        problems.add(
            f"{ENGINE_KEY}.expert_parallel",
            f"is 'sharded' with finetuning_type {finetune.finetuning_type.value}; sharded experts train LoRA only "
            "(each rank holds other experts, whose trained weights DDP cannot average). Use finetuning_type lora, "
            "or expert_parallel: replicated",
        )
    if engine.experts.expert_parallel is ExpertParallel.SHARDED:
        _check_sharded_training(dict(training.extra_args), problems)
    data = _resolve_template(_resolve_data(data, problems), problems)
    check_stage(finetune, data, training, problems)
    _check_files(model, data, training, problems, check_model_path)

    finetune = dataclasses.replace(finetune, lora_alpha=finetune.lora_alpha or 2 * finetune.lora_rank)
    config = MoetuneConfig(
        model, finetune, data, training, engine, Path(source) if source is not None else None
    )
    # what transformers checks (its arguments, the scheduler, the optimizer), reported with the problems above
    # (every problem at once); where those left a value it cannot build from, they are what is reported
    earlier = len(problems)
    try:
        _check_training_arguments(config, problems)
    except Exception:
        if not earlier:
            raise
    problems.raise_if_any()
    return config


def _check_training_arguments(config: MoetuneConfig, problems: Problems) -> None:
    """With keys passed through to transformers or scheduler arguments: build what the Trainer will build
    (TrainingArguments, the scheduler on a dummy optimizer) now, before anything loads. Schedulers that take
    no arguments are not built (that would import transformers for every config)."""
    t = config.training
    if t.lr_scheduler_kwargs or t.lr_scheduler_type not in _PLAIN_SCHEDULERS:
        message = scheduler_problem(t.lr_scheduler_type, t.lr_scheduler_kwargs or {})
        if message is not None:
            problems.add("lr_scheduler_kwargs" if t.lr_scheduler_kwargs else "lr_scheduler_type", message)
    if t.extra_args:
        args, message = check_training_arguments(
            training_arguments_kwargs(config), tuple(k for k, _ in t.extra_args)
        )
        if message is not None:
            problems.add(", ".join(k for k, _ in t.extra_args), message)
            return
        trainer_optimizer = config.finetune.finetuning_type is FinetuningType.LORA
        found = optimizer_problem(args, trainer_optimizer)
        if found is not None:
            problems.add(*found)


def known_keys() -> set[str]:
    """Every top-level key moetune reads (the ``moetune:`` mapping and aliases included)."""
    keys = {ENGINE_KEY, *_NEGATED_ALIASES}
    for cls in FLAT_SECTIONS:
        keys |= set(yaml_fields(cls))
    return keys


def _translate_aliases(flat: dict[str, Any], problems: Problems) -> dict[str, Any]:
    for alias, key in _NEGATED_ALIASES.items():
        if alias not in flat:
            continue
        value = flat.pop(alias)
        if key in flat:
            problems.add(alias, f"conflicts with {key}; set only {key}")
        elif isinstance(value, bool):
            flat[key] = not value
        else:
            problems.add(alias, f"got {value!r}; expected true or false")
    return flat


def _parse_engine(raw: Mapping[str, Any], problems: Problems, origins: Mapping[str, str]) -> EngineConfig:
    """The `moetune:` mapping: ``device`` and ``bind_cpus``, then the expert options through the check ``load_model`` runs,
    after coercing YAML strings as LLaMA-Factory does (``"4"`` for a number, ``"true"`` for a bool, any case
    for a mode). Unknown keys were reported by ``_check_keys``."""
    device = parse_section(
        EngineConfig, {k: v for k, v in raw.items() if k in ENGINE_OWN_KEYS}, problems, f"{ENGINE_KEY}."
    )
    values = {k: _coerce_expert_option(k, v) for k, v in raw.items() if k in ExpertOptions.names()}
    found = expert_option_problems(values)
    for key, message in found:
        label = f"{ENGINE_KEY}.{key}"
        problems.add(f"{origins[key]} (read as {label})" if key in origins else label, message)
    bad = {key for key, _ in found}
    experts = ExpertOptions.from_valid({k: v for k, v in values.items() if k not in bad})
    return dataclasses.replace(device, experts=experts)


_EXPERT_OPTION_TYPES: dict[str, Any] = {
    "int4_group_size": int,
    "num_threads": int,
    "expert_workers": int,
    "gpu_experts_warmup": int,
    "int4_symmetric": bool,
    "int8_activations": bool,
    "check_finite": bool,
}


def _coerce_expert_option(key: str, value: Any) -> Any:
    if key in ("activation_policy", "expert_residency", "expert_format", "gpu_experts") and isinstance(
        value, str
    ):
        return value.lower()
    if key in _EXPERT_OPTION_TYPES:
        try:
            return coerce(value, _EXPERT_OPTION_TYPES[key])
        except ValueError:
            return value  # the check reports it as given
    return value


# optimizers whose state for a parameter is not shaped like it (block scales, factored moments, projections): the
# sharded expert LoRA's state is gathered and cut by rows (moetune.train.sharded_lora), which these cannot be
_NOT_ROW_STATE = ("8bit", "4bit", "adafactor", "galore", "apollo", "lomo")


def _check_sharded_training(extra: dict[str, Any], problems: Problems) -> None:
    """``expert_parallel: sharded``: each rank holds its experts' LoRA rows and the global main process gathers
    them for every save (``moetune.train.sharded_lora``), so saves are not per node and the optimizer state
    must be shaped like its parameters."""
    if extra.get("save_on_each_node"):
        problems.add(
            "save_on_each_node",
            "is true with expert_parallel: sharded; the expert LoRA rows are gathered to the global main process, "
            "which alone writes checkpoints and the adapter (put output_dir on a filesystem every node shares). "
            "Remove save_on_each_node",
        )
    optim = str(getattr(extra.get("optim"), "value", extra.get("optim") or ""))
    if any(mark in optim for mark in _NOT_ROW_STATE):
        problems.add(
            "optim",
            f"is {optim!r} with expert_parallel: sharded; its state is not shaped like the parameters, and the "
            "sharded expert LoRA's optimizer state is split and gathered by rows. Use adamw_torch, "
            "adamw_torch_fused or sgd, or expert_parallel: replicated",
        )


def _check_keys(flat: dict[str, Any], engine_raw: Any, problems: Problems) -> dict[str, Any]:
    """Report keys moetune does not read; returns (and removes from ``flat``) the TrainingArguments fields
    passed through to transformers, coerced."""
    known = known_keys()
    engine_keys = set(ENGINE_KEYS)
    extra: dict[str, Any] = {}
    for key, value in list(flat.items()):
        if key in known:
            continue
        if not isinstance(key, str):
            problems.add(str(key), "is not a key name; keys are LLaMA-Factory or moetune option names")
            continue
        if key in engine_keys:
            problems.add(
                key, f"is an engine option; put it under `{ENGINE_KEY}:` ({ENGINE_KEY}: {{{key}: ...}})"
            )
            continue
        if key in MEDIA_KNOBS:
            log.warning("%s: %r has %s", key, value, MEDIA_NOTE)
            continue
        reason = rejection(key, value)
        if reason is not None:
            problems.add(key, f"is a LLaMA-Factory option moetune does not support: {reason}. Remove it.")
        elif is_rejected(key):
            log.warning("%s: %r accepted: it asks for nothing (the feature is off)", key, value)
        elif is_training_argument(key):
            extra[key] = passthrough(key, flat.pop(key), problems)
        else:
            problems.add(key, _unknown(key, known))
    if not isinstance(engine_raw, Mapping):
        problems.add(ENGINE_KEY, f"got {engine_raw!r}; expected a mapping of engine options")
        return extra
    for key in engine_raw:
        if key not in engine_keys:
            problems.add(
                f"{ENGINE_KEY}.{key}", f"is not an engine option; allowed: {', '.join(sorted(engine_keys))}"
            )
    return extra


def _unknown(key: str, known: set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"is not a moetune, supported LLaMA-Factory or transformers TrainingArguments key{hint}"


def _check_cross_fields(
    finetune: FinetuneConfig,
    data: DataConfig,
    training: TrainingConfig,
    problems: Problems,
) -> None:
    if not finetune.do_train and not problems.has("do_train"):
        problems.add("do_train", "is false, but `moetune train` always trains; set it to true or remove it")
    _check_mode_keys(finetune, problems)
    check_lora_expert_keys(finetune, finetune.finetuning_type.value, problems)
    if training.warmup_ratio and training.warmup_steps:
        problems.add("warmup_steps", "is set together with warmup_ratio; set only one of them")
    has_eval = data.eval_dataset is not None or data.val_size > 0
    if data.eval_dataset is not None and data.val_size > 0:
        problems.add(
            "val_size",
            "is set together with eval_dataset; hold out part of the training data "
            "(val_size) or evaluate on eval_dataset, not both",
        )
    if finetune.do_eval and not has_eval and not problems.has("eval_dataset", "val_size"):
        problems.add(
            "do_eval",
            "is true but there is no evaluation data to evaluate on after training; set eval_dataset or val_size",
        )
    if not problems.has("eval_strategy", "eval_dataset", "val_size"):
        if training.eval_strategy is not IntervalStrategy.NO and not has_eval:
            problems.add(
                "eval_strategy",
                f"is {training.eval_strategy.value!r} but there is no evaluation data; "
                "set eval_dataset or val_size, or set eval_strategy: no",
            )
        if training.eval_strategy is IntervalStrategy.NO and has_eval and not finetune.do_eval:
            problems.add(
                "eval_strategy",
                "is 'no' but eval_dataset or val_size is set, so that data would never "
                "be used; set eval_strategy: steps (with eval_steps) or epoch, or do_eval: true",
            )
    if training.eval_steps is not None and training.eval_strategy is not IntervalStrategy.STEPS:
        problems.add("eval_steps", "is set but eval_strategy is not 'steps'; set eval_strategy: steps")
    if training.report_to != ("none",) and not problems.has("report_to"):
        _check_report_to(training.report_to, problems)


def _check_mode_keys(finetune: FinetuneConfig, problems: Problems) -> None:
    """Keys of one training mode set under another are errors (freeze keys, additional_target) or said to have no
    effect (LoRA keys, which LLaMA-Factory ignores), never silently unused."""
    method = finetune.finetuning_type
    defaults = {f.name: f.default for f in dataclasses.fields(FinetuneConfig)}
    if method is not FinetuningType.LORA:  # lora_alpha is still None here unless set (2 * rank comes later)
        # said, not refused: a config switched from lora keeps them, and LLaMA-Factory ignores them silently
        unused = [
            key
            for key in ("lora_rank", "lora_alpha", "lora_dropout", "lora_target", "use_rslora")
            if getattr(finetune, key) != defaults[key]
        ]
        if unused:
            log.warning(
                "moetune: %s appl%s to finetuning_type: lora only; with finetuning_type %s no LoRA is attached and "
                "%s no effect",
                ", ".join(unused),
                "ies" if len(unused) == 1 else "y",
                method.value,
                "it has" if len(unused) == 1 else "they have",
            )
    if method is not FinetuningType.FREEZE:
        for key in ("freeze_trainable_layers", "freeze_trainable_modules", "freeze_extra_modules"):
            if getattr(finetune, key) != defaults[key] and not problems.has(key):
                problems.add(
                    key,
                    f"applies to finetuning_type: freeze, but finetuning_type is {method.value}; remove it",
                )
    if (
        method is not FinetuningType.LORA
        and finetune.additional_target
        and not problems.has("additional_target")
    ):
        problems.add(
            "additional_target",
            f"names modules trained fully beside LoRA; with finetuning_type {method.value} use "
            + (
                "freeze_extra_modules / freeze_trainable_modules"
                if method is FinetuningType.FREEZE
                else "nothing: full trains every module"
            )
            + " and remove it",
        )


def _check_report_to(report_to: tuple[str, ...], problems: Problems) -> None:
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    allowed = {"none", "all", *INTEGRATION_TO_CALLBACK}
    bad = [r for r in report_to if r not in allowed]
    if bad:
        problems.add("report_to", f"got {', '.join(bad)}; allowed: {', '.join(sorted(allowed))}")
    elif "none" in report_to and len(report_to) > 1:
        problems.add("report_to", "'none' cannot be combined with integrations")
    else:  # the Trainer raises for a named integration whose package is missing, after the model loaded
        installed = set(get_available_reporting_integrations())
        missing = [r for r in report_to if r not in ("none", "all") and r not in installed]
        if missing:
            problems.add(
                "report_to",
                f"names {', '.join(missing)}, whose package is not installed here (pip install it), or "
                f"choose among the installed ones: {', '.join(sorted(installed)) or 'none'}",
            )


def _resolve_data(data: DataConfig, problems: Problems) -> DataConfig:
    if problems.has("dataset_dir"):
        return data
    train = resolve_datasets("dataset", data.dataset, data.dataset_dir, problems) if data.dataset else ()
    evals = (
        resolve_datasets("eval_dataset", data.eval_dataset, data.dataset_dir, problems)
        if data.eval_dataset
        else ()
    )
    return dataclasses.replace(data, train_sources=train, eval_sources=evals)


def _check_files(
    model: ModelConfig, data: DataConfig, training: TrainingConfig, problems: Problems, check_model_path: bool
) -> None:
    if check_model_path and model.model_name_or_path is not None:
        message = _model_path_problem(model.model_name_or_path)
        if message:
            problems.add("model_name_or_path", message)
    if training.output_dir is not None:
        model_dir = Path(model.model_name_or_path).expanduser() if model.model_name_or_path else None
        if model_dir is not None and _same_folder(model_dir, training.output_dir):
            problems.add(
                "output_dir",
                f"{training.output_dir} is model_name_or_path's folder: saving there writes over the base model's "
                "files (a full or freeze run its weights, every run its config and tokenizer); choose another "
                "output_dir",
            )
            return
        _check_output_dir(training, problems)


def _step(checkpoint: Path) -> int:
    """A ``checkpoint-N`` folder's N (-1 for another name): checkpoints sort by step, not as text."""
    tail = checkpoint.name.removeprefix("checkpoint-")
    return int(tail) if tail.isdigit() else -1


def _same_folder(a: Path, b: Path) -> bool:
    """Whether ``a`` and ``b`` are one existing folder (links and relative paths resolved)."""
    try:
        return a.is_dir() and b.is_dir() and os.path.samefile(a, b)
    except OSError:
        return False


def _model_path_problem(name: str) -> str | None:
    path = Path(name).expanduser()
    if path.is_dir():
        return (
            None
            if (path / "config.json").is_file()
            else f"folder {path} has no config.json; point at a model folder"
        )
    if path.exists():
        return f"{path} is a file; point at the model's folder (with config.json and safetensors)"
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name):  # a hub id: accept it if the local Hugging Face cache has it
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
        return (
            f"{name!r} is neither a local folder nor in the local Hugging Face cache; moetune does not "
            f"download: run `hf download {name}` first or give the local folder"
        )
    return f"{path} does not exist; give a local model folder (with config.json and safetensors)"


def _resolve_template(data: DataConfig, problems: Problems) -> DataConfig:
    """``template`` as a LLaMA-Factory name (with its switches checked against the config's own keys) or a
    Jinja file; the tokenizer's family is checked when it loads (``moetune.train.templates``)."""
    value = data.template
    if value is None:
        return data
    if value in NAMED_TEMPLATES:
        spec = NAMED_TEMPLATES[value]
        if (
            None not in (spec.enable_thinking, data.enable_thinking)
            and spec.enable_thinking != data.enable_thinking
        ):
            problems.add(
                "enable_thinking",
                f"is {data.enable_thinking} but template {value!r} means enable_thinking: {spec.enable_thinking}; "
                f"remove enable_thinking, or choose the template name with thinking "
                f"{'on' if data.enable_thinking else 'off'}",
            )
        return dataclasses.replace(data, template_name=value)
    path = Path(value).expanduser()
    if path.is_file():
        return dataclasses.replace(data, template_file=path)
    if len(path.parts) == 1 and not path.suffix:
        problems.add(
            "template",
            f"{value!r} is not a LLaMA-Factory template name moetune maps; supported names: "
            f"{', '.join(NAMED_TEMPLATES)}; or remove `template` to use the tokenizer's own chat template, or "
            f"give a path to a Jinja template file ({', '.join(TEMPLATE_SUFFIXES)})",
        )
    else:
        problems.add(
            "template",
            f"{path} does not exist; give a path to a Jinja chat-template file or remove `template`",
        )
    return data


def _check_output_dir(training: TrainingConfig, problems: Problems) -> None:
    out = training.output_dir
    if out.exists() and not out.is_dir():
        problems.add("output_dir", f"{out} exists and is not a folder; choose another output_dir")
        return
    checkpoints = sorted(out.glob("checkpoint-*")) if out.is_dir() else []
    resume = training.resume_from_checkpoint
    if resume is True and not checkpoints:
        problems.add(
            "resume_from_checkpoint",
            f"is true but {out} holds no checkpoint-* folder to resume from; "
            "give a checkpoint path or remove it",
        )
    elif isinstance(resume, Path) and (inner := sorted(resume.glob("checkpoint-*"), key=_step)):
        problems.add(  # a finished run's output_dir has a trainer_state.json too; transformers then fails in PEFT
            "resume_from_checkpoint",
            f"{resume} is a run's output_dir (it holds {', '.join(p.name for p in inner[-3:])}), not a checkpoint; "
            f"give one of its checkpoint folders, e.g. {inner[-1]}",
        )
    elif isinstance(resume, Path) and not (resume / "trainer_state.json").is_file():
        problems.add(
            "resume_from_checkpoint",
            f"{resume} is not a checkpoint folder (no trainer_state.json); "
            "give a checkpoint-* folder from a previous run",
        )
    previous_run = [p.name for p in checkpoints] + [m for m in _RUN_MARKERS if (out / m).exists()]
    if previous_run and not training.overwrite_output_dir and not resume:
        found = ", ".join(previous_run[:3])
        problems.add(
            "output_dir",
            f"{out} already holds a training run ({found}); set overwrite_output_dir: true to "
            "write over it, resume_from_checkpoint to continue it, or choose another output_dir",
        )
    if checkpoints and training.overwrite_output_dir and not resume:
        log.warning(
            "moetune: output_dir %s holds checkpoints of an earlier run (%s); overwrite_output_dir writes over its "
            "files but leaves them, so a later resume_from_checkpoint: true could take one of them: remove them "
            "or choose another output_dir",
            out,
            ", ".join(p.name for p in checkpoints[:3]),
        )
    weights = [m for m in _MODEL_WEIGHTS if (out / m).exists()]
    if weights and not previous_run:  # overwrite_output_dir too: LLaMA-Factory's examples all set it
        problems.add(
            "output_dir",
            f"{out} holds a model ({weights[0]}) and no training run; saving there would write over its files "
            "(overwrite_output_dir or not): choose another output_dir, or empty that folder first",
        )
