"""Datasets -> tokenized, label-masked examples ready for a transformers ``Trainer``.

The flow, for each dataset of the config::

    read (local json/jsonl/parquet/csv/txt file, folder of them, or a `save_to_disk` folder)
      -> row layout: dataset_info.json's formatting/columns/tags, else detected from the column names
      -> validate every row (the first problems are reported together, with row index and field)
      -> encode: conversations through the chat template, loss on assistant tokens only;
                 prompt/completion strings: loss on the completion; plain text: loss on every token
      -> truncate to cutoff_len, drop rows left with no trained token (all of them: an error)
    then concatenate, hold out val_size, and optionally pack the training rows.

Packing concatenates examples into rows of at most ``cutoff_len`` tokens with ``position_ids`` that
restart at 0 for each example and no ``attention_mask``: transformers then builds a block-diagonal causal
mask from the position_ids, so packed examples do not attend to each other. That holds only while the
model runs without a KV cache (``model.config.use_cache = False`` in training); the first label of each
packed example is -100 so no example is trained to predict the start of the next.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.config.datasets import (
    COLUMN_ROLES,
    DEFAULT_TAGS,
    FILE_BUILDERS,
    DataFormat,
    DatasetSpec,
    data_files,
    is_saved_dataset,
)
from moetune.config.schema import DataConfig
from moetune.errors import LISTED, DataError, listing
from moetune.train.templates import IGNORE_INDEX, ExampleEncoder, Sample

log = logging.getLogger(__name__)

COLUMNS = ("input_ids", "attention_mask", "labels")  # what an unpacked example holds
PACKED_COLUMNS = ("input_ids", "labels", "position_ids")  # what a packed row holds
MEDIA_COLUMNS = ("images", "videos", "audios")  # LLaMA-Factory's multimodal columns (and column roles)

# the sharegpt roles moetune renders, per tag of LLaMA-Factory's `tags`
_ROLE_OF_TAG = {
    "user_tag": "user",
    "assistant_tag": "assistant",
    "system_tag": "system",
    "observation_tag": "tool",
    "function_tag": "assistant",
}
_OPENAI_TAGS = {
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "system_tag": "system",
    "observation_tag": "tool",
    "function_tag": "function_call",
}


class RowError(Exception):
    """A row does not fit its format; the message names the field."""


@dataclass(frozen=True)
class Layout:
    """How one dataset's rows hold examples: the format, role -> column name, sharegpt tags."""

    format: DataFormat
    columns: Mapping[str, str]
    tags: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class PreparedData:
    """What the trainer needs from the data: datasets of token ids and labels, and their collator."""

    train: Any  # datasets.Dataset with COLUMNS, or PACKED_COLUMNS when packed
    eval: Any | None  # datasets.Dataset with COLUMNS (never packed), or None
    collator: PadCollator


