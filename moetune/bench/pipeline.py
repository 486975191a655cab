"""The CPU/device schedule of MoE layers, proven on the CPU with a simulated device: how much device time hides
behind the CPU's expert work. ``bench/pipeline.py`` runs :func:`main`.

Per MoE layer the device (a GPU; here the simulated one of ``moetune.bench.schedule``) computes attention and
the router (``pre``), copies the experts' inputs to the host (``d2h``), computes the shared experts
(``shared``) and, after the CPU engine, copies the result back (``h2d``); the CPU computes the routed experts
with the real ``ExpertEngine`` on this machine (forward, then backward in reverse layer order, LoRA trained).
Device durations are modelled (``DeviceModel``: FLOPs at a throughput plus a launch cost per task, bytes at a
link bandwidth), since no device is here; pass the numbers of yours. Backward reuses the layer's structure:
the gradient from the layer above (attention backward, twice the forward FLOPs) arrives, the shared experts'
backward runs beside the engine's, grad x goes back.

Schedules (registered in ``SCHEDULES``):

- ``serial``: the block's own order without moetune's overlap: the engine, then the shared experts.
- ``shared-ahead``: what moetune does today (``moetune.layer.overlap``): the shared experts are queued on the
  device right after the input copies, so they run while the CPU computes the routed experts.
- ``two-halves``: each micro-batch split in two halves pipelined through the layers: the device computes
  half B's attention (and half A's shared experts, then the next layer's attention of half A) while the CPU
  computes half A's experts. Not built in moetune; measured here to size the gap. Attention cost is split
  evenly between the halves (causal attention makes half B dearer; the model ignores that).

Printed per schedule: wall time of forward + backward over the layers, CPU and device busy time, the hidden
fraction (device busy time during which the CPU was busy too), and speed relative to ``serial``. Also, for
``two-halves``' correctness: whether the engine on the two halves gives bit-identical float32 results
(outputs and every gradient) to the engine on the whole batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from moetune.bench.runners import BenchBatch, make_batch, make_weights
from moetune.bench.schedule import Task, Timeline, replay, run_schedule
from moetune.engine import DenseExperts, ExpertEngine, SavedForward
from moetune.errors import ConfigError
from moetune.registry import Registry
from moetune.sysinfo import cpu_info, default_num_threads


@dataclass(frozen=True)
class PipelineShape:
    """The layers: ``T`` tokens per micro-batch, attention of ``heads`` x ``head_dim`` (grouped KV), one shared
    expert of ``shared_intermediate`` (0: none), routed experts ``E`` x ``I``, top-``k``, LoRA rank ``r``."""

    layers: int = 4
    tokens: int = 512
    hidden: int = 1024
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 128
    experts: int = 32
    intermediate: int = 512
    shared_intermediate: int = 1024
    top_k: int = 8
    rank: int = 8

    def validate(self) -> None:
        bad = [f"{k}={v}" for k, v in vars(self).items() if v < (0 if k == "shared_intermediate" else 1)]
        if self.top_k > self.experts:
            bad.append(f"top_k={self.top_k} > experts={self.experts}")
        if self.tokens % 2:
            bad.append(f"tokens={self.tokens} (must be even: two-halves splits it)")
        if bad:
            raise ConfigError(
                f"pipeline benchmark: {', '.join(bad)}; sizes must be >= 1 (shared_intermediate >= 0)"
            )


@dataclass(frozen=True)
class DeviceModel:
    """How long device work takes: ``flops`` at ``tflops``, copies at ``link_gbs``, plus ``launch_us`` per task.
    The defaults are a deliberately modest GPU (a few small kernels per task run far below peak)."""

    tflops: float = 50.0
    link_gbs: float = 20.0  # one direction of a PCIe 4.0 x16 link, pinned memory
    launch_us: float = 20.0

    def compute_s(self, flops: float) -> float:
        return flops / (self.tflops * 1e12) + self.launch_us * 1e-6

    def copy_s(self, nbytes: float) -> float:
        return nbytes / (self.link_gbs * 1e9) + self.launch_us * 1e-6


@dataclass(frozen=True)
class LayerCosts:
    """Modelled device seconds of one layer's parts for ``T`` tokens, forward (backward: ``BWD_FACTOR`` x)."""

    pre: float  # attention + router
    d2h: float  # x [T, H], ids [T, k], weights [T, k]
    shared: float
    h2d: float  # y [T, H]

    def scaled(self, factor: float) -> LayerCosts:
        return LayerCosts(self.pre * factor, self.d2h * factor, self.shared * factor, self.h2d * factor)


