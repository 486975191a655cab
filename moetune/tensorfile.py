"""safetensors files read from their headers (dtype codes, tensor names, shapes and byte ranges), and written
tensor by tensor (:func:`write_streamed`).

Shared by checkpoint loading (``moetune.loading``), the pre-quantized store (``moetune.store``) and the adapter
writer (``moetune.adapters.save``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from moetune.errors import LoadError, MoetuneError

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


# safetensors' dtype codes in the order its writer lays data out: the largest code first, as its Rust ``Dtype``
# enum orders them (``save_file`` sorts by dtype, descending, then by name)
_WRITE_ORDER = (
    "U64",
    "I64",
    "F64",
    "F32",
    "U32",
    "I32",
    "BF16",
    "F16",
    "U16",
    "I16",
    "F8_E4M3",
    "F8_E5M2",
    "I8",
    "U8",
    "BOOL",
)
# what can be written: the dtypes read above and the wide unsigned ones torch also has
_WRITABLE = {**TORCH_DTYPES, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16}
_CODES = {_WRITABLE[code]: (rank, code) for rank, code in enumerate(_WRITE_ORDER)}


def layout(
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    align: int = 8,
    largest_first: bool = False,
    by_name: bool = False,
) -> tuple[bytes, list[str]]:
    """The header (8-byte length, JSON padded with spaces to a multiple of 8) and the data order of a
    safetensors file holding ``tensors``, laid out as ``safetensors.torch.save_file`` lays it out; only each
    tensor's dtype and shape are read (``meta`` tensors will do).

    For files that are memory-mapped and computed on (a mapping starts on a page): ``align`` (a multiple of 8)
    pads the JSON with spaces until the data section starts at a multiple of ``align`` bytes of the file
    (trailing whitespace is valid JSON; the format asks only for a multiple of 8), and ``largest_first`` lays the
    data out by size, largest first (then by name), instead of by dtype: the big tensors (weights, whose sizes are
    whole cache lines) then start at aligned offsets, the small ones (scales, biases) after them. Readers find
    tensors by their offsets, so stock safetensors reads either order. ``by_name``: the data by name alone (a
    quantized weight's parts, ``x.weight`` and ``x.weight_scale_inv``, then come one after the other)."""
    if align <= 0 or align % 8:
        raise MoetuneError(f"safetensors data alignment must be a positive multiple of 8 bytes; got {align}")
    unknown = sorted({str(t.dtype) for t in tensors.values() if t.dtype not in _CODES})
    if unknown:
        raise MoetuneError(f"safetensors cannot hold dtype(s) {unknown}; it holds {[str(d) for d in _CODES]}")
    if by_name:
        order = sorted(tensors)
    elif largest_first:
        order = sorted(tensors, key=lambda k: (-tensors[k].numel() * tensors[k].element_size(), k))
    else:
        order = sorted(tensors, key=lambda k: (_CODES[tensors[k].dtype][0], k))
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key in order:
        t = tensors[key]
        end = offset + t.numel() * t.element_size()
        header[key] = {"dtype": _CODES[t.dtype][1], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % align)
    return struct.pack("<Q", len(text)) + text, order


def write_streamed(
    path: Path,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    fetch: Callable[[torch.Tensor], torch.Tensor] | None = None,
    align: int = 8,
    largest_first: bool = False,
    produce: Callable[[str], torch.Tensor] | None = None,
    by_name: bool = False,
    behind: bool = False,
) -> None:
    """Write ``tensors`` to ``path`` as one safetensors file (the layout of ``save_file``, so stock readers see
    the same file), one tensor at a time: the header first, from the dtypes and shapes alone, then each tensor's
    bytes in the data order. A ``meta`` tensor stands for one produced only when its turn comes:
    ``fetch(placeholder)`` returns it (same dtype and shape; e.g. gathered from other processes), and it is
    dropped once written, so at most one such tensor is held at a time (``produce(key)`` instead, when given, is
    asked by the tensor's name). ``align``, ``largest_first``, ``by_name``: where the data section starts and in
    which order the data go (``layout``). ``behind``: each tensor's bytes are written by a second thread while
    this one produces the next (computing and writing overlap; two produced tensors are held at most, the one
    being written and the one being made); ``fetch`` / ``produce`` still run on the calling thread. Not atomic
    by itself: write into a temporary file and rename (``moetune.atomic.write_atomically``)."""
    header, order = layout(tensors, metadata, align, largest_first, by_name)
    with path.open("wb") as f:
        f.write(header)
        if not behind:
            for key in order:  # the produced tensor is an argument only: dropped when its bytes are written
                _write_bytes(f, _produced(key, tensors[key], fetch, produce))
            return
        # the executor's exit waits for the write in flight, so the file is never closed under it
        with ThreadPoolExecutor(1, thread_name_prefix="moetune-write") as writer:
            pending: Future[None] | None = None
            for key in order:
                t = _produced(key, tensors[key], fetch, produce)  # made while the one before is written
                if pending is not None:
                    pending.result()  # the writer's error, raised here
                pending = writer.submit(_write_bytes, f, t)  # the writer drops t once written
                del t
            if pending is not None:
                pending.result()


def _produced(
    key: str,
    t: torch.Tensor,
    fetch: Callable[[torch.Tensor], torch.Tensor] | None,
    produce: Callable[[str], torch.Tensor] | None,
) -> torch.Tensor:
    if not t.is_meta:
        return t
    assert fetch is not None or produce is not None, f"{key} is a placeholder and no fetch was given"
    got = produce(key) if produce is not None else fetch(t)  # type: ignore[misc]
    assert (got.dtype, got.shape) == (t.dtype, t.shape), (key, got.dtype, got.shape, t.shape)
    return got


def _write_bytes(f: BinaryIO, t: torch.Tensor) -> None:
    """``t``'s own bytes (a view, no copy when it is contiguous on the CPU)."""
    if t.numel():
        f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
