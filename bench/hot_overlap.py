"""How much of the hot experts' time is hidden behind the CPU experts, forward and backward.

    python bench/hot_overlap.py [--experts 64 --hot 8 --tokens 512 --hidden 1024 --inter 512 --top-k 8
                                 --rank 8 --device cpu --device-ms 0 --threads N --reps 5]

One MoE layer (``CpuExperts`` over random fp32 weights with expert LoRA, tokens routed like a softmax top-k
router) with its ``--hot`` most-routed experts held on ``--device`` (``moetune.layer.hot``). Three variants are
timed, forward and backward apart, interleaved round by round (each first in turn) so machine noise falls on
all alike:

* ``cold``: the engine alone on the cold slots (``routed_experts(..., subset=cold)``);
* ``hot``: the hot experts alone (``HotExperts.forward`` and its autograd backward);
* ``both``: the layer's call, the two beside each other (``moetune.layer.hot_overlap``).

Printed per pass: the median ms of each, and the share of the hot experts' time hidden,
``(cold + hot - both) / hot`` (1: fully hidden; 0: the two ran one after the other; below 0: running them together
cost more than running them apart). With ``--device cpu`` the "device" is the same CPU: both sides share its cores,
so the share shows that they run at the same time, not what a GPU would hide, and on a machine shared with other
work it is mostly noise. ``--device-ms X`` stands in for a device that is busy X ms per pass while the host's cores
are free (the hot experts' forward and backward each also sleep X ms), which a loaded machine measures steadily.
With ``--device cuda`` the hot experts are queued on the GPU (timings synchronise the device at the end of each
pass).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

from moetune.bench.runners import make_batch, make_weights
from moetune.engine import DenseExperts, ExpertEngine
from moetune.engine.threads import set_engine_threads
from moetune.layer import CpuExperts
from moetune.layer.function import routed_experts
from moetune.layer.transfer import HostCopy
from moetune.sysinfo import cpu_info, default_num_threads

Pass = Callable[[], torch.Tensor]


def _timed(device: torch.device, fn: Callable[[], object]) -> tuple[float, object]:
    """(ms, fn()) with the device's queued work finished at the end."""
    start = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--hot", type=int, default=8, help="experts held on the device: the most routed ones")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the physical cores)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument(
        "--device-ms",
        type=float,
        default=0.0,
        help="simulated device time: the hot experts' forward and backward each also sleep this long (ms)",
    )
    args = p.parse_args()
    threads = args.threads if args.threads is not None else default_num_threads()
    set_engine_threads(threads)
    device = torch.device(args.device)
    cpu = cpu_info()
    print(
        f"{cpu.model} ({', '.join(cpu.isa) or 'no listed ISA extensions'}), {cpu.logical_cpus} logical CPUs, "
        f"{threads} torch threads; load {os.getloadavg()[0]:.1f}; hot experts on {device}"
        + (f", simulated device time {args.device_ms:g} ms per pass" if args.device_ms > 0 else "")
    )
    weights = make_weights(args.experts, args.hidden, args.inter, args.rank, 2 * args.rank, torch.float32, 0)
    batch = make_batch(args.tokens, args.experts, args.top_k, args.hidden, torch.float32, 1)
    layer = CpuExperts(ExpertEngine(DenseExperts(weights.gate_up, weights.down), lora=weights.lora))
    counts = torch.bincount(batch.topk_ids.reshape(-1), minlength=args.experts)
    hot_ids = tuple(sorted(counts.topk(args.hot).indices.tolist()))
    layer.place_hot(hot_ids, device, torch.float32)
    assert layer.hot is not None
    hot, engine = layer.hot, layer.engine
    if args.device_ms > 0:  # a device busy for that long, during which the host's cores are free
        hot.register_forward_hook(lambda *_: time.sleep(args.device_ms / 1e3))
        hot.register_full_backward_hook(lambda *_: time.sleep(args.device_ms / 1e3))
    route = hot.route(batch.topk_ids)
    x = batch.x.to(device).requires_grad_(True)
    w = batch.topk_weights.to(device).requires_grad_(True)
    ids, grad_y = batch.topk_ids.to(device), batch.grad_y.to(device)
    share = sum(route.counts) / batch.topk_ids.numel()
    print(
        f"E={args.experts} H={args.hidden} I={args.inter} k={args.top_k} r={args.rank} T={args.tokens}: "
        f"{args.hot} hot experts {list(hot_ids)} take {share:.0%} of the {batch.topk_ids.numel()} slots"
    )

    variants: dict[str, Pass] = {
        "cold": lambda: routed_experts(engine, x, ids, w, host=HostCopy(x, ids, w), subset=route.cold),
        "hot": lambda: hot(x, w, route, engine.call_lora(None), True),
        "both": lambda: layer(x, ids, w),
    }
    times: dict[str, dict[str, list[float]]] = {v: {"forward": [], "backward": []} for v in variants}
    leaves = [x, w, *layer.parameters()]
    names = list(variants)
    for rep in range(args.reps + 1):  # the first round warms up
        for name in names[rep % 3 :] + names[: rep % 3]:  # each variant first in turn
            fn = variants[name]
            fwd_ms, y = _timed(device, fn)
            bwd_ms, _ = _timed(device, lambda y=y: torch.autograd.grad(y, leaves, grad_y, allow_unused=True))
            if rep:
                times[name]["forward"].append(fwd_ms)
                times[name]["backward"].append(bwd_ms)
    print(f"median of {args.reps} rounds, ms:      cold      hot     both   hot time hidden")
    for phase in ("forward", "backward"):
        cold, hot_ms, both = (statistics.median(times[v][phase]) for v in variants)
        hidden = (cold + hot_ms - both) / hot_ms
        print(f"  {phase:<8}                  {cold:8.1f} {hot_ms:8.1f} {both:8.1f}   {hidden:6.0%}")


if __name__ == "__main__":
    main()