BWD_FACTOR = 2.0  # backward of a matmul is two matmuls of the forward's size


def layer_costs(shape: PipelineShape, tokens: int, device: DeviceModel, elem_bytes: int) -> LayerCosts:
    """The device's forward work of one layer on ``tokens`` tokens."""
    s, t, h = shape, tokens, shape.hidden
    proj = 2 * t * h * (2 * s.heads + 2 * s.kv_heads) * s.head_dim  # q, o and k, v projections
    scores = 2 * 2 * t * t * s.heads * s.head_dim // 2  # QK^T and PV, causal: half the pairs
    router = 2 * t * h * s.experts
    shared = 2 * t * 3 * h * s.shared_intermediate
    return LayerCosts(
        pre=device.compute_s(proj + scores + router),
        d2h=device.copy_s(t * h * elem_bytes + t * s.top_k * (8 + elem_bytes)),
        shared=device.compute_s(shared) if s.shared_intermediate else 0.0,
        h2d=device.copy_s(t * h * elem_bytes),
    )


CpuCall = Callable[[int, int], Callable[[], None]]
"""(layer, part) -> the CPU task body that runs the engine on that part of the micro-batch."""

Builder = Callable[[int, LayerCosts, CpuCall, str], tuple[list[Task], list[Task]]]
"""(layers, costs of one part, cpu_call, pass tag) -> (cpu tasks, device tasks) of one pass."""

SCHEDULES: Registry[Builder] = Registry("pipeline schedule")
PARTS = {"serial": 1, "shared-ahead": 1, "two-halves": 2}  # parts each micro-batch is split into


def _dev(name: str, seconds: float, *deps: str) -> Task:
    return Task(name, deps=tuple(deps), seconds=seconds)


def _whole(
    layers: int, c: LayerCosts, cpu_call: CpuCall, tag: str, ahead: bool
) -> tuple[list[Task], list[Task]]:
    cpu: list[Task] = []
    dev: list[Task] = []
    for layer in range(layers):
        n = f"{tag}{layer}"
        dev += [_dev(f"pre{n}", c.pre), _dev(f"d2h{n}", c.d2h)]
        if ahead:
            dev.append(_dev(f"shared{n}", c.shared))
        cpu.append(Task(f"engine{n}", cpu_call(layer, 0), deps=(f"d2h{n}",)))
        dev.append(_dev(f"h2d{n}", c.h2d, f"engine{n}"))
        if not ahead:
            dev.append(_dev(f"shared{n}", c.shared))
    return cpu, dev


@SCHEDULES.register("serial")
def serial(layers: int, c: LayerCosts, cpu_call: CpuCall, tag: str) -> tuple[list[Task], list[Task]]:
    """The engine, then the shared experts: nothing of the device's overlaps the CPU's."""
    return _whole(layers, c, cpu_call, tag, ahead=False)


@SCHEDULES.register("shared-ahead")
def shared_ahead(layers: int, c: LayerCosts, cpu_call: CpuCall, tag: str) -> tuple[list[Task], list[Task]]:
    """moetune today: the shared experts queued behind the input copies, beside the engine."""
    return _whole(layers, c, cpu_call, tag, ahead=True)


