"""Stream each layer's routed experts from safetensors straight into a CPU ``ExpertEngine``.

Per layer, the engine's tensors are allocated once in the load dtype (gate_up ``[E, 2I, H]``, gate rows
first; down ``[E, H, I]``; biases ``[E, 2I]`` / ``[E, H]``) and filled one expert slice at a time from the
memory-mapped shards, so the peak beyond the engines themselves is one expert's matrix. Re-layouts happen
here, once: per-expert ``[out, in]`` matrices go to their rows, fused tensors stored transposed (Qwen3-VL,
gpt-oss) are transposed back, interleaved gate/up (gpt-oss) is split into a gate block and an up block.
No expert tensor ever becomes part of the torch model.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from moetune.arch.detect import DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS, ExpertsLayout
from moetune.engine import DenseExperts, EngineOptions, ExpertEngine, get_activation
from moetune.loading.checkpoint import Checkpoint, ShardReader
from moetune.loading.expert_plan import ExpertSource, LayerPlan


def format_bytes(n: int) -> str:
    """``1.23 GB`` / ``45.6 MB`` / ``789 KB``, for logs and the progress bar."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 1e3:.0f} KB"


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """``[2I, ...]`` with gate at even and up at odd rows -> gate rows then up rows."""
    return torch.cat((t[0::2], t[1::2]))


class _LayerBuffers:
    """One layer's engine tensors, filled slice by slice."""

    def __init__(self, layout: ExpertsLayout, dtype: torch.dtype) -> None:
        e, h, i = layout.num_experts, layout.hidden_size, layout.intermediate_size
        self.layout = layout
        self.gate_up = torch.empty(e, 2 * i, h, dtype=dtype)  # [E, 2I, H]
        self.down = torch.empty(e, h, i, dtype=dtype)  # [E, H, I]
        self.gate_up_bias = torch.empty(e, 2 * i, dtype=dtype) if layout.has_bias else None  # [E, 2I]
        self.down_bias = torch.empty(e, h, dtype=dtype) if layout.has_bias else None  # [E, H]

    def put_per_expert(self, role: str, e: int, w: torch.Tensor) -> None:
        """``w`` is expert ``e``'s ``[out, in]`` matrix: gate/up ``[I, H]``, down ``[H, I]``."""
        i = self.layout.intermediate_size
        dst = {"gate": self.gate_up[e, :i], "up": self.gate_up[e, i:], "down": self.down[e]}[role]
        dst.copy_(w)

    def put_fused(self, name: str, e: int, w: torch.Tensor, swapped: bool) -> None:
        """``w``: expert ``e``'s slice of fused tensor ``name`` as stored (``swapped``: last dims flipped)."""
        lay = self.layout
        if name in (GATE_UP, DOWN) and lay.transposed != swapped:
            w = w.t()  # stored x @ W: [H, 2I] / [I, H] -> [2I, H] / [H, I]
        if name in (GATE_UP, GATE_UP_BIAS) and lay.interleaved:
            w = _deinterleave(w)
        dst = {
            GATE_UP: self.gate_up,
            DOWN: self.down,
            GATE_UP_BIAS: self.gate_up_bias,
            DOWN_BIAS: self.down_bias,
        }[name]
        assert dst is not None
        dst[e].copy_(w)


def _fill(buffers: _LayerBuffers, source: ExpertSource, reader: ShardReader) -> None:
    handle = reader.file(source.info.file)
    if source.expert is not None:
        buffers.put_per_expert(source.role, source.expert, handle.get_tensor(source.info.key))
        return
    stored = handle.get_slice(source.info.key)
    for e in range(buffers.layout.num_experts):  # one expert at a time: no full-tensor temporary
        buffers.put_fused(source.role, e, stored[e], source.swapped)


def build_engine(
    layer: LayerPlan, reader: ShardReader, dtype: torch.dtype, options: EngineOptions
) -> ExpertEngine:
    """The engine of one experts module, its weights read from ``reader`` in ``dtype``."""
    lay = layer.site.layout
    buffers = _LayerBuffers(lay, dtype)
    for source in layer.sources:
        _fill(buffers, source, reader)
    return ExpertEngine(
        DenseExperts(buffers.gate_up, buffers.down),
        activation=get_activation(lay.activation, **dict(lay.activation_kwargs)),
        gate_up_bias=buffers.gate_up_bias,
        down_bias=buffers.down_bias,
        options=options,
        name=layer.site.path,
    )


def stream_experts(
    checkpoint: Checkpoint,
    layers: list[LayerPlan],
    dtype: torch.dtype,
    options: EngineOptions,
    *,
    progress: bool = True,
) -> Iterator[tuple[LayerPlan, ExpertEngine]]:
    """Yield ``(layer, engine)`` in plan order, each shard closed as soon as no later layer needs it.

    A tqdm bar counts layers and shows the read rate (checkpoint bytes per second).
    """
    from tqdm.auto import tqdm

    total = sum(layer.nbytes for layer in layers)
    bar = tqdm(total=len(layers), desc="moetune: routed experts", unit="layer", disable=not progress)
    start, done = time.perf_counter(), 0
    with ShardReader(checkpoint, [layer.files for layer in layers]) as reader, bar:
        for step, layer in enumerate(layers):
            engine = build_engine(layer, reader, dtype, options)
            reader.done(step)
            done += layer.nbytes
            rate = done / max(time.perf_counter() - start, 1e-9) / 1e9
            bar.set_postfix_str(f"{rate:.2f} GB/s, {format_bytes(done)} of {format_bytes(total)}")
            bar.update(1)
            yield layer, engine
