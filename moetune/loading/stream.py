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
* a quantized checkpoint's layer: read by its method (``loading.quant``) one expert matrix or slice at a
  time into the format it is held in as stored (FP8: its e4m3 bytes and block scales into
  ``Fp8BlockExperts``; compressed-tensors INT4: its codes and bf16 scales into ``Int4Experts``; MXFP4: its
  blocks and scale bytes into ``Mxfp4Experts``), no float round trip, its fused biases (gpt-oss) read in the
  load dtype; for another format that layer is dequantized (``dequantize``, one layer) and, for
  int8/int4/fp8, quantized again.

Under ``expert_parallel: sharded`` a rank asks for its experts only (``experts``): in every layout and every
format above, the other experts' per-expert tensors (codes and scales alike) are never read, fused and stacked
tensors are read at its experts' slices only, and the engine holds its ``E / world`` experts.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from moetune.arch.detect import DOWN, DOWN_BIAS, GATE_UP, GATE_UP_BIAS, UP, ExpertsLayout
from moetune.engine import EngineOptions, ExpertEngine, get_activation
from moetune.engine.formats import DenseExperts, ExpertFormat
from moetune.errors import NonFiniteError
from moetune.loading.checkpoint import Checkpoint, ShardReader
from moetune.loading.expert_plan import ExpertSource, LayerPlan
from moetune.loading.options import ExpertFormatChoice
from moetune.loading.quant import QuantizedWeight
from moetune.loading.quant.base import ROLES
from moetune.loading.scan import check_finite_layer, damaged_quantized
from moetune.progress import LayerProgress


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """``[2I, ...]`` with gate at even and up at odd rows -> gate rows then up rows."""
    return torch.cat((t[0::2], t[1::2]))


