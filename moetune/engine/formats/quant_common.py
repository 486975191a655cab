"""What the quantized expert formats share: row-chunked dequantization into the engine's tile, per-thread
scratch, and constructor checks whose messages name the field.

A quantized format defines its dequantized weight as fp32 numbers: ``_dequant_rows`` writes rows
``[r0, r1)`` of one expert matrix in fp32. ``tile`` walks the matrix in chunks of about ``CHUNK_ELEMS``
elements so that a chunk's integer codes, its fp32 values and its scales stay in cache between the few
passes that dequantize it, and every pass runs on contiguous memory. Other compute dtypes (bf16 on
AMX machines, fp64 in tests) are the fp32 values rounded or widened, chunk by chunk.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar

import torch

from moetune.engine.formats.base import ExpertFormat, Projection
from moetune.engine.formats.dense import DenseExperts
from moetune.engine.workspace import thread_workspace
from moetune.errors import EngineError

# 256 Ki elements (1 MiB of fp32) per chunk: 128- to 768-row chunks of a 2048-wide tile measured equally
# fast here, whole-tile passes no faster, and larger chunks would need larger scratch.
CHUNK_ELEMS = 1 << 18


def scratch(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A per-thread reused buffer (see ``Workspace``): dequantization allocates nothing per step."""
    return thread_workspace().get(name, shape, dtype)


