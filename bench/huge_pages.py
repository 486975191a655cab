"""Engine steps with torch's CPU allocator advising transparent huge pages and without, side by side.

    python bench/huge_pages.py [--experts 128] [--tokens 128 512] [--modes lora frozen] [--reps 3] [--rounds 3]
                               [--threads 1] [--hidden 2048] [--inter 768] [--top-k 8]

``THP_MEM_ALLOC_ENABLE=1`` makes torch's CPU allocator ``madvise(MADV_HUGEPAGE)`` every block of 2 MiB or more
(expert weights, activations, gradients, workspaces), so that on a kernel whose transparent huge pages are
``madvise`` those blocks get 2 MiB pages: fewer TLB misses while the kernels stream the weights, and one page
fault per 2 MiB of fresh memory instead of 512. torch reads the variable once, at its first allocation, so the two
settings run in separate processes: ``--rounds`` rounds, each one child process per setting (the order swapped
every round, so that drift falls on both alike), each child timing ``--reps`` engine steps (forward + backward,
process CPU time, after one warm-up) per (T, mode) on the engine benchmark's layer (``moetune.bench.runners``:
bf16 weights laid out as the loader lays them out, LoRA r = 8). Printed per (T, mode): the median over all
rounds' reps for each setting, off / on (> 1: huge pages are faster), each child's median (the spread between
processes), and the anonymous huge pages the children held (``AnonHugePages`` of ``/proc/self/smaps_rollup``).
Not a test: a machine's answer, at the moment it ran (docs/performance.md, "Huge pages for torch's allocations"),
for deciding whether to export the variable.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from moetune.sysinfo import THP_ENV, cpu_info, thp_mode


def child(args: argparse.Namespace) -> None:
    """One process's timings, as one JSON line: {"T-mode": [ms, ...], "anon_huge_kib": n, "advised": bool}."""
    import torch

    from moetune.bench.runners import RUNNERS, make_batch, make_weights
    from moetune.engine import EngineOptions, TrainMode
    from moetune.sysinfo import torch_advises_huge_pages

    torch.set_num_threads(args.threads)
    k = min(args.top_k, args.experts)
    weights = make_weights(args.experts, args.hidden, args.inter, 8, 16, torch.bfloat16, 0)
    times: dict[str, list[float]] = {}
    for t in args.tokens:
        batch = make_batch(t, args.experts, k, args.hidden, torch.bfloat16, t)
        for mode in args.modes:
            step = RUNNERS.get("engine")(weights, batch, TrainMode(mode), EngineOptions())
            step.backward(step.forward())  # warm-up
            key = f"{t}-{mode}"
            times[key] = []
            for _ in range(args.reps):
                c0 = time.process_time()
                step.backward(step.forward())
                times[key].append((time.process_time() - c0) * 1e3)
    rollup = Path("/proc/self/smaps_rollup")
    huge = 0
    if rollup.is_file():
        for line in rollup.read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                huge = int(line.split()[1])
    print(json.dumps({"times": times, "anon_huge_kib": huge, "advised": torch_advises_huge_pages()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--modes", nargs="+", choices=["lora", "frozen"], default=["lora", "frozen"])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    cpu = cpu_info()
    print(
        f"bench/huge_pages.py | {cpu.model} ({', '.join(cpu.isa)}), {args.threads} thread(s) | kernel THP mode "
        f"{thp_mode()} | E {args.experts}, H {args.hidden}, I {args.inter}, k {min(args.top_k, args.experts)}, "
        f"bf16, {args.rounds} rounds x {args.reps} reps"
    )
    argv = [*sys.argv[1:], "--child"]
    runs: dict[str, list[dict]] = {"0": [], "1": []}
    for r in range(args.rounds):
        for setting in ("0", "1") if r % 2 == 0 else ("1", "0"):
            done = subprocess.run(
                [sys.executable, __file__, *argv],
                env={**os.environ, THP_ENV: setting},
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise SystemExit(
                    f"child with {THP_ENV}={setting} exited {done.returncode}:\n{done.stderr[-2000:]}"
                )
            runs[setting].append(json.loads(done.stdout.strip().splitlines()[-1]))
    for setting, label in (("0", "off"), ("1", "on")):
        advised = {run["advised"] for run in runs[setting]}
        huge = max(run["anon_huge_kib"] for run in runs[setting]) / 1024
        print(
            f"  {THP_ENV}={setting} ({label}): torch advises huge pages: {advised}; anon huge pages up to {huge:.0f} MiB"
        )
    print(
        f"  {'case':14s} {'off ms':>9s} {'on ms':>9s} {'off / on':>9s}   per round (each child's median) off | on"
    )
    for key in runs["0"][0]["times"]:
        med = {s: statistics.median(x for run in runs[s] for x in run["times"][key]) for s in runs}
        rounds = {s: " ".join(f"{statistics.median(run['times'][key]):.0f}" for run in runs[s]) for s in runs}
        t, mode = key.split("-")
        print(
            f"  T {t:>5s} {mode:6s} {med['0']:9.1f} {med['1']:9.1f} {med['0'] / med['1']:8.3f}x   "
            f"{rounds['0']} | {rounds['1']}"
        )


if __name__ == "__main__":
    main()
