"""``expert_parallel: sharded`` from quantized checkpoints as shipped: a rank's engine holds exactly the bytes
(codes and scales, biases) of the whole engine's experts ``[r E/w, (r+1) E/w)``, and the rank read nothing else:
every read of the checkpoint is recorded, per-expert keys of other experts are never opened, fused tensors are
read only at the rank's slices, and the ranks' reads together are the whole load's, byte for byte.

FP8 128 x 128 blocks per expert (DeepSeek-V3; Kimi-K2-Instruct: sharded by decoder layer), compressed-tensors
INT4 per expert (Kimi-K2-Thinking; Kimi-K2.5, a composite config), MXFP4 fused with fused float biases
(gpt-oss); and a quantized layer held in another format than its own (dequantized and quantized again)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moetune.dist.shard import ExpertShard
from moetune.engine import ExpertEngine
from moetune.loading.checkpoint import ShardReader, TensorInfo
from moetune.loading.expert_plan import LayerPlan
from moetune.loading.load import PlannedLoad, plan_load, shard_slices
from moetune.loading.options import LoadOptions
from moetune.loading.stream import build_engine
from moetune.testing.fp8_checkpoint import save_fp8_checkpoint
from moetune.testing.kimi import save_kimi_instruct, save_kimi_thinking
from moetune.testing.kimi_k25 import save_kimi_k25
from moetune.testing.mxfp4_checkpoint import save_mxfp4_checkpoint

# checkpoint -> (builder, the engine format its experts are held in as shipped)
CHECKPOINTS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "deepseek_v3_fp8": (lambda p: save_fp8_checkpoint("deepseek_v3", p), "fp8_block"),
    "kimi_k2_instruct_fp8": (save_kimi_instruct, "fp8_block"),
    "kimi_k2_thinking_int4": (save_kimi_thinking, "int4"),
    "kimi_k25_int4": (save_kimi_k25, "int4"),
    "gpt_oss_mxfp4": (save_mxfp4_checkpoint, "mxfp4"),
}


class RecordingReader(ShardReader):
    """A ``ShardReader`` that records every read: ``(key, index, bytes)``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.reads: list[tuple[str, int | range | None, int]] = []

    def read(self, info: TensorInfo, index: int | range | None = None) -> torch.Tensor:
        out = super().read(info, index)
        self.reads.append((info.key, index, out.numel() * out.element_size()))
        return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes (exact comparison for every dtype, float8 and NaN included)."""
    return t.contiguous().view(torch.uint8)


def _load(planned: PlannedLoad, layer: LayerPlan, fmt, opts, experts: range | None):
    """One layer's engine (all experts, or ``experts``) and what was read for it."""
    with RecordingReader(planned.checkpoint, [layer.files]) as reader:
        engine, _ = build_engine(layer, reader, opts.dtype, opts.engine, fmt, None, experts)
    return engine, reader.reads


def _assert_reads_only(reads, layer: LayerPlan, held: range) -> None:
    """Every read is a part of an expert tensor of ``layer``: a per-expert one of an expert in ``held``, read
    whole, or a slice in ``held`` of a fused one."""
    expert_of = {t.key: s.expert for s in layer.sources for t in s.stored}
    assert reads
    for key, index, _ in reads:
        assert key in expert_of, f"{key} is not an expert tensor of {layer.site.path}"
        if expert_of[key] is not None:  # per expert: its key opened only by its owner
            assert expert_of[key] in held and index is None, (key, index, held)
        elif isinstance(index, int):
            assert index in held, (key, index, held)
        else:
            assert isinstance(index, range) and index == held, (key, index, held)


def _assert_holds_slice(mine: ExpertEngine, whole: ExpertEngine, held: range, fmt: str) -> None:
    assert mine.weights.name == whole.weights.name == fmt
    assert mine.num_experts == len(held)
    got, want = mine.weights.state_tensors(), whole.weights.state_tensors()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(_bytes(got[name]), _bytes(want[name][held.start : held.stop])), name
    assert mine.weights.params() == whole.weights.params()
    for bias in ("gate_up_bias", "down_bias"):
        b, full = getattr(mine, bias), getattr(whole, bias)
        assert (b is None) == (full is None), bias
        if full is not None:
            assert torch.equal(_bytes(b), _bytes(full[held.start : held.stop])), bias


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("quantized")
    return {name: build(root / name) for name, (build, _) in CHECKPOINTS.items()}


@pytest.mark.parametrize("name", list(CHECKPOINTS))
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_reads_and_holds_only_its_experts(checkpoints, name, world) -> None:
    opts = LoadOptions.create(device="cpu", dtype="float32", progress=False)
    planned = plan_load(checkpoints[name], opts)
    native = CHECKPOINTS[name][1]
    assert planned.plan.layers and all(layer.method is not None for layer in planned.plan.layers)
    shares = [shard_slices(ExpertShard(r, world, None), planned) for r in range(world)]  # no longer refused
    for j, (layer, fmt) in enumerate(zip(planned.plan.layers, planned.formats)):
        e = layer.site.layout.num_experts
        whole, whole_reads = _load(planned, layer, fmt, opts, None)
        assert whole.num_experts == e and fmt.name == native
        read_by_ranks = 0
        for r, share in enumerate(shares):
            assert share is not None
            held = share[j]
            assert held == range(r * e // world, (r + 1) * e // world)
            mine, reads = _load(planned, layer, fmt, opts, held)
            _assert_reads_only(reads, layer, held)
            _assert_holds_slice(mine, whole, held, native)
            assert mine.weights.nbytes * world == whole.weights.nbytes
            read = sum(n for *_, n in reads)
            assert read == layer.read_nbytes(held)  # what the progress bar and the load's log count
            assert read * world == sum(n for *_, n in whole_reads)  # experts of equal size: a share each
            read_by_ranks += read
        # together the ranks read what one process reads, and that is every expert tensor's bytes
        assert read_by_ranks == sum(n for *_, n in whole_reads) == layer.nbytes


@pytest.mark.parametrize(
    ("name", "expert_format"),
    [("deepseek_v3_fp8", "bf16"), ("kimi_k2_thinking_int4", "int8"), ("gpt_oss_mxfp4", "fp8")],
)
def test_a_share_held_in_another_format(checkpoints, name, expert_format) -> None:
    # the share dequantized and, for int8/fp8, quantized again: the whole engine's experts, per expert
    opts = LoadOptions.create(device="cpu", dtype="float32", progress=False, expert_format=expert_format)
    planned = plan_load(checkpoints[name], opts)
    layer, fmt = planned.plan.layers[0], planned.formats[0]
    whole, _ = _load(planned, layer, fmt, opts, None)
    e = layer.site.layout.num_experts
    held = range(e // 2, e)
    mine, reads = _load(planned, layer, fmt, opts, held)
    _assert_reads_only(reads, layer, held)
    _assert_holds_slice(mine, whole, held, whole.weights.name)
