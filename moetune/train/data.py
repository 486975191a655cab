"""Datasets -> tokenized, label-masked examples ready for a transformers ``Trainer``.

The flow, for each dataset of the config::

    read (local json/jsonl/parquet/csv/txt file, folder of them, or a `save_to_disk` folder)
      -> row layout: dataset_info.json's formatting/columns/tags, else detected from the column names
      -> validate every row (the first problems are reported together, with row index and field)
      -> encode: conversations through the chat template, loss on assistant tokens only;
                 prompt/completion strings: loss on the completion; plain text: loss on every token
      -> truncate to cutoff_len, drop rows left with no trained token (all of them: an error)
    then concatenate, hold out val_size, and optionally pack the training rows (``moetune.train.packing``).

Each stage reads its rows with a :class:`RowCodec` (sft's :data:`SUPERVISED`, pt's :data:`TEXT`, the
preference stages' in ``moetune.train.preference``) on this one path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from moetune.config.datasets import (
    DEFAULT_TAGS,
    FILE_BUILDERS,
    DataFormat,
    DatasetSpec,
    RowKind,
    data_files,
    is_saved_dataset,
    layout_roles,
)
from moetune.config.schema import DataConfig
from moetune.errors import LISTED, DataError, listing
from moetune.train.packing import PadCollator, pack
from moetune.train.templates import IGNORE_INDEX, ExampleEncoder, Sample
from moetune.train.truncation import first_label_kept, fit

log = logging.getLogger(__name__)

COLUMNS = ("input_ids", "attention_mask", "labels")  # what an unpacked example holds
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
    """What the trainer needs from the data: datasets of token ids and labels, and their collator.

    The columns are the codec's: COLUMNS for sft and pt (``packing.PACKED_COLUMNS`` when packed); the
    preference stages' are in ``moetune.train.preference``, with the TRL trainer's own collator (None here).
    """

    train: Any  # datasets.Dataset
    eval: Any | None  # datasets.Dataset (never packed), or None
    collator: PadCollator | None


@dataclass(frozen=True)
class RowCodec:
    """How a stage turns rows into examples, on the one read -> validate -> encode -> truncate path.

    ``kind`` decides which columns a layout needs (``config.datasets.layout_roles``); ``read`` turns a row
    into a sample (``RowError`` naming the field when it does not fit); ``encode`` turns a sample into one
    example's columns, truncated to ``cutoff``, plus ``_length`` (tokens before truncation) and
    ``_first_label`` (index of the first trained token, -1 for none) for the truncation checks.
    """

    kind: RowKind
    read: Callable[[Mapping[str, Any], Layout], Any]
    encode: Callable[[Any, ExampleEncoder, int], dict[str, Any]]
    packable: bool = True  # rows of input_ids / labels that `pack` may concatenate


def prepare_datasets(
    config: DataConfig,
    tokenizer: Any,
    *,
    seed: int = 42,
    cache_dir: str | Path | None = None,
    codec: RowCodec | None = None,
) -> PreparedData:
    """Read, validate, tokenize and (optionally) pack the datasets of ``config``.

    Raises ``DataError`` naming the dataset, the rows and fields at fault, before any training starts.
    ``seed`` fixes the ``val_size`` split; ``cache_dir`` is where `datasets` keeps its cache files; ``codec``
    is the stage's (default: sft's, :data:`SUPERVISED`).
    """
    codec = codec if codec is not None else SUPERVISED
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} is not a fast tokenizer; moetune needs "
            f"token offsets to place labels (save the model with a tokenizer.json)"
        )
    encoder = ExampleEncoder(tokenizer, config)
    train = _encode_all(config.train_sources, encoder, config, cache_dir, codec)
    evals = (
        _encode_all(config.eval_sources, encoder, config, cache_dir, codec) if config.eval_sources else None
    )
    if config.val_size > 0:
        size = int(config.val_size) if config.val_size >= 1 else config.val_size
        # datasets rounds a fraction's share up
        held = size if isinstance(size, int) else math.ceil(size * len(train))
        if held >= len(train):
            raise DataError(
                f"val_size {size} holds out {'every one' if held == len(train) else held} of the {len(train)} "
                "training rows, leaving none to train on; lower it"
            )
        split = train.train_test_split(test_size=size, seed=seed)
        train, evals = split["train"], split["test"]
    if config.packing:
        assert codec.packable, "config.stage_rules refuses packing for stages whose rows cannot be packed"
        train = pack(train, config.cutoff_len, config.preprocessing_batch_size)
    if not codec.packable:
        return PreparedData(train=train, eval=evals, collator=None)
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
        for f in files:
            if FILE_BUILDERS[f.suffix.lower()] in TEXT_BUILDERS:
                check_utf8(spec.name, f)
        _check_file_split(spec)
        try:
            return datasets.load_dataset(
                builders.pop(),
                data_files=[str(f) for f in files],
                split=spec.split,  # "train", or a slice of it: "train[:100]", "train[10%:]"
                cache_dir=str(cache_dir) if cache_dir else None,
            )
        except ValueError as err:
            if "[" not in spec.split:
                raise
            raise DataError(
                f"dataset {spec.name!r}: split {spec.split!r} in dataset_info.json is not a slice `datasets` "
                f"reads ({err}); write e.g. 'train[:100]', 'train[100:]' or 'train[:10%]'"
            ) from None
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


def _check_file_split(spec: DatasetSpec) -> None:
    """``DataError`` unless ``spec.split`` names the one split a dataset read from files has (``train``), whole or
    sliced (``train[:100]``), as ``datasets.load_dataset`` takes it."""
    name = spec.split.split("[", 1)[0].strip()
    if name != "train":
        raise DataError(
            f"dataset {spec.name!r}: split {spec.split!r} in dataset_info.json; a dataset read from files "
            f"({spec.path}) has one split, 'train' (a slice of it is allowed: 'train[:100]', 'train[10%:]'); a "
            "held-out part for evaluation comes from val_size or eval_dataset"
        )


TEXT_BUILDERS = ("json", "csv", "text")  # file formats read as text: their bytes must be UTF-8
_UTF8_CHUNK = 1 << 24  # bytes decoded at a time: memory stays bounded for files of any size


def check_utf8(name: str, path: Path) -> None:
    """``DataError`` naming ``path`` and the line of its first byte sequence that is not UTF-8.

    pyarrow reads such bytes into a dataset and fails only when the row is read back, with a
    ``UnicodeDecodeError`` naming neither file nor row; this pass reads the file once, a chunk at a time.
    """
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = 0
    with path.open("rb") as f:
        while True:
            chunk = f.read(_UTF8_CHUNK)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as err:
                # err.object is the bytes the decoder held back (an incomplete character, no newline) + this chunk
                held = len(err.object) - len(chunk)
                line = lines + err.object[: err.start].count(b"\n") + 1
                raise DataError(
                    f"dataset {name!r}: {path} is not UTF-8 text: line {line} (byte {offset - held + err.start}) holds "
                    f"{err.object[err.start : err.end]!r}, which UTF-8 cannot decode ({err.reason}). Re-encode "
                    f"the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or fix that line"
                ) from None
            if not chunk:
                return
            offset += len(chunk)
            lines += chunk.count(b"\n")


def detect_layout(
    spec: DatasetSpec,
    columns: Sequence[str],
    first_row: Mapping[str, Any] | None,
    kind: RowKind = RowKind.SUPERVISED,
) -> Layout:
    """The row layout of ``spec`` for rows of ``kind``: the format dataset_info.json names, else the first
    format whose required columns are present; each role's column as mapped there, else the first default
    present. Plain text (pt) is always the text format: LLaMA-Factory writes pt datasets as alpaca entries
    whose ``prompt`` column holds the text."""
    present = set(columns)
    media = sorted(present & set(MEDIA_COLUMNS)) + sorted(set(spec.columns) & set(MEDIA_COLUMNS))
    if media:
        raise DataError(
            f"dataset {spec.name!r} ({spec.path}) has {media[0]!r} data: multimodal training is not supported; "
            f"train on text rows only"
        )
    if kind is RowKind.TEXT:
        formats = [DataFormat.TEXT]
    else:
        formats = [spec.formatting] if spec.formatting is not None else list(DataFormat)
    problems = []
    for fmt in formats:
        roles = layout_roles(fmt, kind, spec.columns)
        if roles is None:
            problems.append(f"{fmt.value} rows cannot hold {kind.value} examples")
            continue
        resolved: dict[str, str] = {}
        missing = []
        for role, (defaults, required) in roles.items():
            candidates = (
                (spec.columns[role],) if role in spec.columns and kind is not RowKind.TEXT else defaults
            )
            column = next((c for c in candidates if c in present), None)
            if column is not None:
                resolved[role] = column
            elif required or role in spec.columns:
                missing.append(f"{'/'.join(candidates)} ({role})")
        # pt reads its text by the defaults (LLaMA-Factory maps it as `prompt`); every other kind reads its mapping
        unread = sorted(set(spec.columns) - set(roles)) if kind is not RowKind.TEXT else []
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
    response = _field(row, layout.columns["response"])
    return Sample(messages=[*alpaca_prompt(row, layout), {"role": "assistant", "content": response}])


def alpaca_prompt(row: Mapping[str, Any], layout: Layout) -> list[dict[str, str]]:
    """An alpaca row's messages up to and including the user turn: system, history pairs, instruction + input."""
    c = layout.columns
    prompt = _field(row, c["prompt"])
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
    return [*messages, {"role": "user", "content": user}]