def row_chunks(start: int, stop: int, cols: int, align: int = 1) -> list[tuple[int, int]]:
    """Row ranges covering ``[start, stop)`` of a matrix ``cols`` wide, about ``CHUNK_ELEMS`` each.

    Chunk lengths are multiples of ``align`` (the last may be shorter), so block-scaled formats can apply
    whole blocks of scales per chunk.
    """
    step = align * max(1, CHUNK_ELEMS // (align * max(cols, 1)))
    return [(r, min(r + step, stop)) for r in range(start, stop, step)]


def check_dense(fmt: str, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[int, int, int]:
    """Validate ``from_dense`` input as ``DenseExperts`` does; returns (E, H, I)."""
    try:
        dense = DenseExperts(gate_up.detach(), down.detach())
    except EngineError as err:
        raise EngineError(f"{fmt}.from_dense: {err}") from None
    return dense.num_experts, dense.hidden_size, dense.intermediate_size


def check_stored(
    fmt: str, field: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], symbols: str
) -> torch.Tensor:
    """``t`` (made contiguous) if it is a CPU tensor of ``dtype`` and ``shape``; else an EngineError naming
    ``field``, what it must be (``symbols`` spells the shape, e.g. ``"[E, 2I, H/2]"``) and what it is."""
    if not isinstance(t, torch.Tensor):
        raise EngineError(f"{fmt}: {field} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype != dtype or tuple(t.shape) != shape:
        raise EngineError(
            f"{fmt}: {field} must be {dtype} {symbols} = {shape}; got {t.dtype} {tuple(t.shape)}"
        )
    if t.device.type != "cpu":
        raise EngineError(f"{fmt}: {field} must live in host memory; got device {t.device}")
    t = t.detach()
    return t if t.is_contiguous() else t.contiguous()


def gate_up_dims(
    fmt: str, field: str, t: torch.Tensor, symbols: str, values_per_col: int = 1
) -> tuple[int, int, int]:
    """(E, H, I) read off gate_up's stored tensor ``[E, 2I, H / values_per_col]``; EngineError naming
    ``field`` if it is not 3-D or its row count is odd (gate rows then up rows)."""
    if not isinstance(t, torch.Tensor) or t.dim() != 3:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise EngineError(f"{fmt}: {field} must be a 3-D tensor {symbols}; got {got}")
    e, two_i, cols = t.shape
    if two_i % 2:
        raise EngineError(
            f"{fmt}: {field} has 2I rows (gate rows, then up rows), so an even count; got {two_i}"
        )
    return e, cols * values_per_col, two_i // 2


class QuantizedExperts(ExpertFormat):
    """Base of formats that store codes plus scales and dequantize one expert matrix per ``tile`` call.

    Subclasses set ``num_experts``, ``hidden_size``, ``intermediate_size`` and ``_chunks`` (row ranges per
    projection, from ``row_chunks``), and implement ``_dequant_rows``.
    """

    _chunks: dict[str, list[tuple[int, int]]]
    # dtypes ``_dequant_rows`` writes directly, each value the fp32 one rounded once (others: via fp32 scratch)
    DIRECT_DTYPES: ClassVar[tuple[torch.dtype, ...]] = (torch.float32,)

    @abstractmethod
    def _dequant_rows(self, proj: Projection, expert: int, r0: int, r1: int, out: torch.Tensor) -> None:
        """Write rows ``[r0, r1)`` of expert ``expert``'s ``proj`` matrix into out ``[r1 - r0, D_in]``, whose
        dtype is one of ``DIRECT_DTYPES``."""

    def tile(
        self,
        proj: Projection,
        expert: int,
        dtype: torch.dtype,
        buf: torch.Tensor | None,
        rows: slice | None = None,
    ) -> torch.Tensor:
        d_out, cols = self.shape(proj)
        start = 0 if rows is None or rows.start is None else rows.start
        stop = d_out if rows is None or rows.stop is None else rows.stop
        assert buf is not None and tuple(buf.shape) == (stop - start, cols) and buf.dtype == dtype, (
            "quantized formats always write into a caller buffer of the rows asked for, in the compute dtype"
        )
        assert start % self.row_align(proj) == 0, "row blocks must start on the format's block boundaries"
        for c0, c1 in self._chunks[proj]:  # chunks never cross a scale segment; clip them to the rows asked
            r0, r1 = max(c0, start), min(c1, stop)
            if r0 >= r1:
                continue
            dst = buf[r0 - start : r1 - start]
            if dtype in self.DIRECT_DTYPES:
                self._dequant_rows(proj, expert, r0, r1, dst)
            else:
                f32 = scratch("dequant_f32", (r1 - r0, cols), torch.float32)
                self._dequant_rows(proj, expert, r0, r1, f32)
                dst.copy_(f32)
        return buf

    def needs_buffer(self, dtype: torch.dtype) -> bool:
        return True


PerExpertTarget = tuple[Callable[[int], torch.Tensor], str]  # expert x -> its destination view, shape symbols


def per_expert_lists(
    name: str, lists: Mapping[str, Sequence[torch.Tensor]], gate_symbols: str
) -> tuple[int, int, int]:
    """``(E, rows, cols)`` of ``from_per_expert`` lists: one tensor per expert in every list (at least one),
    ``rows, cols`` the shape of ``gate[0]`` (2-D, ``gate_symbols`` in messages); ``EngineError`` otherwise."""
    e = len(lists["gate"])
    if e == 0 or any(len(v) != e for v in lists.values()):
        raise EngineError(
            f"{name}.from_per_expert: every list needs one tensor per expert (at least one); got lengths "
            + ", ".join(f"{k}={len(v)}" for k, v in lists.items())
        )
    gate0 = lists["gate"][0]
    if not isinstance(gate0, torch.Tensor) or gate0.dim() != 2:
        raise EngineError(
            f"{name}.from_per_expert: gate[0] must be a 2-D {gate_symbols} tensor; got {gate0!r:.80}"
        )
    return e, gate0.shape[0], gate0.shape[1]


def copy_per_expert(
    name: str, lists: Mapping[str, Sequence[torch.Tensor]], targets: dict[str, PerExpertTarget]
) -> None:
    """Copy every list's tensors, each checked (``check_stored``: dtype and shape), into its destination."""
    for field, tensors in lists.items():
        dest, symbols = targets[field]
        for x, t in enumerate(tensors):
            d = dest(x)
            d.copy_(check_stored(name, f"{field}[{x}]", t, d.dtype, tuple(d.shape), symbols))
