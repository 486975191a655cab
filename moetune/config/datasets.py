"""Resolving ``dataset`` / ``eval_dataset`` names into local dataset sources.

A name is looked up in ``dataset_dir/dataset_info.json`` (LLaMA-Factory's registry of datasets), else taken
as a path to a local file or folder (as written, or under ``dataset_dir``). An entry of dataset_info.json
may give ``file_name``, ``formatting`` (``alpaca`` | ``sharegpt``, plus moetune's ``prompt_completion`` |
``text``), ``columns`` (preference roles ``chosen`` / ``rejected`` / ``kto_tag`` included), ``tags``, ``split``
and ``ranking``; moetune reads local files only, so hub entries are errors
that say how to download them. Rows are read later, by ``moetune.train.data``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moetune.config.fields import Problems

DATASET_INFO = "dataset_info.json"

# data file suffixes -> the `datasets` builder that reads them
FILE_BUILDERS: dict[str, str] = {
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".txt": "text",
    ".arrow": "arrow",
}


class DataFormat(str, enum.Enum):
    """How a dataset's rows hold a training example."""

    ALPACA = "alpaca"  # instruction / input / output, optional system and history
    SHAREGPT = "sharegpt"  # a list of messages; ShareGPT (from/value) and OpenAI (role/content) tags
    PROMPT_COMPLETION = "prompt_completion"  # prompt / completion strings or message lists
    TEXT = "text"  # plain text, trained on every token


# column roles each format reads (LLaMA-Factory's role names for alpaca and sharegpt): role -> (column
# names tried in order when dataset_info.json does not map the role, whether the role is required)
COLUMN_ROLES: dict[DataFormat, dict[str, tuple[tuple[str, ...], bool]]] = {
    DataFormat.ALPACA: {
        "prompt": (("instruction",), True),
        "query": (("input",), False),
        "response": (("output",), True),
        "system": (("system",), False),
        "history": (("history",), False),
    },
    DataFormat.SHAREGPT: {"messages": (("conversations", "messages"), True), "system": (("system",), False)},
    DataFormat.PROMPT_COMPLETION: {"prompt": (("prompt",), True), "completion": (("completion",), True)},
    DataFormat.TEXT: {"text": (("text",), True)},
}


class RowKind(str, enum.Enum):
    """What a training stage reads from a row (``moetune.train.stages`` declares one per stage)."""

    SUPERVISED = "supervised"  # sft: a conversation, prompt/completion or text
    TEXT = "text"  # pt: one text per row, every token trained
    PAIRED = "paired"  # dpo: a prompt with a chosen and a rejected response (LLaMA-Factory's `ranking`)
    UNPAIRED = "unpaired"  # kto: a conversation ending in a response, and a desirable/undesirable tag


# the preference roles LLaMA-Factory's `columns` may map, and the formats that carry them
PAIR_ROLES: dict[str, tuple[tuple[str, ...], bool]] = {
    "chosen": (("chosen",), True),
    "rejected": (("rejected",), True),
}
KTO_ROLES: dict[str, tuple[tuple[str, ...], bool]] = {"kto_tag": (("kto_tag",), True)}
_PREFERENCE_FORMATS = (DataFormat.ALPACA, DataFormat.SHAREGPT)


def layout_roles(
    fmt: DataFormat, kind: RowKind, mapped: Mapping[str, str]
) -> dict[str, tuple[tuple[str, ...], bool]] | None:
    """The column roles a row of format ``fmt`` needs for ``kind`` (role -> (default column names, required)),
    or None when the format cannot hold such rows. ``mapped`` is the entry's ``columns``: plain text (pt) reads
    the column LLaMA-Factory maps as ``prompt``, else ``text``."""
    if kind is RowKind.SUPERVISED:
        return COLUMN_ROLES[fmt]
    if kind is RowKind.TEXT:
        if fmt is not DataFormat.TEXT:
            return None
        return {"text": ((mapped.get("prompt", mapped.get("text", "text")),), True)}
    if fmt not in _PREFERENCE_FORMATS:
        return None
    if kind is RowKind.UNPAIRED:
        return {**COLUMN_ROLES[fmt], **KTO_ROLES}
    roles = {r: v for r, v in COLUMN_ROLES[fmt].items() if r != "response"}  # the responses are the pair
    return {**roles, **PAIR_ROLES}