def prepare_datasets(
    config: DataConfig, tokenizer: Any, *, seed: int = 42, cache_dir: str | Path | None = None
) -> PreparedData:
    """Read, validate, tokenize and (optionally) pack the datasets of ``config``.

    Raises ``DataError`` naming the dataset, the rows and fields at fault, before any training starts.
    ``seed`` fixes the ``val_size`` split; ``cache_dir`` is where `datasets` keeps its cache files.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} is not a fast tokenizer; moetune needs "
            f"token offsets to place labels (save the model with a tokenizer.json)"
        )
    encoder = ExampleEncoder(tokenizer, config)
    train = _encode_all(config.train_sources, encoder, config, cache_dir)
    evals = _encode_all(config.eval_sources, encoder, config, cache_dir) if config.eval_sources else None
    if config.val_size > 0:
        size = int(config.val_size) if config.val_size >= 1 else config.val_size
        if isinstance(size, int) and size >= len(train):
            raise DataError(
                f"val_size {size} holds out every one of the {len(train)} training rows; lower it"
            )
        split = train.train_test_split(test_size=size, seed=seed)
        train, evals = split["train"], split["test"]
    if config.packing:
        train = pack(train, config.cutoff_len, config.preprocessing_batch_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DataError("the tokenizer has neither a pad token nor an eos token to pad batches with")
    return PreparedData(train=train, eval=evals, collator=PadCollator(pad))


def read_dataset(spec: DatasetSpec, cache_dir: str | Path | None = None) -> Any:
    """The rows of ``spec`` as a ``datasets.Dataset``."""
    import datasets

    path = spec.path
    try:
        if path.is_dir() and is_saved_dataset(path):
            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if spec.split not in loaded:
                    raise DataError(
                        f"dataset {spec.name!r}: {path} has splits {sorted(loaded)}, not {spec.split!r}; "
                        f"set 'split' in dataset_info.json"
                    )
                loaded = loaded[spec.split]
            return loaded
        files = data_files(path) if path.is_dir() else [path]
        builders = {FILE_BUILDERS[f.suffix.lower()] for f in files}
        if len(builders) != 1:
            raise DataError(
                f"dataset {spec.name!r}: folder {path} mixes file types {sorted(builders)}; keep one"
            )
        return datasets.load_dataset(
            builders.pop(),
            data_files=[str(f) for f in files],
            split="train",
            cache_dir=str(cache_dir) if cache_dir else None,
        )
    except DataError:
        raise
    except Exception as err:  # `datasets`/pyarrow raise many types for unreadable (and for empty) files
        if (
            path.is_file()
            and path.stat().st_size < 16
            and path.read_text(errors="replace").strip() in ("", "[]")
        ):
            raise DataError(f"dataset {spec.name!r} ({path}) has no rows") from None
        raise DataError(f"dataset {spec.name!r}: cannot read {path}: {type(err).__name__}: {err}") from None


def detect_layout(spec: DatasetSpec, columns: Sequence[str], first_row: Mapping[str, Any] | None) -> Layout:
    """The row layout of ``spec``: the format dataset_info.json names, else the first format whose
    required columns are present; each role's column as mapped there, else the first default present."""
    present = set(columns)
    media = sorted(present & set(MEDIA_COLUMNS)) + sorted(set(spec.columns) & set(MEDIA_COLUMNS))
    if media:
        raise DataError(
            f"dataset {spec.name!r} ({spec.path}) has {media[0]!r} data: multimodal training is not supported; "
            f"train on text rows only"
        )
    formats = [spec.formatting] if spec.formatting is not None else list(DataFormat)
    problems = []
    for fmt in formats:
        resolved: dict[str, str] = {}
        missing = []
        for role, (defaults, required) in COLUMN_ROLES[fmt].items():
            candidates = (spec.columns[role],) if role in spec.columns else defaults
            column = next((c for c in candidates if c in present), None)
            if column is not None:
                resolved[role] = column
            elif required or role in spec.columns:
                missing.append(f"{'/'.join(candidates)} ({role})")
        unread = sorted(set(spec.columns) - set(COLUMN_ROLES[fmt]))
        if unread and not missing:  # never drop a mapping the user wrote
            problems.append(f"{fmt.value} reads no {', '.join(unread)} column, which dataset_info.json maps")
            continue
        if not missing:
            if fmt is DataFormat.TEXT:
                log.warning(
                    "dataset %r: plain-text rows (format text): every token is trained, as in pre-training",
                    spec.name,
                )
            if spec.formatting is None:
                log.info(
                    "dataset %r: format %s, detected from columns %s", spec.name, fmt.value, sorted(present)
                )
            tags = dict(spec.tags)
            if fmt is DataFormat.SHAREGPT and not tags and first_row is not None:
                tags = _detect_tags(first_row.get(resolved["messages"]))
            return Layout(fmt, resolved, {**DEFAULT_TAGS, **tags})
        problems.append(f"{fmt.value} needs {', '.join(missing)}")
    pretraining = set(spec.columns) == {"prompt"} and spec.formatting in (None, DataFormat.ALPACA)
    hint = (
        ". A lone prompt column is LLaMA-Factory's pre-training layout (stage pt): under stage sft give the "
        "rows a response column, or set formatting: text with columns {text: ...} to train on every token"
        if pretraining
        else ""
    )
    raise DataError(
        f"dataset {spec.name!r} ({spec.path}): columns {sorted(present)} do not fit "
        f"{'the ' + formats[0].value + ' format' if spec.formatting else 'any format'} ({'; '.join(problems)}); "
        f"rename the columns, or map them with 'formatting' and 'columns' in dataset_info.json{hint}"
    )


