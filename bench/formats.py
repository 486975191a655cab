"""Expert engine forward+backward per weight format, measured side by side in one run.

    python bench/formats.py [--experts 16 --hidden 2048 --inter 768 --tokens 128 2048 --top-k 8 --rank 8 --reps 5]
                      [--formats int8 int4-g64 ...] [--fused-max-rows N]
                      [--compute-dtype float32] [--variant AVX2]

One fp32 Gaussian layer is stored as bf16 (the baseline; in the layout the loader fills, ``DenseExperts.empty``), int8, int4 (group 64, symmetric), fp8_block, mxfp4
(gpt-oss's shipped format; H and I must be multiples of 32) and compressed-int4: int4 as a compressed-tensors
INT4 checkpoint (Kimi-K2-Thinking) loads, i.e. each expert matrix quantized the way compressed-tensors does
it (groups of 32, scale max|w| / 7.5, codes -8..7), packed as its int32 words, then re-packed into int4's
nibble order by the checkpoint loader's own path (the time that takes, the load cost per layer, is printed
too). int8-a8 is int8 with ``int8_activations`` (the kernels round the activations to 8-bit integer rows; its
torch path is int8's, not run twice), int4-g64-a8 int4 g64 with it; where this CPU has no kernels for them (int8-a8
without AVX512-BF16) they are skipped with the engine's reason, unless named in ``--formats`` (then the run stops
with it).
Formats with a fused kernel in use on this machine (``moetune.engine.kernels``: int8, int4, fp8_block and
mxfp4 on AMX-BF16 or AVX512-BF16 CPUs) run twice, as themselves and as ``<label> torch`` with the kernels off
(the torch path, pinned per engine), and a line per format gives the fused / torch CPU-time ratio.
``--compute-dtype`` sets the engines' compute dtype (default: this CPU's, ``resolve_compute_dtype``) and
``--variant`` names the kernel variant to run (default: the one that loads here), built by name whatever the CPU
prefers: ``--compute-dtype float32 --variant AVX2`` measures the AVX2 variant on an AVX512 machine.
Each rep runs every format once, in turn, so machine noise falls on all of them alike. Printed per format
(first its GEMM path on this CPU, ``moetune.engine.gemm.GemmPath``), per token count: resident bytes per
parameter, relative Frobenius error of the dequantized weights, the time the engine's path takes to convert
every expert's two matrices once for experts of T*k/E rows (CPU ms) (what one pass adds over weights stored in the
compute dtype; a step converts twice, forward and backward), fwd+bwd ms with expert LoRA trained (wall-clock
min and median over reps, and process CPU time min), and throughput relative to bf16 (bf16 ms / format ms,
from the minima: the least disturbed runs). On a machine shared with other jobs, CPU time with
``--threads 1`` is the steadier measure: time spent descheduled does not count.
Every engine keeps its workspaces while the others run, so the memory a run needs grows with the formats and T: after
the first engine's warm-up at each token count, the run stops, saying how much the rest would need against what is
available, where that exceeds 90% of it (``room_for_the_rest``), rather than meet the out-of-memory kill.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import psutil
import torch

from moetune.bench.weight_formats import FORMAT_BUILDS, LABEL_OPTIONS, label_refused, room_for_the_rest
from moetune.engine import EngineOptions, ExpertEngine, ExpertLoRA
from moetune.engine.formats.base import Projection
from moetune.engine.gemm import resolve_gemm_path
from moetune.engine.kernels import VARIANTS, fused_unavailable
from moetune.engine.plan import resolve_compute_dtype
from moetune.engine.threads import set_engine_threads
from moetune.sysinfo import cpu_info

PROJS: tuple[Projection, ...] = ("gate_up", "down")


def timed(fn: Callable[[], object]) -> float:
    """Process CPU milliseconds ``fn()`` takes (time descheduled does not count)."""
    t0 = time.process_time()
    fn()
    return (time.process_time() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--formats",
        nargs="+",
        choices=list(FORMAT_BUILDS),
        default=None,
        help="bf16 always runs (default: every label; an -a8 label this CPU has no kernels for is skipped, "
        "with the reason, unless named)",
    )
    ap.add_argument(
        "--fused-max-rows",
        type=int,
        default=None,
        help="experts with at most this many rows take the fused kernels, for every format that has one here "
        "(default: each format's FUSED_MAX_ROWS for this CPU's variant); for crossover sweeps",
    )
    ap.add_argument("--compute-dtype", choices=["bfloat16", "float32"], default=None)
    ap.add_argument(
        "--variant",
        choices=[v.name for v in VARIANTS],
        default=None,
        help="the kernel variant the formats with a fused kernel run on (it must compute in the compute dtype)",
    )
    args = ap.parse_args()
    options = EngineOptions(compute_dtype=getattr(torch, args.compute_dtype) if args.compute_dtype else None)
    e, h, i, k = args.experts, args.hidden, args.inter, args.top_k
    threads = set_engine_threads(args.threads)  # every format on the same threads

    # labels whose options this CPU's engine would refuse, asked before any weights are built: named, the run stops;
    # by default they are skipped, with the reason
    named = args.formats is not None
    machine = cpu_info()
    compute = resolve_compute_dtype(torch.int8, options.compute_dtype)  # every quantized format's
    skipped: dict[str, str] = {}  # label -> why
    for label in args.formats if named else FORMAT_BUILDS:
        why = label_refused(label, compute, tuple(machine.isa))
        if why and named:
            raise SystemExit(f"bench/formats.py: --formats {label}: {why}")
        if why:
            skipped[label] = why

    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
    down = torch.randn(e, h, i, generator=gen) / i**0.5
    lora = ExpertLoRA.init(e, h, i, args.rank, alpha=2.0 * args.rank, generator=gen)
    lora.gate_up_B.normal_(generator=gen)
    lora.down_B.normal_(generator=gen)

    engines: dict[str, ExpertEngine] = {}
    info: dict[str, tuple[float, float]] = {}  # bytes per parameter, weight error
    for label, (build, src_dtype) in FORMAT_BUILDS.items():
        if (label != "bf16" and named and label not in args.formats) or label in skipped:
            continue
        fmt = build(gate_up.to(src_dtype), down.to(src_dtype))
        gq, dq = fmt.dequantize(torch.float32)
        err = float(torch.cat([(gq - gate_up).flatten(), (dq - down).flatten()]).norm())
        err /= float(torch.cat([gate_up.flatten(), down.flatten()]).norm())
        del gq, dq
        info[label] = (fmt.bytes_per_param, err)
        own = LABEL_OPTIONS.get(label, {})
        engines[label] = ExpertEngine(fmt, lora=lora, options=replace(options, **own))
        path = engines[label].gemm.path
        if args.variant is not None and fmt.FUSED_MAX_ROWS:  # the named variant, built by name
            rows = fmt.FUSED_MAX_ROWS.get(args.variant, 0)
            path = replace(path, fused_rows=rows, fused_variant=args.variant if rows else "")
            engines[label].gemm.path = path
        if path.fused_rows and args.fused_max_rows is not None:
            engines[label].gemm.path = replace(path, fused_rows=args.fused_max_rows)
        if (
            engines[label].gemm.path.fused_rows and not own
        ):  # the same weights on the torch path, side by side
            torch_label = f"{label} torch"
            engines[torch_label] = ExpertEngine(fmt, lora=lora, options=options)
            engines[torch_label].gemm.path = resolve_gemm_path(fmt, engines[label].compute_dtype, fused=False)
            info[torch_label] = info[label]

    first = next(iter(engines.values()))
    print(f"bench/formats.py | {machine.model} ({', '.join(machine.isa) or 'no SIMD flags found'})")
    print(
        f"E={e} H={h} I={i} k={k} r={args.rank} threads={threads} compute={first.compute_dtype} reps={args.reps}"
    )
    for label, engine in engines.items():
        print(f"  {label}: {engine.gemm.path.describe()}")
    for label, why in skipped.items():
        print(f"  {label}: skipped ({why})")
    why = fused_unavailable()
    print(
        f"fused kernels: {'not used (' + why + ')' if why else 'used (rows labelled torch: the same weights without)'}"
    )
    for t in args.tokens:
        bench_tokens(engines, info, t, e, h, k, args.reps, gen)


def bench_tokens(
    engines: dict[str, ExpertEngine],
    info: dict[str, tuple[float, float]],
    t: int,
    e: int,
    h: int,
    k: int,
    reps: int,
    gen: torch.Generator,
) -> None:
    """One table: every engine's forward+backward at T = ``t`` tokens, side by side."""
    x = torch.randn(t, h, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, k] distinct experts
    w = torch.softmax(torch.randn(t, k, generator=gen), dim=1)
    gy = torch.randn(t, h, generator=gen)
    rows = max(1, t * k // e)  # rows per expert, on average

    def convert_all(engine: ExpertEngine) -> None:  # the engine's own conversions for one pass
        for x_ in range(e):
            for p in PROJS:
                for _ in engine.gemm.row_blocks(p, x_, rows):
                    pass

    convert: dict[str, float | None] = {}  # None: the fused kernels (no converted tiles)
    for label, engine in engines.items():
        if rows <= engine.gemm.path.fused_rows:
            convert[label] = None
            continue
        convert_all(engine)
        convert[label] = min(timed(lambda engine=engine: convert_all(engine)) for _ in range(3))

    def step(engine: ExpertEngine) -> None:
        _, saved = engine.forward(x, ids, w)
        engine.backward(saved, gy)

    # warm-up: workspaces grow to size, MKL picks its kernels; the first engine's growth says whether the rest fit
    me = psutil.Process()
    before = me.memory_info().rss
    for n, engine in enumerate(engines.values()):
        step(engine)
        if n == 0:
            room_for_the_rest(t, me.memory_info().rss - before, len(engines) - 1)
    wall: dict[str, list[float]] = {label: [] for label in engines}
    cpu: dict[str, list[float]] = {label: [] for label in engines}
    for _ in range(reps):
        for label, engine in engines.items():
            w0, c0 = time.perf_counter(), time.process_time()
            step(engine)
            wall[label].append((time.perf_counter() - w0) * 1e3)
            cpu[label].append((time.process_time() - c0) * 1e3)

    print(f"T={t} ({rows} rows per expert)")
    print(
        f"{'format':<21} {'B/param':>8} {'w err':>7} {'convert cpu':>11} {'wall min':>9} {'median':>8} "
        f"{'cpu min':>8} {'vs bf16 wall':>13} {'cpu':>6}"
    )
    for label in engines:
        bpp, err = info[label]
        ratio_wall = min(wall["bf16"]) / min(wall[label])
        ratio_cpu = min(cpu["bf16"]) / min(cpu[label])
        conv = convert[label]
        print(
            f"{label:<21} {bpp:>8.3f} {err:>7.2%} {'fused' if conv is None else f'{conv:.1f}':>11} {min(wall[label]):>9.1f} "
            f"{statistics.median(wall[label]):>8.1f} {min(cpu[label]):>8.1f} {ratio_wall:>12.2f}x {ratio_cpu:>5.2f}x"
        )
    for label in engines:  # the fused kernels against the torch path on the same weights
        if f"{label} torch" in engines:
            fused_cpu = min(cpu[f"{label} torch"]) / min(cpu[label])
            print(f"{label}: fused kernels / torch path, CPU time: {fused_cpu:.2f}x")


if __name__ == "__main__":
    main()