def _dense_weights(
    layout: ExpertsLayout, dtype: torch.dtype, experts: int, engine_layout: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` for ``experts`` experts: where the engine will
    hold them (``engine_layout``: dense format), their rows as ``DenseExperts.empty`` lays them out (maybe padded);
    else contiguous (quantized from)."""
    i, h = layout.intermediate_size, layout.hidden_size
    if engine_layout:
        return DenseExperts.empty(experts, i, h, dtype)
    return torch.empty(experts, 2 * i, h, dtype=dtype), torch.empty(experts, h, i, dtype=dtype)


class _LayerBuffers:
    """One layer's engine tensors, filled slice by slice: those of ``experts`` (global ids; default every
    expert of the layer), the first of them at index 0. ``engine_layout``: the engine will hold them
    (``_dense_weights``); else they are quantized from, then reused for the next layer."""

    def __init__(
        self,
        layout: ExpertsLayout,
        dtype: torch.dtype,
        experts: range | None = None,
        engine_layout: bool = False,
    ) -> None:
        self.experts = range(layout.num_experts) if experts is None else experts
        e, h, i = len(self.experts), layout.hidden_size, layout.intermediate_size
        self.layout = layout
        self.gate_up, self.down = _dense_weights(layout, dtype, e, engine_layout)  # [E, 2I, H], [E, H, I]
        self.gate_up_bias = torch.empty(e, 2 * i, dtype=dtype) if layout.has_bias else None  # [E, 2I]
        self.down_bias = torch.empty(e, h, dtype=dtype) if layout.has_bias else None  # [E, H]

    def put_per_expert(self, role: str, e: int, w: torch.Tensor) -> None:
        """``w`` is expert ``e``'s ``[out, in]`` matrix: gate/up ``[I, H]``, down ``[H, I]``. Non-gated experts'
        up rows fill the gate rows too (``ExpertsLayout.gated``: act(u) = f(u) * u on tied rows)."""
        i = self.layout.intermediate_size
        e -= self.experts.start
        if role == "up" and not self.layout.gated:
            self.gate_up[e, :i].copy_(w)
        dst = {"gate": self.gate_up[e, :i], "up": self.gate_up[e, i:], "down": self.down[e]}[role]
        dst.copy_(w)

    def put_fused(self, name: str, e: int, w: torch.Tensor, swapped: bool, interleaved: bool) -> None:
        """``w``: expert ``e``'s slice of fused tensor ``name`` as stored (``swapped``: last dims flipped;
        ``interleaved``: gate and up alternate along 2I)."""
        lay = self.layout
        if name in (GATE_UP, UP, DOWN) and lay.transposed != swapped:
            w = w.t()  # stored x @ W: [H, 2I] / [I, H] -> [2I, H] / [H, I]
        if name == UP:  # a non-gated expert's [I, H]
            self.put_per_expert("up", e, w)
            return
        if name in (GATE_UP, GATE_UP_BIAS) and interleaved:
            w = _deinterleave(w)
        dst = {
            GATE_UP: self.gate_up,
            DOWN: self.down,
            GATE_UP_BIAS: self.gate_up_bias,
            DOWN_BIAS: self.down_bias,
        }[name]
        assert dst is not None
        dst[e - self.experts.start].copy_(w)


def _fill(buffers: _LayerBuffers, source: ExpertSource, reader: ShardReader) -> None:
    if source.expert is not None:
        if source.expert in buffers.experts:  # another rank's expert (sharded) is not read at all
            buffers.put_per_expert(source.role, source.expert, reader.read(source.info))
        return
    for e in buffers.experts:  # one expert at a time: no full-tensor temporary
        w = reader.read(source.info, e)
        if (
            source.role in ROLES
        ):  # one projection of every expert, stacked: expert e's [out, in] ([in, out] swapped)
            buffers.put_per_expert(source.role, e, w.t() if source.swapped else w)
        else:
            buffers.put_fused(source.role, e, w, source.swapped, source.interleaved)


def read_quantized(layer: LayerPlan, reader: ShardReader, experts: range) -> ExpertFormat:
    """Experts ``experts`` (global ids, consecutive) of a quantized layer as stored, in its method's native
    format (``QuantMethod.read_experts``: its weights by role, per-expert ones of ``experts`` only, in expert
    order; fused ones whole, of which the method reads ``experts``' slices)."""
    assert layer.method is not None, "a quantized layer carries its method"
    by_role: dict[str, list[QuantizedWeight]] = {}
    for source in sorted(layer.sources, key=lambda s: (s.role, -1 if s.expert is None else s.expert)):
        if source.quantized is not None and (source.expert is None or source.expert in experts):
            by_role.setdefault(source.role, []).append(source.quantized)
    assert all(len(by_role[r]) == len(experts) for r in ROLES if r in by_role), "one weight per expert"
    try:
        return layer.method.read_experts(by_role, layer.site.layout, reader, experts)
    except NonFiniteError as err:
        # the format's codes or scales stand for NaN / Inf: name the layer and the files they came from
        raise damaged_quantized(layer, experts, err) from None


def read_biases(
    layer: LayerPlan, reader: ShardReader, dtype: torch.dtype, experts: range
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A quantized layer's fused float biases of ``experts`` (their rows only): gate_up ``[e, 2I]`` (gate
    columns first) and down ``[e, H]`` in ``dtype``, ``e = len(experts)``; None where the checkpoint has none
    (per-expert layers)."""
    out: dict[str, torch.Tensor] = {}
    for source in layer.sources:
        if source.role in (GATE_UP_BIAS, DOWN_BIAS):
            t = reader.read(source.info, experts).to(dtype)  # [e, 2I] / [e, H]: small, one read
            if source.role == GATE_UP_BIAS and layer.site.layout.interleaved:
                t = torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)
            out[source.role] = t
    return out.get(GATE_UP_BIAS), out.get(DOWN_BIAS)


def _copy(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    return None if t is None else t.to(dtype, copy=True)


def build_engine(
    layer: LayerPlan,
    reader: ShardReader,
    dtype: torch.dtype,
    options: EngineOptions,
    choice: ExpertFormatChoice,
    spare: _LayerBuffers | None = None,
    experts: range | None = None,
) -> tuple[ExpertEngine, _LayerBuffers | None]:
    """The engine of one experts module in format ``choice``, read from ``reader``; dense weights and biases
    in ``dtype``. ``spare``: dense buffers a previous layer no longer needs, reused when their layout fits.
    ``experts``: read and hold only these experts (global ids, consecutive; ``expert_parallel: sharded``), the
    engine's expert 0 being the first of them; the other experts' per-expert tensors are never read, and fused
    or stacked tensors only at these experts' slices (float and quantized checkpoints alike).

    Quantized formats are quantized from the checkpoint's own float precision (``LayerPlan.float_dtype``, as
    ``moetune convert`` does, so both give the same engines), or, for a quantized layer held in another
    format than its own, from its weights dequantized to ``dtype``. Returns the engine and the dense buffers
    the next layer may reuse (None when the engine holds them).
    """
    lay = layer.site.layout
    held = range(lay.num_experts) if experts is None else experts
    weights: ExpertFormat
    biases: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # per-expert checkpoints: none
    stored: ExpertFormat | None = None
    if layer.method is not None:
        stored = read_quantized(layer, reader, held)
        biases = read_biases(layer, reader, dtype, held)
        read = {**stored.state_tensors(), "gate_up_bias": biases[0], "down_bias": biases[1]}
    else:
        read_dtype = dtype if choice.keeps_input else layer.float_dtype
        fits = (
            spare is not None
            and spare.layout == lay
            and spare.gate_up.dtype == read_dtype
            and spare.experts == held
        )
        buffers = (
            spare if spare is not None and fits else _LayerBuffers(lay, read_dtype, held, choice.keeps_input)
        )
        for source in layer.sources:
            _fill(buffers, source, reader)
        read = {
            "gate_up": buffers.gate_up,
            "down": buffers.down,
            "gate_up_bias": buffers.gate_up_bias,
            "down_bias": buffers.down_bias,
        }
    # as read, before any quantization can hide a NaN
    check_finite_layer(layer, read, held.start)
    if stored is not None and layer.method is not None:
        if choice == layer.method.native:
            weights = stored
        else:  # dense: dequantized straight into the layout the engine holds
            out = _dense_weights(lay, dtype, len(held), choice.keeps_input)
            weights = choice.from_dense(*stored.dequantize(dtype, out))
    else:
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
    experts: list[range] | None = None,
) -> Iterator[tuple[LayerPlan, ExpertEngine]]:
    """Yield ``(layer, engine)`` in plan order, layer ``j`` held in ``formats[j]``, each shard closed as soon as
    no later layer needs it. ``experts[j]``: the experts of layer ``j`` to read and hold (``build_engine``);
    None: every expert.

    A tqdm bar counts layers and shows the read rate (checkpoint bytes per second).
    """
    total = sum(layer.read_nbytes(None if experts is None else experts[j]) for j, layer in enumerate(layers))
    bar = LayerProgress(len(layers), total, "moetune: routed experts", progress)
    spare: _LayerBuffers | None = None
    with ShardReader(checkpoint, [layer.files for layer in layers]) as reader, bar:
        for step, (layer, choice) in enumerate(zip(layers, formats, strict=True)):
            mine = None if experts is None else experts[step]
            engine, spare = build_engine(layer, reader, dtype, options, choice, spare, mine)
            reader.done(step)
            bar.advance(layer.read_nbytes(mine))
            yield layer, engine
