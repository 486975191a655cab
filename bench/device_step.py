"""LoRA training steps of a DeepSeek-V3-shaped model on a real device: how much of the device's busy time is hidden
behind the CPU engine, with the shared experts launched ahead (what ``moetune.load_model`` sets up) and without.

    python bench/device_step.py [--device cuda] [--layers 4 --hidden 1024 --experts 32 --inter 512 --shared 2
                                 --seq 1024 --reps 3 --threads N]

The model is a random ``DeepseekV3Config`` checkpoint (its first layer dense, like the release; the others MoE with
``--shared`` shared experts) saved the way the release is laid out and loaded through ``moetune.load_model`` on
``--device``: attention, routers, shared experts and embeddings there, routed experts in the CPU engine, LoRA
(rank 8) on the attention projections and the routed experts. Two variants step in turns, ``ahead`` (as loaded:
``moetune.layer.overlap``) and ``serial`` (every ``CpuExperts.shared_ahead`` cleared, so the block runs its
shared experts after the engine, as transformers orders them). Printed per variant: the median step time, and
from one step under ``torch.profiler``: the device's busy time (the union of its kernels and copies), the
engine's (the union of ``ExpertsFunction`` forward and backward ranges) and the share of the device's busy time
that fell while the engine ran. On ``--device cpu`` there is no device timeline: only step times are printed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Iterable

import torch
from torch.profiler import ProfilerActivity, profile

import moetune
from moetune.bench.schedule import Interval, overlap_s
from moetune.layer import CpuExperts
from moetune.sysinfo import cpu_info, default_num_threads
from moetune.testing.tiny import save_tiny_model


def merged(intervals: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` as sorted, disjoint intervals."""
    out: list[Interval] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def total(intervals: list[Interval]) -> float:
    return sum(end - start for start, end in intervals)


def timelines(prof: profile) -> tuple[list[Interval], list[Interval]]:
    """(device busy, engine busy) intervals in microseconds of one profiled step."""
    device, engine = [], []
    for e in prof.events():
        span = (float(e.time_range.start), float(e.time_range.end))
        if e.device_type == torch.autograd.DeviceType.CUDA:
            device.append(span)
        elif e.name in ("ExpertsFunction", "ExpertsFunctionBackward"):
            engine.append(span)
    return merged(device), merged(engine)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--inter", type=int, default=512, help="moe_intermediate_size")
    p.add_argument("--shared", type=int, default=2, help="n_shared_experts")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, help="engine threads (default: the physical cores)")
    args = p.parse_args()
    device = torch.device(args.device)
    threads = args.threads or default_num_threads()
    cpu = cpu_info()
    dtype = torch.bfloat16 if cpu.native_bf16_gemm else torch.float32
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "no device"
    print(f"{cpu.model} ({', '.join(cpu.isa)}), {threads} engine threads; {gpu}; {dtype}")
    heads = max(1, args.hidden // 128)
    overrides = {
        "num_hidden_layers": args.layers,
        "hidden_size": args.hidden,
        "intermediate_size": 4 * args.hidden,
        "moe_intermediate_size": args.inter,
        "n_routed_experts": args.experts,
        "num_experts_per_tok": 8,
        "n_shared_experts": args.shared,
        "n_group": 4,
        "topk_group": 2,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": 256,
        "q_lora_rank": 384,
        "qk_rope_head_dim": 32,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        "vocab_size": 4096,
    }
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model("deepseek_v3", os.path.join(tmp, "m"), tokenizer=False, **overrides)
        model = moetune.load_model(path, device=device, dtype=dtype, progress=False, num_threads=threads)
    peft_model = moetune.attach_lora(model, rank=8)
    blocks = [m for m in model.modules() if isinstance(m, CpuExperts)]
    ahead = [m.shared_ahead for m in blocks]
    ids = torch.randint(3, overrides["vocab_size"], (1, args.seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(device)

    def step() -> None:
        peft_model(ids, labels=ids).loss.backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def set_variant(name: str) -> None:
        for m, a in zip(blocks, ahead, strict=True):
            m.shared_ahead = a if name == "ahead" else None

    variants = ("ahead", "serial")
    times: dict[str, list[float]] = {v: [] for v in variants}
    for rep in range(args.reps + 1):  # the first round warms up
        for name in variants[rep % 2 :] + variants[: rep % 2]:
            set_variant(name)
            start = time.perf_counter()
            step()
            if rep:
                times[name].append((time.perf_counter() - start) * 1e3)
    print(
        f"E={args.experts} H={args.hidden} I={args.inter} shared={args.shared} layers={args.layers} T={args.seq}"
    )
    print("variant   step ms   device busy ms   engine ms   device time hidden behind the engine")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name in variants:
        set_variant(name)
        with profile(activities=activities) as prof:
            step()
        dev, eng = timelines(prof)
        busy = total(dev) / 1e3
        hidden = f"{overlap_s(dev, eng) / total(dev):.0%}" if dev else "n/a"
        print(
            f"{name:<8} {statistics.median(times[name]):8.1f}   {busy:14.1f}   {total(eng) / 1e3:9.1f}   {hidden}"
        )


if __name__ == "__main__":
    main()