# LLaMA-Factory's sharegpt tags and their defaults
DEFAULT_TAGS: dict[str, str] = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}

_UNSUPPORTED_COLUMNS = {
    "images": "multimodal data is not supported",
    "videos": "multimodal data is not supported",
    "audios": "multimodal data is not supported",
    "tools": "tool definitions are not supported yet",
}

_HUB_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
_ENTRY_KEYS = {
    "file_name",
    "formatting",
    "columns",
    "tags",
    "split",
    "ranking",
    "subset",
    "folder",
    "num_samples",
}


@dataclass(frozen=True)
class DatasetSpec:
    """One local dataset: where it is and, when dataset_info.json says, how its rows are laid out.

    ``formatting=None`` means: detect the format from the columns when the rows are read. ``columns``
    maps a format's column roles to column names and ``tags`` holds sharegpt message tags; both are empty
    unless dataset_info.json gives them.
    """

    name: str  # as written in `dataset`
    path: Path  # a data file, a folder of data files, or a `save_to_disk` folder
    formatting: DataFormat | None = None
    columns: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    tags: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    # the split of a saved DatasetDict; of files: "train", or a slice of it such as "train[:100]"
    split: str = "train"
    ranking: bool = False  # LLaMA-Factory's `ranking`: rows are preference pairs (stage dpo)


def resolve_datasets(
    key: str, names: tuple[str, ...], dataset_dir: Path, problems: Problems
) -> tuple[DatasetSpec, ...]:
    """``names`` (the value of config key ``key``) as dataset sources; problems are reported against ``key``."""
    info_path = dataset_dir / DATASET_INFO
    info = _read_info(info_path, key, problems) if info_path.is_file() else {}
    specs = []
    for name in names:
        if info is None and not any(p.exists() for p in (Path(name).expanduser(), dataset_dir / name)):
            continue  # a name for the unreadable dataset_info.json, which is reported already
        spec = _resolve(name, info or {}, dataset_dir, key, problems)
        if spec is not None:
            specs.append(spec)
    return tuple(specs)


def _read_info(path: Path, key: str, problems: Problems) -> dict[str, Any] | None:
    """dataset_info.json's entries, or None (a problem reported) where it is not a JSON object."""
    try:
        info = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        problems.add(key, f"cannot read {path}: {err}; fix the JSON or remove the file")
        return None
    if not isinstance(info, dict):
        problems.add(key, f"{path} must hold a JSON object mapping dataset names to entries")
        return None
    return info


def _resolve(
    name: str, info: dict[str, Any], dataset_dir: Path, key: str, problems: Problems
) -> DatasetSpec | None:
    if name in info:
        return _from_entry(name, info[name], dataset_dir, key, problems)
    for candidate in (Path(name).expanduser(), dataset_dir / name):
        if candidate.exists():
            return _checked_path(DatasetSpec(name=name, path=candidate), key, problems)
    known = (
        f" (names there: {', '.join(sorted(info))})"
        if info
        else f" ({dataset_dir / DATASET_INFO} does not exist)"
    )
    problems.add(
        key,
        f"{name!r} is neither a dataset name in {dataset_dir / DATASET_INFO}{known} nor an existing file or "
        f"folder; give a path to a local .json/.jsonl/.parquet/.csv file or folder, or register the name there",
    )
    return None