def _sharegpt(row: Mapping[str, Any], layout: Layout) -> Sample:
    column = layout.columns["messages"]
    messages = sharegpt_messages(row, layout)
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(f"field {column!r} has no assistant message to train on")
    _check_opening(messages, column)
    return Sample(messages=messages)


def _check_opening(messages: list[dict[str, str]], column: str) -> None:
    """``RowError`` when the conversation opens with an assistant message (after a system message, if any): an
    assistant turn is trained as the answer to what comes before it (LLaMA-Factory drops such rows as out of
    role order)."""
    first = messages[1] if messages[0]["role"] == "system" and len(messages) > 1 else messages[0]
    if first["role"] == "assistant":
        raise RowError(
            f"field {column!r} opens with an assistant message; a conversation starts with a user message (a "
            "system message may come before it)"
        )


def sharegpt_messages(row: Mapping[str, Any], layout: Layout) -> list[dict[str, str]]:
    """A sharegpt row's messages with moetune's roles, the system column's message first when it has one."""
    column = layout.columns["messages"]
    messages = _messages(row.get(column), layout.tags, column)
    system = _optional(row, layout.columns["system"]) if "system" in layout.columns else None
    if system and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system})
    return messages


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


def _validate(ds: Any, layout: Layout, spec: DatasetSpec, read: Callable[..., Any] = to_sample) -> None:
    """Check every row up front; raise one DataError listing the first problems and counting the rest."""
    problems: list[str] = []
    count = 0
    index = 0
    for batch in ds.iter(batch_size=1000):
        for row in _rows(batch):
            try:
                read(row, layout)
            except RowError as err:
                count += 1
                if len(problems) < LISTED:
                    problems.append(f"row {index}: {err}")
            index += 1
    if count:
        raise DataError(
            f"dataset {spec.name!r} ({spec.path}): {count} of {len(ds)} rows do not fit the {layout.format.value} "
            f"format{_for_kind(layout)}:{listing(problems, total=count)}"
        )


