"""Experts paged from disk against the same store held in RAM: step time, prefetch waits, disk bandwidth.

    python bench/residency.py [--layers 8 --experts 16 --hidden 1024 --inter 512 --tokens 256
                               --format int8 --budget-layers 2 --reps 3 --threads N --dir DIR]

Saves a random Qwen3-MoE checkpoint of these sizes (bf16, every layer MoE) in DIR (default: a temporary
directory), converts it with ``moetune convert``, and times one training step (forward + backward, LoRA on
q_proj and the experts, batch 1 x --tokens) in two phases, each in a fresh model:

* ram: ``load_model(src, expert_path=store)``, every page of the store resident;
* disk: ``expert_residency="disk"`` with a budget of ``--budget-layers`` layer files: each layer is paged
  in just in time, the next prefetched, and released pages are dropped from the page cache as well, so
  each step really reads the store from the disk.

The phases run one after the other (the RAM model is freed first): while a process maps the pages, the
kernel keeps them cached and the disk phase would read from memory. Printed: the median step time of each
(after one warm-up step; the disk warm-up also hashes every file), their ratio, the window's statistics
per step (hits, misses, seconds the engine waited for pages, bytes read), the store's sequential read
bandwidth measured with the page cache dropped, and the time a disk step would spend just reading its
bytes at that bandwidth (the bound that prefetching hides behind compute when compute is longer).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

import moetune
from moetune.adapters.apply import attach_lora, expert_modules
from moetune.cli.main import main as cli
from moetune.testing.tiny import save_tiny_model

READ_CHUNK = 16 << 20


def read_bandwidth(files: list[Path]) -> float:
    """Bytes per second reading ``files`` sequentially, each dropped from the page cache first."""
    buf = bytearray(READ_CHUNK)
    total, start = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - start)


def step(model, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - t0


def phase(
    src: Path, store: Path, ids: torch.Tensor, reps: int, threads: int | None, **options: object
) -> tuple[list[float], dict[str, float]]:
    """Step times of a fresh model, and (disk) the residency window's statistics per step."""
    model = moetune.load_model(
        src, device="cpu", dtype="float32", progress=False, num_threads=threads, expert_path=store, **options
    )
    torch.manual_seed(0)
    model = attach_lora(model, rank=8, alpha=16, targets=("q_proj", "experts"))
    step(model, ids)  # warm-up
    window = getattr(next(iter(expert_modules(model).values())).experts.engine.weights, "window", None)
    keys = ("hits", "misses", "wait_seconds", "bytes_read")
    before = {k: getattr(window.stats, k) for k in keys} if window is not None else {}
    times = [step(model, ids) for _ in range(reps)]
    per = {k: (getattr(window.stats, k) - before[k]) / reps for k in keys} if window is not None else {}
    if window is not None:
        print(
            f"  disk window per step: {per['hits']:.1f} hits, {per['misses']:.1f} misses, "
            f"waited {per['wait_seconds']:.3f} s, read {per['bytes_read'] / 1e9:.3f} GB "
            f"(budget {window.budget / 1e9:.3f} GB, peak {window.stats.peak_bytes / 1e9:.3f} GB)"
        )
    del model, window
    gc.collect()  # unmap the store before the next phase
    return times, per


def run(args: argparse.Namespace, root: Path) -> None:
    src, store = root / "src", root / "store"
    sizes = {
        "num_hidden_layers": args.layers,
        "mlp_only_layers": [],
        "hidden_size": args.hidden,
        "moe_intermediate_size": args.inter,
        "num_experts": args.experts,
        "num_experts_per_tok": 8 if args.experts >= 8 else 2,
    }
    if not (src / "config.json").exists():
        save_tiny_model("qwen3_moe", src, dtype=torch.bfloat16, tokenizer=False, **sizes)
    if not (store / "manifest.json").exists():
        assert cli(["convert", str(src), str(store), "--format", args.format, "--quiet", "--overwrite"]) == 0
    files = sorted(store.glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    budget = args.budget_layers * max(f.stat().st_size for f in files) + args.budget_layers * 4096
    print(
        f"store: {len(files)} layers, {total / 1e9:.3f} GB ({args.format}); disk budget {budget / 1e9:.3f} GB "
        f"({total / budget:.1f}x smaller); {args.tokens} tokens per step, threads {args.threads or 'default'}"
    )
    bandwidth = read_bandwidth(files)
    print(f"disk read bandwidth (page cache dropped): {bandwidth / 1e9:.2f} GB/s")

    ids = torch.randint(3, 96, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    ram, _ = phase(src, store, ids, args.reps, args.threads)
    disk, per = phase(
        src, store, ids, args.reps, args.threads, expert_residency="disk", expert_residency_budget=budget
    )
    r, d = statistics.median(ram), statistics.median(disk)
    read_s = per["bytes_read"] / bandwidth
    print(f"step (median of {args.reps}): ram {r:.3f} s, disk {d:.3f} s, disk / ram {d / r:.2f}x")
    print(
        f"reading a disk step's bytes at {bandwidth / 1e9:.2f} GB/s takes {read_s:.3f} s; "
        f"disk step - max(ram step, read time) = {d - max(r, read_s):+.3f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--format", default="int8", choices=["int8", "int4", "fp8", "bf16"])
    ap.add_argument("--budget-layers", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dir", type=Path, default=None, help="keep the checkpoint and store here (reused)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="moetune-residency-") as tmp:
        run(args, args.dir or Path(tmp))


if __name__ == "__main__":
    main()