@SCHEDULES.register("two-halves")
def two_halves(layers: int, c: LayerCosts, cpu_call: CpuCall, tag: str) -> tuple[list[Task], list[Task]]:
    """Halves A and B (``c`` is one half's cost): while the CPU runs A's experts the device runs B's attention
    and A's shared experts; while it runs B's, the device returns A, runs B's shared experts and the next
    layer's attention of A, so the CPU goes on to the next layer's A without waiting."""
    cpu: list[Task] = []
    dev = [_dev(f"pre{tag}0a", c.pre), _dev(f"d2h{tag}0a", c.d2h)]
    for layer in range(layers):
        n, nxt = f"{tag}{layer}", f"{tag}{layer + 1}"
        cpu += [
            Task(f"engine{n}a", cpu_call(layer, 0), deps=(f"d2h{n}a",)),
            Task(f"engine{n}b", cpu_call(layer, 1), deps=(f"d2h{n}b",)),
        ]
        dev += [
            _dev(f"pre{n}b", c.pre),
            _dev(f"d2h{n}b", c.d2h),
            _dev(f"shared{n}a", c.shared),
            _dev(f"h2d{n}a", c.h2d, f"engine{n}a"),
            _dev(f"shared{n}b", c.shared),
        ]
        if layer + 1 < layers:
            dev += [_dev(f"pre{nxt}a", c.pre), _dev(f"d2h{nxt}a", c.d2h)]
        dev.append(_dev(f"h2d{n}b", c.h2d, f"engine{n}b"))
    return cpu, dev


class EngineLayers:
    """The CPU side: one LoRA-training ``ExpertEngine`` per layer (its own weights) and each part's batch."""

    def __init__(self, shape: PipelineShape, dtype: torch.dtype, seed: int = 0) -> None:
        s = shape
        self.engines = []
        for layer in range(s.layers):
            w = make_weights(s.experts, s.hidden, s.intermediate, s.rank, 2 * s.rank, dtype, seed + layer)
            self.engines.append(ExpertEngine(DenseExperts(w.gate_up, w.down), lora=w.lora))
        self.batch = make_batch(s.tokens, s.experts, s.top_k, s.hidden, dtype, seed + 1000)
        self.saved: dict[tuple[int, int, int], SavedForward] = {}

    def part(self, parts: int, index: int) -> BenchBatch:
        """Rows ``index`` of ``parts`` equal slices of the batch."""
        t = self.batch.x.shape[0] // parts
        rows = slice(index * t, (index + 1) * t)
        b = self.batch
        return BenchBatch(b.x[rows], b.topk_ids[rows], b.topk_weights[rows], b.grad_y[rows])

    def forward_call(self, parts: int) -> CpuCall:
        def call(layer: int, index: int) -> Callable[[], None]:
            def run() -> None:
                p = self.part(parts, index)
                _, saved = self.engines[layer].forward(p.x, p.topk_ids, p.topk_weights)
                assert saved is not None
                self.saved[(parts, layer, index)] = saved

            return run

        return call

    def backward_call(self, parts: int, layers: int) -> CpuCall:
        def call(step: int, index: int) -> Callable[[], None]:
            layer = layers - 1 - step  # backward walks the layers in reverse

            def run() -> None:
                saved = self.saved.pop((parts, layer, index))
                self.engines[layer].backward(saved, self.part(parts, index).grad_y)

            return run

        return call


def step_tasks(name: str, layers: EngineLayers, costs: LayerCosts) -> tuple[list[Task], list[Task]]:
    """The CPU and device tasks of one forward + backward over every layer under schedule ``name``
    (``costs``: one whole micro-batch)."""
    parts = PARTS[name]
    build = SCHEDULES.get(name)
    n = len(layers.engines)
    fwd_cpu, fwd_dev = build(n, costs.scaled(1 / parts), layers.forward_call(parts), "f")
    bwd_cpu, bwd_dev = build(n, costs.scaled(BWD_FACTOR / parts), layers.backward_call(parts, n), "b")
    first_bwd = bwd_dev[0]
    first_bwd.deps = (*first_bwd.deps, fwd_cpu[-1].name)  # the loss needs the whole forward
    return fwd_cpu + bwd_cpu, fwd_dev + bwd_dev


def replay_medians(
    layers: EngineLayers, costs: LayerCosts, runs: dict[str, list[Timeline]]
) -> dict[str, Timeline]:
    """Each schedule replayed on the virtual clock with every CPU task as long as its median over all rounds of
    all schedules that split the batch alike (``serial`` and ``shared-ahead`` run the same engine calls), so
    the schedules differ by their order alone, not by the noise of their rounds."""
    seconds: dict[tuple[int, str], list[float]] = {}
    for name, timelines in runs.items():
        for tl in timelines:
            for task, (start, end) in tl.cpu.items():
                seconds.setdefault((PARTS[name], task), []).append(end - start)
    out = {}
    for name in runs:
        cpu, dev = step_tasks(name, layers, costs)
        out[name] = replay(cpu, dev, {t.name: statistics.median(seconds[(PARTS[name], t.name)]) for t in cpu})
    return out


