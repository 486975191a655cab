"""Typed, validated training configuration read from YAML with LLaMA-Factory's key names.

``load_config(path)`` returns a frozen :class:`MoetuneConfig` or raises one ``ConfigError`` listing every
problem (unknown keys, unsupported LLaMA-Factory options, wrong types, out-of-range values, conflicting
keys, missing files, an output_dir holding another run). ``training_arguments_kwargs(config)`` gives the
keyword arguments for transformers' ``TrainingArguments``.

LLaMA-Factory's own vocabulary is read here too: template names (``chat_templates``), KTransformers keys
(``ktransformers``), ``TrainingArguments`` fields passed through and ``deepspeed`` (``hf_args``), and the keys
refused by name (``llamafactory``).
"""

from moetune.config.datasets import DataFormat, DatasetSpec
from moetune.config.load import known_keys, load_config, parse_config
from moetune.config.schema import (
    ActivationPolicy,
    DataConfig,
    EngineConfig,
    FinetuneConfig,
    FinetuningType,
    IntervalStrategy,
    ModelConfig,
    MoetuneConfig,
    PrefLoss,
    Stage,
    TrainingConfig,
)
from moetune.config.training_args import training_arguments_kwargs

__all__ = [
    "ActivationPolicy",
    "DataConfig",
    "DataFormat",
    "DatasetSpec",
    "EngineConfig",
    "FinetuneConfig",
    "FinetuningType",
    "IntervalStrategy",
    "ModelConfig",
    "MoetuneConfig",
    "PrefLoss",
    "Stage",
    "TrainingConfig",
    "known_keys",
    "load_config",
    "parse_config",
    "training_arguments_kwargs",
]
