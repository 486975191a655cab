"""Stream each layer's routed experts from safetensors straight into a CPU ``ExpertEngine``.

Per layer, dense tensors are allocated once in the load dtype (gate_up ``[E, 2I, H]``, gate rows first;
down ``[E, H, I]``; biases ``[E, 2I]`` / ``[E, H]``) and filled one expert slice at a time from the
memory-mapped shards. Re-layouts happen here, once: per-expert ``[out, in]`` matrices (or a stacked
projection's slice) go to their rows, fused tensors stored transposed (Qwen3-VL, gpt-oss) are transposed back,
interleaved gate/up (gpt-oss, Inkling) is split into a gate block and an up block. No expert tensor ever becomes part of the torch model.

The layer's ``ExpertFormatChoice`` (``LoadOptions.layer_format``) then decides what the engine holds:

* dense: those tensors themselves (peak beyond the engines: one expert's matrix read from the shard);
* int8 / int4 / fp8_block from a float checkpoint: quantized from them, layer by layer, the dense tensors
  read in the checkpoint's own float dtype into one buffer reused for every layer (peak beyond the quantized
  engines: one layer's dense experts);
* an FP8 checkpoint's layer: its e4m3 bytes and block scales copied, one expert matrix at a time, into
  ``Fp8BlockExperts`` (no float round trip); for another format they are dequantized (``dequantize``, one
  layer) and, for int8/int4, quantized again.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from moetune.arch.detect import DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS, ExpertsLayout
from moetune.engine import EngineOptions, ExpertEngine, get_activation
from moetune.engine.formats import ExpertFormat, Fp8BlockExperts
from moetune.loading.checkpoint import Checkpoint, ShardReader, TensorInfo
from moetune.loading.expert_plan import ROLES, ExpertSource, LayerPlan
from moetune.loading.options import ExpertFormatChoice
from moetune.loading.progress import LayerProgress


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

    def put_fused(self, name: str, e: int, w: torch.Tensor, swapped: bool, interleaved: bool) -> None:
        """``w``: expert ``e``'s slice of fused tensor ``name`` as stored (``swapped``: last dims flipped;
        ``interleaved``: gate and up alternate along 2I)."""
        lay = self.layout
        if name in (GATE_UP, DOWN) and lay.transposed != swapped:
            w = w.t()  # stored x @ W: [H, 2I] / [I, H] -> [2I, H] / [H, I]
        if name in (GATE_UP, GATE_UP_BIAS) and interleaved:
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
    if source.expert is not None:
        buffers.put_per_expert(source.role, source.expert, reader.read(source.info))
        return
    for e in range(buffers.layout.num_experts):  # one expert at a time: no full-tensor temporary
        w = reader.read(source.info, e)
        if source.role in ROLES:  # one projection of every expert, stacked: expert e's [out, in]
            buffers.put_per_expert(source.role, e, w)
        else:
            buffers.put_fused(source.role, e, w, source.swapped, source.interleaved)


class _Tensors(Sequence[torch.Tensor]):
    """Checkpoint tensors read on indexing (converted to ``dtype`` if given), so a consumer walking them holds
    one at a time."""

    def __init__(
        self, infos: list[TensorInfo], reader: ShardReader, dtype: torch.dtype | None = None
    ) -> None:
        self.infos, self.reader, self.dtype = infos, reader, dtype

    def __len__(self) -> int:
        return len(self.infos)

    def __getitem__(self, i):  # type: ignore[override]  # int indices only: from_per_expert's use
        t = self.reader.read(self.infos[i])
        return t if self.dtype is None else t.to(self.dtype)


def read_fp8(layer: LayerPlan, reader: ShardReader) -> Fp8BlockExperts:
    """An FP8 checkpoint layer as stored: gate/up/down ``[out, in]`` e4m3fn per expert with their fp32 block
    scales, copied one matrix at a time into ``Fp8BlockExperts``' stacked tensors."""
    by_role: dict[str, list[ExpertSource]] = {role: [] for role in ROLES}
    for source in sorted(layer.sources, key=lambda s: (s.role, s.expert)):
        by_role[source.role].append(source)
    lists = {}
    for role, sources in by_role.items():
        lists[role] = _Tensors([s.info for s in sources], reader)
        scales = [s.scale for s in sources if s.scale is not None]
        lists[f"{role}_scale_inv"] = _Tensors(scales, reader, torch.float32)  # bf16/fp16 scales: exact
    return Fp8BlockExperts.from_per_expert(**lists)


def _copy(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype, copy=True)


def build_engine(
    layer: LayerPlan,
    reader: ShardReader,
    dtype: torch.dtype,
    options: EngineOptions,
    choice: ExpertFormatChoice,
    spare: _LayerBuffers | None = None,
) -> tuple[ExpertEngine, _LayerBuffers | None]:
    """The engine of one experts module in format ``choice``, read from ``reader``; dense weights and biases
    in ``dtype``. ``spare``: dense buffers a previous layer no longer needs, reused when their layout fits.

    Quantized formats are quantized from the checkpoint's own float precision (``LayerPlan.float_dtype``, as
    ``moetune convert`` does, so both give the same engines), or, for an FP8 layer, from its weights
    dequantized to ``dtype``. Returns the engine and the dense buffers the next layer may reuse (None when the
    engine holds them).
    """
    lay = layer.site.layout
    weights: ExpertFormat
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # per-expert checkpoints: none
    if layer.fp8:
        stored = read_fp8(layer, reader)
        weights = stored if choice.name == stored.name else choice.from_dense(*stored.dequantize(dtype))
    else:
        read_dtype = dtype if choice.keeps_input else layer.float_dtype
        fits = spare is not None and spare.layout == lay and spare.gate_up.dtype == read_dtype
        buffers = spare if spare is not None and fits else _LayerBuffers(lay, read_dtype)
        for source in layer.sources:
            _fill(buffers, source, reader)
        weights = choice.from_dense(buffers.gate_up, buffers.down)
        if choice.keeps_input:  # the engine holds the buffers, biases included
            biases, spare = (buffers.gate_up_bias, buffers.down_bias), None
        else:  # the buffers are reused for the next layer: the biases are copied out
            biases = (_copy(buffers.gate_up_bias, dtype), _copy(buffers.down_bias, dtype))
            spare = buffers
    engine = ExpertEngine(
        weights,
        activation=get_activation(lay.activation, **dict(lay.activation_kwargs)),
        gate_up_bias=biases[0],
        down_bias=biases[1],
        options=options,
        name=layer.site.path,
    )
    return engine, spare


def stream_experts(
    checkpoint: Checkpoint,
    layers: list[LayerPlan],
    formats: list[ExpertFormatChoice],
    dtype: torch.dtype,
    options: EngineOptions,
    *,
    progress: bool = True,
) -> Iterator[tuple[LayerPlan, ExpertEngine]]:
    """Yield ``(layer, engine)`` in plan order, layer ``j`` held in ``formats[j]``, each shard closed as soon as
    no later layer needs it.

    A tqdm bar counts layers and shows the read rate (checkpoint bytes per second).
    """
    total = sum(layer.nbytes for layer in layers)
    bar = LayerProgress(len(layers), total, "moetune: routed experts", progress)
    spare: _LayerBuffers | None = None
    with ShardReader(checkpoint, [layer.files for layer in layers]) as reader, bar:
        for step, (layer, choice) in enumerate(zip(layers, formats, strict=True)):
            engine, spare = build_engine(layer, reader, dtype, options, choice, spare)
            reader.done(step)
            bar.advance(layer.nbytes)
            yield layer, engine