def halves_bit_identical(shape: PipelineShape, seed: int = 0) -> dict[str, float]:
    """Max |difference| per result between the fp32 engine on the whole batch and on its two halves
    (0.0 everywhere: bit-identical): y, grad x, grad topk_weights and each LoRA gradient, one layer."""
    layers = EngineLayers(PipelineShape(**{**vars(shape), "layers": 1}), torch.float32, seed)
    engine, b = layers.engines[0], layers.batch
    y, saved = engine.forward(b.x, b.topk_ids, b.topk_weights)
    whole = engine.backward(saved, b.grad_y)
    halves = []
    for index in range(2):
        p = layers.part(2, index)
        y_p, saved_p = engine.forward(p.x, p.topk_ids, p.topk_weights)
        halves.append((y_p, engine.backward(saved_p, p.grad_y)))
    diffs = {
        "y": (y - torch.cat([h[0] for h in halves])).abs().max().item(),
        "grad_x": (whole.x - torch.cat([h[1].x for h in halves])).abs().max().item(),
        "grad_w": (whole.topk_weights - torch.cat([h[1].topk_weights for h in halves])).abs().max().item(),
    }
    assert whole.lora is not None
    for key, g in whole.lora.items():
        summed = halves[0][1].lora[key] + halves[1][1].lora[key]  # type: ignore[index]
        diffs[f"grad_{key}"] = (g - summed).abs().max().item()
    return diffs


def run_pipeline_bench(
    shape: PipelineShape,
    device: DeviceModel,
    reps: int = 3,
    threads: int | None = None,
    out: TextIO | None = None,
) -> list[dict[str, Any]]:
    """Every schedule, ``reps`` interleaved rounds after one warm-up round; prints a table, returns records."""
    shape.validate()
    if reps < 1:
        raise ConfigError(f"reps must be >= 1; got {reps}")
    out = out or sys.stdout
    from moetune.engine.threads import set_engine_threads

    threads = set_engine_threads(threads or default_num_threads())
    dtype = torch.bfloat16 if cpu_info().native_bf16_gemm else torch.float32
    layers = EngineLayers(shape, dtype)
    costs = layer_costs(shape, shape.tokens, device, dtype.itemsize)
    names = SCHEDULES.names()
    timelines: dict[str, list[Timeline]] = {n: [] for n in names}
    for rnd in range(reps + 1):
        for name in names:
            timeline = run_schedule(*step_tasks(name, layers, costs))
            if rnd:
                timelines[name].append(timeline)
    replayed = replay_medians(layers, costs, timelines)
    diffs = halves_bit_identical(shape)
    identical = all(d == 0.0 for d in diffs.values())
    records: list[dict[str, Any]] = []
    for name in names:
        tl = timelines[name]
        records.append(
            {
                "schedule": name,
                "layers": shape.layers,
                "tokens": shape.tokens,
                "hidden": shape.hidden,
                "experts": shape.experts,
                "intermediate": shape.intermediate,
                "shared_intermediate": shape.shared_intermediate,
                "top_k": shape.top_k,
                "rank": shape.rank,
                "dtype": str(dtype).removeprefix("torch."),
                "threads": threads,
                "device_tflops": device.tflops,
                "link_gbs": device.link_gbs,
                "launch_us": device.launch_us,
                "wall_ms": 1e3 * statistics.median(t.wall_s for t in tl),
                "cpu_busy_ms": 1e3 * statistics.median(t.cpu_busy_s for t in tl),
                "device_busy_ms": 1e3 * statistics.median(t.device_busy_s for t in tl),
                "hidden_fraction": statistics.median(t.hidden_fraction for t in tl),
                "replay_wall_ms": 1e3 * replayed[name].wall_s,
                "replay_cpu_ms": 1e3 * replayed[name].cpu_busy_s,
                "replay_hidden_fraction": replayed[name].hidden_fraction,
                "rounds": len(tl),
                "halves_bit_identical_fp32": identical,
            }
        )
    serial_rec = next(r for r in records if r["schedule"] == "serial")
    for rec in records:
        rec["vs_serial"] = serial_rec["wall_ms"] / rec["wall_ms"]
        rec["replay_vs_serial"] = serial_rec["replay_wall_ms"] / rec["replay_wall_ms"]
    _print(out, shape, device, threads, dtype, records, diffs)
    return records


