"""``manifest.json`` of a pre-quantized expert store: what was converted, from what, into which files.

    {
      "moetune_store": 2,                       format version of this layout
      "model_type": "qwen3_moe",
      "format": "int4", "params": {"group_size": 64, "symmetric": true},
      "source": {"path": ..., "config_sha256": ..., "files": [[name, size], ...], "fingerprint": ...},
      "layers": [{"module": "model.layers.0.mlp.experts", "file": "model.layers.0.mlp.experts.safetensors",
                  "num_experts": 8, "hidden_size": 64, "intermediate_size": 24, "bias": false}, ...],
      "files": {"model.layers.0.mlp.experts.safetensors": {"size": ..., "sha256": ...,
                "experts_sha256": [...]}, ...}
    }

Versions: 2 lays each file out for the mapping the engine computes on (``StoreWriter``: the data section on a page,
the weights first, dense bf16 rows padded as the engine holds them, ``[E, O, K + 32]``); 1 wrote safetensors' own
layout (contiguous rows, data 8-byte aligned). Both are read; a version-1 bf16 store gets a warning
(``ExpertStore.open``), and an older moetune refuses version 2 by name instead of failing on a padded shape.

``experts_sha256`` (one per expert: ``moetune.store.files.experts_sha256``) lets a rank of ``expert_parallel:
sharded`` verify the experts it holds without reading the others; stores written before it have none (the
field is optional, the version unchanged: an older moetune ignores it).

The source identity ties a store to the checkpoint it came from, cheaply: the SHA-256 of config.json's
content (keys sorted; ``transformers_version`` and ``_name_or_path``, which re-saving changes, left out),
the safetensors file names and sizes, and a fingerprint hashing each shard's first MiB (its header and the
start of its data), which differs between two fine-tunes of one architecture. Hashing whole shards would
cost a full read of the checkpoint at every load.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from moetune.errors import LoadError

MANIFEST = "manifest.json"
# `moetune convert --format`'s names for the store formats (FORMATS names where they differ: fp8_block, dense)
CONVERT_FORMATS = {"int8": "int8", "int4": "int4", "fp8": "fp8_block", "mxfp4": "mxfp4", "bf16": "dense"}
CONVERT_FORMAT_HINT = "|".join(CONVERT_FORMATS)  # for messages: int8|int4|fp8|mxfp4|bf16
VERSION = 2  # bump when the layout of stores changes; older readers then refuse newer stores by name
FINGERPRINT_BYTES = 1 << 20  # per shard: its header and the start of its data
_VOLATILE_CONFIG_KEYS = ("transformers_version", "_name_or_path")


class CheckpointFiles(Protocol):
    """What a source identity reads of a checkpoint (``moetune.loading.checkpoint.Checkpoint`` is one)."""

    @property
    def path(self) -> Path: ...
    @property
    def config(self) -> dict[str, Any]: ...
    @property
    def files(self) -> list[str]: ...
    def file_path(self, name: str) -> Path: ...


@dataclass(frozen=True)
class SourceIdentity:
    """The checkpoint a store was converted from (``path`` is informational, not compared)."""

    path: str
    config_sha256: str
    files: tuple[tuple[str, int], ...]  # safetensors shards: (name, size in bytes)
    fingerprint: str

    @classmethod
    def of(cls, checkpoint: CheckpointFiles) -> SourceIdentity:
        """Read from the checkpoint directory: config.json plus the first MiB of every shard."""
        config = {k: v for k, v in checkpoint.config.items() if k not in _VOLATILE_CONFIG_KEYS}
        config_sha = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        files = []
        h = hashlib.sha256()
        for name in checkpoint.files:
            path = checkpoint.file_path(name)
            files.append((name, path.stat().st_size))
            with path.open("rb") as f:
                h.update(f.read(FINGERPRINT_BYTES))
        return cls(str(checkpoint.path), config_sha, tuple(files), h.hexdigest())

    def differences(self, other: SourceIdentity) -> list[str]:
        """What differs between the store's source (``self``) and checkpoint ``other``, in words."""
        out = []
        if self.config_sha256 != other.config_sha256:
            out.append("config.json differs")
        if self.files != other.files:
            out.append(
                f"the safetensors files differ (store: {_files(self.files)}; checkpoint: {_files(other.files)})"
            )
        elif self.fingerprint != other.fingerprint:
            out.append("the safetensors files hold other bytes (their first MiB differs)")
        return out


def _files(files: tuple[tuple[str, int], ...]) -> str:
    shown = ", ".join(f"{n} ({s} B)" for n, s in files[:3])
    return shown + (f", ... ({len(files)} files)" if len(files) > 3 else "")