def _for_kind(layout: Layout) -> str:
    roles = set(layout.columns)
    if {"chosen", "rejected"} <= roles:
        return " with chosen/rejected responses (ranking)"
    return " with a kto_tag" if "kto_tag" in roles else ""


def _encode_all(
    specs: Sequence[DatasetSpec], encoder: ExampleEncoder, config: DataConfig, cache_dir: Any, codec: RowCodec
) -> Any:
    """Read and validate every dataset (their problems reported together), then encode and concatenate."""
    import datasets

    loaded, problems = [], []
    for spec in specs:
        try:
            loaded.append(_read_valid(spec, config, cache_dir, codec))
        except DataError as err:
            problems.append(str(err))
    if problems:
        raise DataError("\n".join(problems))
    parts = [_encode(spec, ds, layout, encoder, config, codec) for spec, ds, layout in loaded]
    return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)


def _read_valid(
    spec: DatasetSpec, config: DataConfig, cache_dir: Any, codec: RowCodec
) -> tuple[DatasetSpec, Any, Layout]:
    ds = read_dataset(spec, cache_dir)
    if config.max_samples is not None and len(ds) > config.max_samples:
        ds = ds.select(range(config.max_samples))
    if len(ds) == 0:
        raise DataError(f"dataset {spec.name!r} ({spec.path}) has no rows")
    layout = detect_layout(spec, ds.column_names, ds[0], codec.kind)
    _validate(ds, layout, spec, codec.read)
    return spec, ds, layout


