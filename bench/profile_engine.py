"""Where one engine step's time goes: torch.profiler over forward + backward, grouped into categories.

    python bench/profile_engine.py [--experts 32 --tokens 128 512 2048 --threads 1 --modes lora frozen]
                                   [--format bf16|int8|int4|fp8_block|mxfp4]

The layer is the engine benchmark's (Qwen3-30B-A3B: H = 2048, I = 768, k = 8, r = 8, bf16 weights, retain
policy), with ``--experts`` experts to fit the time; ``--format`` stores them quantized (from the bf16 weights,
each format's ``from_dense``) and prints the engine's GEMM path. Per (T, mode): the unprofiled median of 3
steps, the profiled step's wall time, and its split: the fused kernels (the compiled products of
``moetune.engine.kernels``, recorded by their entry points as ``moetune::<kernel>``; their own time, without the
torch ops they call), base GEMMs, LoRA GEMMs (an operand of width r), the
combine's bmm, elementwise ops (activation, its backward, weighting, the router's row dots, scales), copies /
gathers / fills / dtype conversions (weight codes included), the bit operations that unpack quantized codes,
other aten ops, and the gap (wall time no op accounts for: Python and dispatch); also the number of torch ops the
step called (views included: a count that machine load does not change). ``docs/performance.md`` holds a run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from moetune.bench.runners import (
    RUNNERS,
    BenchBatch,
    BenchWeights,
    EngineStep,
    Step,
    make_batch,
    make_weights,
)
from moetune.engine import EngineOptions, ExpertEngine, TrainMode
from moetune.engine.formats import FORMATS
from moetune.sysinfo import cpu_info

GEMMS = {"aten::mm", "aten::addmm_", "aten::addmm", "aten::bmm"}
ELEMENTWISE = {
    "aten::mul",
    "aten::mul_",
    "aten::silu",
    "aten::silu_backward",
    "aten::sum",
    "aten::add_",
    "aten::div_",
    "aten::addcmul_",
    "aten::sub_",
}
BIT_OPS = {"aten::bitwise_and", "aten::bitwise_right_shift", "aten::bitwise_left_shift", "aten::bitwise_and_"}
COPIES = {
    "aten::copy_",
    "aten::_to_copy",
    "aten::index_select",
    "aten::fill_",
    "aten::zero_",
    "aten::index_add_",
}


def category(name: str, shapes: str, rank: int) -> str:
    if name.startswith("moetune::"):  # the compiled kernels' entry points (kernels/entry.h's MOETUNE_ENTRY)
        return "fused kernels"
    if name in GEMMS:
        if name == "aten::bmm":
            return "combine bmm"
        return "lora gemm" if f", {rank}]" in shapes or f"[{rank}," in shapes else "base gemm"
    if name in ELEMENTWISE:
        return "elementwise"
    if name in BIT_OPS or name.startswith("aten::bitwise_left_shift"):
        return "unpack (bit ops)"
    return "copies/gathers/fills" if name in COPIES else "other aten"


def make_step(
    weights: BenchWeights, batch: BenchBatch, mode: TrainMode, options: EngineOptions, fmt: str
) -> Step:
    """The engine benchmark's step on bf16 weights, or on them stored in ``fmt`` (its path printed)."""
    if fmt == "bf16":
        return RUNNERS.get("engine")(weights, batch, mode, options)
    stored = FORMATS.get(fmt).from_dense(weights.gate_up.float(), weights.down.float())
    engine = ExpertEngine(stored, lora=weights.lora if mode is TrainMode.LORA else None, options=options)
    print(f"    {fmt}: {engine.gemm.path.describe()}")
    return EngineStep(engine, batch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--modes", nargs="+", choices=["lora", "frozen"], default=["lora", "frozen"])
    p.add_argument("--expert-workers", type=int, help="EngineOptions.expert_workers (default: the engine's)")
    p.add_argument(
        "--format", default="bf16", choices=["bf16", *(n for n in FORMATS.names() if n != "dense")]
    )
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    h, i, k, r = 2048, 768, 8, 8
    cpu = cpu_info()
    print(
        f"{cpu.model} ({', '.join(cpu.isa)}), {args.threads} threads, E={args.experts} H={h} I={i} k={k} r={r}"
    )
    weights = make_weights(args.experts, h, i, r, 16, torch.bfloat16, 0)
    options = EngineOptions(expert_workers=args.expert_workers)
    for t in args.tokens:
        batch = make_batch(t, args.experts, k, h, torch.bfloat16, t)
        for mode in (TrainMode(m) for m in args.modes):
            step = make_step(weights, batch, mode, options, args.format)
            step.backward(step.forward())
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                step.backward(step.forward())
                times.append(time.perf_counter() - t0)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                t0 = time.perf_counter()
                step.backward(step.forward())
                wall = (time.perf_counter() - t0) * 1e3
            split: dict[str, float] = {}
            calls = 0
            for ev in prof.key_averages(group_by_input_shape=True):
                c = category(ev.key, str(ev.input_shapes), r)
                split[c] = split.get(c, 0.0) + ev.self_cpu_time_total / 1e3
                calls += ev.count
            split["gap (Python, dispatch)"] = wall - sum(split.values())
            print(
                f"T={t} {mode.value}: median {statistics.median(times) * 1e3:.1f} ms, profiled {wall:.1f} ms, "
                f"{calls} torch ops (views included)"
            )
            for c, ms in sorted(split.items(), key=lambda kv: -kv[1]):
                print(f"    {c:26} {ms:8.1f} ms {ms / wall:6.1%}")


if __name__ == "__main__":
    main()