@dataclass(frozen=True)
class StoredLayer:
    """One experts module's entry: its module path, its file and its sizes E, H, I."""

    module: str
    file: str
    num_experts: int
    hidden_size: int
    intermediate_size: int
    bias: bool  # the file also holds gate_up_bias [E, 2I] and down_bias [E, H]


@dataclass(frozen=True)
class StoredFile:
    size: int
    sha256: str  # the whole file
    experts_sha256: tuple[str, ...] | None = None  # per expert (``store.files.experts_sha256``); None: older


@dataclass(frozen=True)
class Manifest:
    """A store's manifest, parsed and type-checked (``read``) or about to be written (``write``)."""

    model_type: str
    format: str  # a FORMATS name
    params: dict[str, Any]  # the format's params(): from_dense options reproducing the quantization
    source: SourceIdentity
    layers: tuple[StoredLayer, ...]
    files: dict[str, StoredFile]
    version: int = VERSION

    def convert_line(
        self,
        src: str | Path,
        dst: str | Path,
        want: str | None = None,
        want_params: Mapping[str, Any] | None = None,
    ) -> str:
        """The ``moetune convert`` command that writes this store's format and options from ``src`` over ``dst``
        (the CLI's ``--format`` names: fp8 for fp8_block, bf16 for dense); ``want`` / ``want_params``: the format
        (library name) and options a load asked for instead, where they differ from the store's."""
        name = want or self.format
        params = dict(want_params or {}) if name != self.format else {**self.params, **(want_params or {})}
        fmt = next((flag for flag, lib in CONVERT_FORMATS.items() if lib == name), name)
        line = f"moetune convert {src} {dst} --format {fmt}"
        if "group_size" in params:
            line += f" --group-size {params['group_size']}"
        if params.get("symmetric") is False:
            line += " --asymmetric"
        return line + " --overwrite"

    def to_json(self) -> str:
        body = {
            "moetune_store": self.version,
            "model_type": self.model_type,
            "format": self.format,
            "params": self.params,
            "source": asdict(self.source),
            "layers": [asdict(layer) for layer in self.layers],
            "files": {
                name: {k: v for k, v in asdict(f).items() if v is not None} for name, f in self.files.items()
            },
        }
        return json.dumps(body, indent=1) + "\n"

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Parse ``path``; ``LoadError`` naming it and the field for anything missing, mistyped or too new."""
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise LoadError(f"cannot read the store manifest {path}: {e}") from e
        field = "moetune_store"
        try:
            version = raw[field]
            if not isinstance(version, int) or not 1 <= version <= VERSION:
                raise LoadError(
                    f"{path}: store format version {version!r}; this moetune reads versions 1..{VERSION}. "
                    "Upgrade moetune, or convert the checkpoint again with this one"
                )
            field = "source"
            src = raw[field]
            source = SourceIdentity(
                _typed(src["path"], str),
                _typed(src["config_sha256"], str),
                tuple((_typed(n, str), _typed(s, int)) for n, s in src["files"]),
                _typed(src["fingerprint"], str),
            )
            field = "layers"
            layers = tuple(
                StoredLayer(
                    _typed(e["module"], str),
                    _typed(e["file"], str),
                    _typed(e["num_experts"], int),
                    _typed(e["hidden_size"], int),
                    _typed(e["intermediate_size"], int),
                    _typed(e["bias"], bool),
                )
                for e in raw[field]
            )
            field = "files"
            files = {
                _typed(n, str): StoredFile(
                    _typed(f["size"], int),
                    _typed(f["sha256"], str),
                    None
                    if f.get("experts_sha256") is None
                    else tuple(_typed(h, str) for h in _typed(f["experts_sha256"], list)),
                )
                for n, f in raw[field].items()
            }
            field = "model_type/format/params"
            manifest = cls(
                _typed(raw["model_type"], str),
                _typed(raw["format"], str),
                _typed(raw["params"], dict),
                source,
                layers,
                files,
                version,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise LoadError(
                f"{path} is not a valid store manifest: field {field!r} is missing or malformed ({e!r}); "
                f"convert the checkpoint again (moetune convert SRC DST --format {CONVERT_FORMAT_HINT} --overwrite)"
            ) from e
        unlisted = sorted({layer.file for layer in layers} - set(files))
        if unlisted:
            raise LoadError(f"{path}: layer file(s) {unlisted} have no size and SHA-256 under 'files'")
        return manifest


def _typed(value: Any, kind: type) -> Any:
    """``value`` if it is a ``kind`` (bool is not an int here); else ``TypeError``."""
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise TypeError(f"{value!r} is not a {kind.__name__}")
    return value