def _print(
    out: TextIO,
    shape: PipelineShape,
    device: DeviceModel,
    threads: int,
    dtype: torch.dtype,
    records: list[dict[str, Any]],
    diffs: dict[str, float],
) -> None:
    cpu = cpu_info()
    s = shape
    print(
        f"bench/pipeline.py | {cpu.model} ({', '.join(cpu.isa) or 'no SIMD flags found'}), {threads} threads | "
        f"{s.layers} layers, T={s.tokens}, H={s.hidden}, E={s.experts} x I={s.intermediate}, top-{s.top_k}, "
        f"shared I={s.shared_intermediate}, LoRA r={s.rank}, {dtype} | simulated device: {device.tflops:g} "
        f"TFLOP/s, link {device.link_gbs:g} GB/s, {device.launch_us:g} us per task",
        file=out,
    )
    head = (
        f"{'schedule':<14}{'wall ms':>10}{'CPU ms':>10}{'device ms':>11}{'hidden':>9}{'vs serial':>11}"
        f"{'replay ms':>11}{'hidden':>9}{'vs serial':>11}"
    )
    print(f"{'':<65}| replay on a virtual clock", file=out)
    print(head + "\n" + "-" * len(head), file=out)
    for r in records:
        print(
            f"{r['schedule']:<14}{r['wall_ms']:>10.1f}{r['cpu_busy_ms']:>10.1f}{r['device_busy_ms']:>11.2f}"
            f"{r['hidden_fraction']:>9.1%}{r['vs_serial']:>10.2f}x{r['replay_wall_ms']:>11.1f}"
            f"{r['replay_hidden_fraction']:>9.1%}{r['replay_vs_serial']:>10.2f}x",
            file=out,
        )
    verdict = "bit-identical" if all(d == 0.0 for d in diffs.values()) else "NOT bit-identical"
    worst = max(diffs, key=lambda k: diffs[k])
    print(
        "\nhidden = device busy time overlapped by CPU busy time / device busy time (forward + backward, medians of "
        "interleaved rounds). replay = the same tasks on a virtual clock, each CPU task as long as its median over "
        "the rounds of every schedule making the same engine calls, device tasks as modelled, each starting as "
        "soon as its queue and dependencies allow: the schedules' own difference, without this machine's "
        "thread wake-up latencies and round-to-round noise (large when other processes share the cores).\n"
        f"Engine on two halves vs the whole batch, fp32: {verdict} (largest difference {diffs[worst]:.3g} in "
        f"{worst}).",
        file=out,
    )


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """``bench/pipeline.py``: parse, run, print. User errors exit 2."""
    p = argparse.ArgumentParser(prog="python bench/pipeline.py", description=__doc__.split("\n\n")[0])
    defaults = PipelineShape()
    for name, value in vars(defaults).items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    model = DeviceModel()
    p.add_argument("--device-tflops", type=float, default=model.tflops, help="simulated device throughput")
    p.add_argument("--link-gbs", type=float, default=model.link_gbs, help="host<->device GB/s, each way")
    p.add_argument("--launch-us", type=float, default=model.launch_us, help="fixed cost per device task")
    p.add_argument("--reps", type=int, default=3, help="timed rounds (median reported)")
    p.add_argument("--threads", type=int, help="torch threads (default: physical cores)")
    args = p.parse_args(argv)
    try:
        shape = PipelineShape(**{n: getattr(args, n) for n in vars(defaults)})
        if min(args.device_tflops, args.link_gbs) <= 0 or args.launch_us < 0:
            raise ConfigError("--device-tflops and --link-gbs must be > 0, --launch-us >= 0")
        device = DeviceModel(args.device_tflops, args.link_gbs, args.launch_us)
        run_pipeline_bench(shape, device, args.reps, args.threads, out)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