def encode_supervised(sample: Sample, encoder: ExampleEncoder, cutoff: int) -> dict[str, Any]:
    """sft's and pt's example: COLUMNS truncated to ``cutoff`` (a conversation by LLaMA-Factory's rule,
    ``moetune.train.truncation``; a text to its first ``cutoff`` tokens), plus the truncation-check columns
    (``_first_label``: the first trained token kept, or, where truncation kept none, at least ``cutoff``)."""
    encoded = encoder.encode(sample, turns=True)
    ids, labels = fit(encoded, cutoff, latest_first=encoder.config.mask_history)
    kept_at = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), None)
    return {
        "input_ids": ids,
        "attention_mask": [1] * len(ids),
        "labels": labels,
        "_length": len(encoded.input_ids),
        "_first_label": first_label_kept(kept_at, encoded.first_label or 0, cutoff),
    }


SUPERVISED = RowCodec(RowKind.SUPERVISED, to_sample, encode_supervised)  # sft
TEXT = RowCodec(RowKind.TEXT, _text, encode_supervised)  # pt: the text format's reader, every token trained


def _encode(
    spec: DatasetSpec, ds: Any, layout: Layout, encoder: ExampleEncoder, config: DataConfig, codec: RowCodec
) -> Any:
    cutoff = config.cutoff_len

    def encode_batch(batch: Mapping[str, list[Any]], indices: list[int]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for row, index in zip(_rows(batch), indices):
            try:
                example = codec.encode(codec.read(row, layout), encoder, cutoff)
            except DataError as err:
                raise DataError(f"dataset {spec.name!r} ({spec.path}) row {index}: {err}") from None
            for key, value in example.items():
                out.setdefault(key, []).append(value)
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
            f"cutoff_len {need} keeps one for the row with the shortest prompt, and the longest example is "
            f"{max(ds['_length'])} tokens; raise cutoff_len"
        )
    if len(kept) < len(ds):
        log.warning(
            "dataset %r: dropped %d of %d rows whose prompt leaves no trained token within cutoff_len %d; "
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
        log.warning(
            "dataset %r: %d of %d rows are longer than cutoff_len %d and are cut to it (as LLaMA-Factory cuts: a "
            "long prompt before a short answer); the longest is %d tokens: raise cutoff_len to train them whole",
            spec.name,
            truncated,
            len(ds),
            cutoff,
            max(ds["_length"]),
        )
    return ds.remove_columns(["_length", "_first_label"])