def _detect_tags(messages: Any) -> dict[str, str]:
    """OpenAI-style tags when the first message has role/content keys, else LLaMA-Factory's defaults."""
    first = messages[0] if isinstance(messages, list) and messages else None
    if isinstance(first, Mapping) and first.get("role") is not None and "content" in first:
        return dict(_OPENAI_TAGS)
    return {}


def _optional(row: Mapping[str, Any], column: str) -> str | None:
    value = row.get(column)
    if value is not None and not isinstance(value, str):
        raise RowError(f"field {column!r} must be a string, got {type(value).__name__} {value!r:.60}")
    return value


def _field(row: Mapping[str, Any], column: str) -> str:
    value = _optional(row, column)
    if value is None:
        raise RowError(f"field {column!r} is missing")
    return value


def _messages(value: Any, tags: Mapping[str, str], column: str) -> list[dict[str, str]]:
    """A list of message dicts in the dataset's tags -> ``[{"role", "content"}]`` with moetune's roles."""
    if not isinstance(value, list) or not value:
        raise RowError(f"field {column!r} must be a non-empty list of messages, got {value!r:.60}")
    role_of = {tags[tag]: role for tag, role in _ROLE_OF_TAG.items()}
    role_tag, content_tag = tags["role_tag"], tags["content_tag"]
    messages = []
    for k, message in enumerate(value):
        if not isinstance(message, Mapping):
            raise RowError(f"{column}[{k}] must be a mapping with {role_tag!r} and {content_tag!r}")
        role = message.get(role_tag)
        if role not in role_of:
            raise RowError(
                f"{column}[{k}].{role_tag} is {role!r}; allowed: {', '.join(map(repr, role_of))} "
                f"(set 'tags' in dataset_info.json for other role names)"
            )
        content = message.get(content_tag)
        if not isinstance(content, str):
            raise RowError(f"{column}[{k}].{content_tag} is missing or not a string")
        if role_of[role] == "system" and k > 0:
            raise RowError(f"{column}[{k}] is a system message; only the first message may be one")
        messages.append({"role": role_of[role], "content": content})
    return messages


def _alpaca(row: Mapping[str, Any], layout: Layout) -> Sample:
    c = layout.columns
    prompt, response = _field(row, c["prompt"]), _field(row, c["response"])
    query = _optional(row, c["query"]) if "query" in c else None
    system = _optional(row, c["system"]) if "system" in c else None
    user = "\n".join(part for part in (prompt, query) if part)
    if not user:
        raise RowError(
            f"fields {c['prompt']!r}{' and ' + repr(c['query']) if 'query' in c else ''} are empty"
        )
    messages: list[dict[str, str]] = []
    if system:
        messages.append({"role": "system", "content": system})
    history = row.get(c["history"]) if "history" in c else None
    for k, turn in enumerate(history or []):
        if not (isinstance(turn, list) and len(turn) == 2 and all(isinstance(t, str) for t in turn)):
            raise RowError(
                f"{c['history']}[{k}] must be a [query, response] pair of strings, got {turn!r:.60}"
            )
        messages += [{"role": "user", "content": turn[0]}, {"role": "assistant", "content": turn[1]}]
    return Sample(
        messages=[*messages, {"role": "user", "content": user}, {"role": "assistant", "content": response}]
    )


def _sharegpt(row: Mapping[str, Any], layout: Layout) -> Sample:
    column = layout.columns["messages"]
    messages = _messages(row.get(column), layout.tags, column)
    system = _optional(row, layout.columns["system"]) if "system" in layout.columns else None
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(f"field {column!r} has no assistant message to train on")
    return Sample(messages=messages)


