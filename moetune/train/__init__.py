"""The training recipe: data (datasets -> tokenized, label-masked examples), Trainer integration.

``prepare_datasets(config.data, tokenizer, seed=config.training.seed)`` reads and validates every dataset
of a config and returns :class:`PreparedData` (train / eval ``datasets.Dataset`` of ``input_ids``,
``attention_mask`` (unpacked) or ``position_ids`` (packed), ``labels``; and the ``PadCollator``).
"""

from moetune.train.data import PreparedData, prepare_datasets, read_dataset
from moetune.train.packing import PadCollator, pack
from moetune.train.templates import IGNORE_INDEX, ChatRenderer, ExampleEncoder, Sample

__all__ = [
    "IGNORE_INDEX",
    "ChatRenderer",
    "ExampleEncoder",
    "PadCollator",
    "PreparedData",
    "Sample",
    "pack",
    "prepare_datasets",
    "read_dataset",
]