def _from_entry(name: str, entry: Any, dataset_dir: Path, key: str, problems: Problems) -> DatasetSpec | None:
    where = f"{dataset_dir / DATASET_INFO} entry {name!r}"
    if not isinstance(entry, dict):
        problems.add(key, f"{where} must be a JSON object with at least 'file_name'")
        return None
    errors = []
    hub = [k for k in _HUB_KEYS if k in entry]
    if hub and "file_name" not in entry:
        errors.append(
            f"has {hub[0]} but no file_name; moetune reads local files only: download the data "
            f"(e.g. `hf download --repo-type dataset ...`) and set file_name to the local copy"
        )
    unknown = sorted(set(entry) - _ENTRY_KEYS - set(_HUB_KEYS))
    if unknown:
        errors.append(f"has unknown keys {unknown}; allowed: {sorted(_ENTRY_KEYS)}")
    ranking = entry.get("ranking", False)
    if not isinstance(ranking, bool):
        errors.append(f"has ranking {ranking!r}; expected true (a preference dataset) or false")
    for unsupported, reason in (
        ("subset", "dataset configurations apply to hub datasets only"),
        ("folder", "hub folders apply to hub datasets only"),
        ("num_samples", "sampling a dataset to a size is not supported; use max_samples"),
    ):
        if entry.get(unsupported):
            errors.append(f"sets {unsupported!r}: {reason}")
    formatting = None
    if "formatting" in entry:
        try:
            formatting = DataFormat(entry["formatting"])
        except ValueError:
            errors.append(
                f"has formatting {entry['formatting']!r}; allowed: {', '.join(f.value for f in DataFormat)}"
            )
    columns = _string_map(entry.get("columns", {}), "columns", errors)
    tags = _string_map(entry.get("tags", {}), "tags", errors)
    for role, column in columns.items():
        if role in _UNSUPPORTED_COLUMNS:
            errors.append(f"maps column role {role!r} ({column!r}): {_UNSUPPORTED_COLUMNS[role]}")
        elif formatting is not None and role not in _roles_of(formatting):
            errors.append(
                f"maps column role {role!r}, which {formatting.value} does not have; "
                f"allowed: {sorted(_roles_of(formatting))}"
            )
    bad_tags = sorted(set(tags) - set(DEFAULT_TAGS))
    if bad_tags:
        errors.append(f"has unknown tags {bad_tags}; allowed: {sorted(DEFAULT_TAGS)}")
    split = entry.get("split", "train")
    if not isinstance(split, str):
        errors.append(f"has split {split!r}; expected a split name such as 'train'")
    if not isinstance(entry.get("file_name", ""), str):
        errors.append(f"has file_name {entry['file_name']!r}; expected a path relative to {dataset_dir}")
    for error in errors:
        problems.add(key, f"{where} {error}")
    if errors or "file_name" not in entry:
        if not errors:
            problems.add(key, f"{where} has no file_name; set it to a file or folder under {dataset_dir}")
        return None
    spec = DatasetSpec(
        name=name,
        path=dataset_dir / entry["file_name"],
        formatting=formatting,
        columns=MappingProxyType(columns),
        tags=MappingProxyType(tags),
        split=split,
        ranking=ranking is True,
    )
    return _checked_path(spec, key, problems)


def _roles_of(fmt: DataFormat) -> set[str]:
    """Every column role an entry of format ``fmt`` may map, for any stage."""
    roles = set(COLUMN_ROLES[fmt])
    return roles | set(PAIR_ROLES) | set(KTO_ROLES) if fmt in _PREFERENCE_FORMATS else roles


def _string_map(value: Any, what: str, errors: list[str]) -> dict[str, str]:
    if isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        return dict(value)
    errors.append(f"has {what} {value!r}; expected a JSON object of strings")
    return {}


def _checked_path(spec: DatasetSpec, key: str, problems: Problems) -> DatasetSpec | None:
    """``spec`` if its path is a readable data file or folder; otherwise report why not."""
    path = spec.path
    if not path.exists():
        problems.add(key, f"dataset {spec.name!r}: {path} does not exist; check file_name and dataset_dir")
        return None
    if path.is_file() and path.suffix.lower() not in FILE_BUILDERS:
        problems.add(
            key,
            f"dataset {spec.name!r}: {path} has suffix {path.suffix!r}; supported: {', '.join(FILE_BUILDERS)} "
            f"or a folder saved with `datasets`' save_to_disk",
        )
        return None
    if path.is_dir() and not is_saved_dataset(path) and not data_files(path):
        problems.add(
            key,
            f"dataset {spec.name!r}: folder {path} holds neither a `save_to_disk` dataset nor data files "
            f"({', '.join(FILE_BUILDERS)})",
        )
        return None
    return spec


def is_saved_dataset(path: Path) -> bool:
    """True for a folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def data_files(folder: Path) -> list[Path]:
    """The data files directly in ``folder``, sorted (hidden files skipped)."""
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.suffix.lower() in FILE_BUILDERS and not p.name.startswith(".")
    )