def _prompt_completion(row: Mapping[str, Any], layout: Layout) -> Sample:
    pc, cc = layout.columns["prompt"], layout.columns["completion"]
    prompt, completion = row.get(pc), row.get(cc)
    if isinstance(prompt, list) and isinstance(completion, list):  # conversational: lists of role/content
        head, tail = _messages(prompt, _OPENAI_TAGS, pc), _messages(completion, _OPENAI_TAGS, cc)
        if not any(m["role"] == "assistant" for m in tail):
            raise RowError(f"field {cc!r} has no assistant message to train on")
        return Sample(messages=head + tail, first_trained=len(head))
    p, c = _field(row, pc), _field(row, cc)
    if not c:
        raise RowError(f"field {cc!r} is empty")
    return Sample(text=p + c, trained_from=len(p))


def _text(row: Mapping[str, Any], layout: Layout) -> Sample:
    text = _field(row, layout.columns["text"])
    if not text:
        raise RowError(f"field {layout.columns['text']!r} is empty")
    return Sample(text=text)


ROW_READERS = {
    DataFormat.ALPACA: _alpaca,
    DataFormat.SHAREGPT: _sharegpt,
    DataFormat.PROMPT_COMPLETION: _prompt_completion,
    DataFormat.TEXT: _text,
}


def to_sample(row: Mapping[str, Any], layout: Layout) -> Sample:
    """One row as a :class:`Sample`; raises ``RowError`` naming the field that does not fit."""
    return ROW_READERS[layout.format](row, layout)


def _rows(batch: Mapping[str, list[Any]]) -> list[dict[str, Any]]:
    keys = list(batch)
    return [dict(zip(keys, values)) for values in zip(*(batch[k] for k in keys))]


def _validate(ds: Any, layout: Layout, spec: DatasetSpec) -> None:
    """Check every row up front; raise one DataError listing the first problems and counting the rest."""
    problems: list[str] = []
    count = 0
    index = 0
    for batch in ds.iter(batch_size=1000):
        for row in _rows(batch):
            try:
                to_sample(row, layout)
            except RowError as err:
                count += 1
                if len(problems) < LISTED:
                    problems.append(f"row {index}: {err}")
            index += 1
    if count:
        raise DataError(
            f"dataset {spec.name!r} ({spec.path}): {count} of {len(ds)} rows do not fit the {layout.format.value} "
            f"format:{listing(problems, total=count)}"
        )


def _encode_all(
    specs: Sequence[DatasetSpec], encoder: ExampleEncoder, config: DataConfig, cache_dir: Any
) -> Any:
    """Read and validate every dataset (their problems reported together), then encode and concatenate."""
    import datasets

    loaded, problems = [], []
    for spec in specs:
        try:
            loaded.append(_read_valid(spec, config, cache_dir))
        except DataError as err:
            problems.append(str(err))
    if problems:
        raise DataError("\n".join(problems))
    parts = [_encode(spec, ds, layout, encoder, config) for spec, ds, layout in loaded]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _read_valid(spec: DatasetSpec, config: DataConfig, cache_dir: Any) -> tuple[DatasetSpec, Any, Layout]:
    ds = read_dataset(spec, cache_dir)
    if config.max_samples is not None and len(ds) > config.max_samples:
        ds = ds.select(range(config.max_samples))
    if len(ds) == 0:
        raise DataError(f"dataset {spec.name!r} ({spec.path}) has no rows")
    layout = detect_layout(spec, ds.column_names, ds[0])
    _validate(ds, layout, spec)
    return spec, ds, layout


