"""safetensors files read from their headers: dtype codes, tensor names, shapes and byte ranges.

Shared by checkpoint loading (``moetune.loading``) and the pre-quantized store (``moetune.store``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moetune.errors import LoadError

# safetensors dtype codes ``ShardReader.read`` reads into torch tensors
TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a safetensors header describes it."""

    key: str
    file: str  # file name inside the checkpoint directory
    dtype: str  # safetensors dtype code: "BF16", "F32", "F8_E4M3", ...
    shape: tuple[int, ...]
    nbytes: int
    offset: int = 0  # byte offset of its data in the file


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors of one safetensors file, from its header (8-byte length, then JSON)."""
    try:
        with path.open("rb") as f:
            size_bytes = f.read(8)
            if len(size_bytes) != 8:
                raise LoadError(f"{path} is not a safetensors file: shorter than its 8-byte header length")
            (size,) = struct.unpack("<Q", size_bytes)
            file_size = path.stat().st_size
            if size > file_size - 8:
                raise LoadError(
                    f"{path} is not a valid safetensors file: header length {size} exceeds the file"
                )
            header = json.loads(f.read(size))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise LoadError(f"cannot read the safetensors header of {path}: {e}") from e
    out: dict[str, TensorInfo] = {}
    data_size = file_size - 8 - size
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        begin, end = meta["data_offsets"]
        if end > data_size:
            raise LoadError(
                f"{path} is truncated: tensor {key!r} ends at byte {end} of a {data_size}-byte data section"
            )
        out[key] = TensorInfo(
            key, path.name, meta["dtype"], tuple(meta["shape"]), end - begin, 8 + size + begin
        )
    return out