def _encode(spec: DatasetSpec, ds: Any, layout: Layout, encoder: ExampleEncoder, config: DataConfig) -> Any:
    cutoff = config.cutoff_len

    def encode_batch(batch: Mapping[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {k: [] for k in (*COLUMNS, "_length", "_first_label")}
        for row, index in zip(_rows(batch), indices):
            try:
                encoded = encoder.encode(to_sample(row, layout))
            except DataError as err:
                raise DataError(f"dataset {spec.name!r} ({spec.path}) row {index}: {err}") from None
            ids, labels = encoded.input_ids[:cutoff], encoded.labels[:cutoff]
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
            out["_length"].append(len(encoded.input_ids))
            first = encoded.first_label
            out["_first_label"].append(-1 if first is None else first)
        return out

    ds = ds.map(
        encode_batch,
        with_indices=True,
        batched=True,
        batch_size=config.preprocessing_batch_size,
        remove_columns=ds.column_names,
        num_proc=config.preprocessing_num_workers,
        load_from_cache_file=not config.overwrite_cache,
        desc=f"tokenizing {spec.name}",
    )
    return _drop_untrained(ds, spec, cutoff)


def _drop_untrained(ds: Any, spec: DatasetSpec, cutoff: int) -> Any:
    """Drop rows that truncation left with no trained token; all of them is an error naming cutoff_len."""
    first = ds["_first_label"]
    kept = [i for i, f in enumerate(first) if 0 <= f < cutoff]
    if not kept:
        need = min(f for f in first if f >= 0) + 1
        raise DataError(
            f"cutoff_len {cutoff} leaves no trained token in any of the {len(ds)} rows of dataset {spec.name!r}: "
            f"the shortest prompt needs cutoff_len >= {need}, and the longest example is {max(ds['_length'])} "
            f"tokens; raise cutoff_len"
        )
    if len(kept) < len(ds):
        log.warning(
            "dataset %r: dropped %d of %d rows whose prompt fills cutoff_len %d (no trained token left); "
            "the longest example is %d tokens",
            spec.name,
            len(ds) - len(kept),
            len(ds),
            cutoff,
            max(ds["_length"]),
        )
        ds = ds.select(kept)
    truncated = sum(n > cutoff for n in ds["_length"])
    if truncated:
        log.info("dataset %r: %d rows truncated to cutoff_len %d", spec.name, truncated, cutoff)
    return ds.remove_columns(["_length", "_first_label"])


def pack(ds: Any, cutoff_len: int, batch_size: int = 1000) -> Any:
    """Pack examples into rows of at most ``cutoff_len`` tokens (best fit, longest first, within each batch
    of ``batch_size`` examples), with ``position_ids`` restarting per example and no ``attention_mask``."""

    def pack_batch(batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        ids, labels = batch["input_ids"], batch["labels"]
        bins: list[list[int]] = []
        free: list[tuple[int, int]] = []  # (space left, bin), sorted: bisect finds the tightest fit
        for i in sorted(range(len(ids)), key=lambda i: -len(ids[i])):
            n = len(ids[i])
            k = bisect.bisect_left(free, (n, -1))
            if k == len(free):
                bins.append([i])
                bisect.insort(free, (cutoff_len - n, len(bins) - 1))
            else:
                space, b = free.pop(k)
                bins[b].append(i)
                bisect.insort(free, (space - n, b))
        out: dict[str, list[Any]] = {k: [] for k in PACKED_COLUMNS}
        for members in bins:
            row_ids: list[int] = []
            row_labels: list[int] = []
            row_pos: list[int] = []
            for i in members:
                row_ids += ids[i]
                row_labels += [IGNORE_INDEX] + labels[i][1:]  # never predict an example from the one before
                row_pos += range(len(ids[i]))
            out["input_ids"].append(row_ids)
            out["labels"].append(row_labels)
            out["position_ids"].append(row_pos)
        return out

    return ds.map(
        pack_batch, batched=True, batch_size=batch_size, remove_columns=ds.column_names, desc="packing"
    )


@dataclass(frozen=True)
class PadCollator:
    """Pads examples to the longest in the batch (rounded up to ``pad_to_multiple_of``).

    ``input_ids`` get ``pad_token_id``, ``labels`` -100, ``attention_mask`` 0; ``position_ids`` (packed
    rows) continue as a fresh sequence 0, 1, ..., which the block-diagonal mask keeps to itself.
    Returns ``[B, L]`` int64 tensors.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, Any]:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        fill = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
        batch = {}
        for key in features[0]:
            rows = []
            for f in features:
                n = longest - len(f[key])
                rows.append([*f[key], *(range(n) if key == "position_ids" else [fill[key]] * n)])
            batch[key] = torch.tensor(rows, dtype=torch.long)
        return batch
