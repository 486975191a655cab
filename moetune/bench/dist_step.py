"""A whole training step over 1, 2 and 4 processes, and the scaling expected beyond this machine.

``python bench/dist.py --whole-step [--procs-list 1,2,4] [--fsdp]`` (bench/dist.py's layer benchmark stays the
default). A Qwen3-MoE checkpoint that is tiny but not trivial (``--hidden`` 512, 16 experts of I = 256, top-4,
4 MoE layers, the demo tokenizer) is written once; each process count then runs ``moetune train``'s library path
(``recipe.setup`` -> ``recipe.train``: LoRA on every target, experts included, AdamW, packed 512-token rows, the
same global batch of ``--global-batch`` rows split over the ranks) under ``torchrun --standalone`` (one process:
plainly), each rank pinned to its own cores by moetune (``bind_cpus``, ``moetune.dist.affinity``). A callback
(:class:`StepWindows`) times three windows of optimizer steps on every rank: warm-up (not counted), a timed
window (tokens/s, no profiler) and a profiled window, in which torch's profiler records every gloo collective
(``gloo:*`` events on gloo's threads: their duration, waiting for the slowest rank included, and their payload,
the elements of their input tensors x 4 bytes: every trained tensor is fp32). Per step and rank: time in
collectives and bytes handed to them (payload, not the bytes a ring algorithm puts on the wire: about
``2 (W - 1) / W`` x payload for an all-reduce).

:func:`expected_step` is the scaling model of docs/distributed.md: a step of ``T`` tokens over ``W`` ranks costs
the compute of ``T / W`` tokens plus the exchange and all-reduce bytes over the link's bandwidth.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

ROOT = Path(__file__).resolve().parents[2]
FP32 = 4  # bytes per element of every trained tensor and gradient in this benchmark (fp32 run)


class StepWindows(TrainerCallback):
    """A ``TrainerCallback`` timing optimizer steps
    ``[warmup, warmup + timed)`` and profiling ``[warmup + timed, warmup + timed + profiled)``; :meth:`result`
    summarises them."""

    def __init__(self, warmup: int, timed: int, profiled: int) -> None:
        self.bounds = (warmup, warmup + timed, warmup + timed + profiled)
        self.marks: dict[int, tuple[float, int]] = {}  # step -> (time, tokens seen)
        self.prof: Any = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if step in self.bounds:
            self.marks[step] = (time.perf_counter(), state.num_input_tokens_seen)
        if step == self.bounds[1]:
            from torch.profiler import ProfilerActivity, profile

            self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
            self.prof.start()
        elif step == self.bounds[2] and self.prof is not None:
            self.prof.stop()

    def result(self) -> dict[str, Any]:
        (t0, n0), (t1, n1) = self.marks[self.bounds[0]], self.marks[self.bounds[1]]
        steps = self.bounds[2] - self.bounds[1]
        seconds, payload, calls = 0.0, 0, 0
        if self.prof is not None:
            for event in self.prof.events():
                if event.name.startswith("gloo:"):
                    calls += 1
                    seconds += event.cpu_time_total / 1e6
                    payload += sum(_numel(shape) for shape in event.input_shapes) * FP32
        return {
            "step_s": (t1 - t0) / (self.bounds[1] - self.bounds[0]),
            "tokens": (n1 - n0)
            / (self.bounds[1] - self.bounds[0]),  # the global batch's (the Trainer's count)
            "collective_s": seconds / steps,
            "collective_bytes": payload / steps,
            "collectives": calls / steps,
        }


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n if shape else 0


def worker(config: str, out_dir: str, warmup: int, timed: int, profiled: int) -> None:
    """One rank: ``moetune train``'s setup and training loop on ``config`` with :class:`StepWindows`; writes
    ``rank{R}.json`` into ``out_dir``."""
    from moetune.config import load_config
    from moetune.dist import failures_end_every_rank
    from moetune.train import recipe

    cfg = load_config(config)
    ranks = recipe._start_ranks(cfg)
    windows = StepWindows(warmup, timed, profiled)
    with failures_end_every_rank(ranks):
        model, tokenizer, data = recipe.setup(cfg, progress=False)
        recipe.train(cfg, model, tokenizer, data, extra_callbacks=(windows,))
    result = {
        "rank": ranks.rank,
        "cpus": sorted(os.sched_getaffinity(0)),
        **windows.result(),
    }
    Path(out_dir, f"rank{ranks.rank}.json").write_text(json.dumps(result))


def _config(tmp: Path, model: Path, procs: int, args: Any) -> Path:
    import yaml

    steps = args.warmup + args.timed + args.profiled
    cfg: dict[str, Any] = {
        "model_name_or_path": str(model),
        "lora_rank": 8,
        "lora_target": "all",
        "dataset": "demo_train",
        "dataset_dir": str(ROOT / "examples/data"),
        "cutoff_len": args.seq,
        "packing": True,
        "output_dir": str(tmp / f"out{procs}"),
        "overwrite_output_dir": True,
        "per_device_train_batch_size": args.global_batch // procs,
        "learning_rate": 1e-4,
        "optim": "adamw_torch",
        "max_steps": steps,
        "logging_steps": steps,
        "save_strategy": "no",
        "report_to": "none",
        "seed": 0,
        "ddp_timeout": 600,
        "moetune": {"device": "cpu"},
        **({"fsdp": True, "fsdp_config": {"fsdp_version": 2}} if args.fsdp and procs > 1 else {}),
    }
    path = tmp / f"cfg{procs}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def bench_model(args: Any, path: Path, **config: Any) -> Path:
    """bench/dist.py's Qwen3-MoE (fp32, random, no tokenizer) of ``args``' sizes, every layer MoE, written to
    ``path``; ``config``: further config fields (the vocabulary of a tokenizer)."""
    from moetune.testing.tiny import save_tiny_model

    return save_tiny_model(
        "qwen3_moe",
        path,
        tokenizer=False,
        hidden_size=args.hidden,
        moe_intermediate_size=args.inter,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        num_hidden_layers=args.layers,
        mlp_only_layers=[],
        **config,
    )


def run(args: Any) -> dict[int, list[dict[str, Any]]]:
    """Every process count of ``args.procs_list``: each rank's :meth:`StepWindows.result` (and its CPUs)."""
    from transformers import AutoTokenizer

    procs_list = [int(p) for p in str(args.procs_list).split(",")]
    bad = [p for p in procs_list if p < 1 or args.global_batch % p]
    if bad:
        raise SystemExit(f"--procs-list {bad}: each count must divide --global-batch {args.global_batch}")
    results: dict[int, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        tokenizer = AutoTokenizer.from_pretrained(str(ROOT / "examples/data/demo_tokenizer"))
        model = bench_model(
            args,
            tmp / "model",
            vocab_size=len(tokenizer),
            pad_token_id=tokenizer.pad_token_id,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        tokenizer.save_pretrained(model)
        for procs in procs_list:
            out = tmp / f"results{procs}"
            out.mkdir()
            me = [
                str(ROOT / "bench/dist.py"),
                f"--step-worker={_config(tmp, model, procs, args)}",
                f"--step-out={out}",
                f"--warmup={args.warmup}",
                f"--timed={args.timed}",
                f"--profiled={args.profiled}",
            ]
            launch = (
                [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
                if procs > 1
                else [sys.executable]
            )
            env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
            done = subprocess.run(
                [*launch, *me], env=env, cwd=ROOT, capture_output=True, text=True, timeout=3600
            )
            if done.returncode != 0:
                raise SystemExit(f"{procs} processes failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
            results[procs] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(procs)]
    return results


def print_table(results: dict[int, list[dict[str, Any]]]) -> None:
    """One row per process count: the slowest rank's step, global tokens/s, per-rank collectives."""
    base = max(r["step_s"] for r in results[min(results)])
    print(
        f"{'processes':>9} {'step ms':>8} {'tokens/s':>9} {'speed-up':>8} {'collective ms/rank':>18} "
        f"{'payload MB/rank':>15} {'calls':>6}  CPUs per rank"
    )
    for procs, ranks in results.items():
        step = max(r["step_s"] for r in ranks)
        print(
            f"{procs:9d} {step * 1e3:8.1f} {ranks[0]['tokens'] / step:9.0f} {base / step:8.2f} "
            f"{max(r['collective_s'] for r in ranks) * 1e3:18.1f} "
            f"{max(r['collective_bytes'] for r in ranks) / 1e6:15.2f} {ranks[0]['collectives']:6.0f}  "
            + " ".join(_span(r["cpus"]) for r in ranks)
        )


def _span(cpus: list[int]) -> str:
    return f"[{cpus[0]}-{cpus[-1]}]" if len(cpus) > 1 and cpus[-1] - cpus[0] == len(cpus) - 1 else str(cpus)


@dataclass(frozen=True)
class StepCosts:
    """What the scaling model needs of a model and a machine.

    ``s_per_token``: one process's training step (forward and backward, every layer) per token on one rank's
    cores (a socket); ``layers``, ``hidden``, ``top_k``: MoE layers, H and k; ``value_bytes``: bytes of one
    exchanged activation value (4 fp32, 2 bf16); ``allreduce_bytes``: the gradients averaged each step over the
    ranks (dense LoRA and the whole expert LoRA: docs/distributed.md)."""

    s_per_token: float
    layers: int
    hidden: int
    top_k: int
    value_bytes: int
    allreduce_bytes: float


def expected_step(
    costs: StepCosts, tokens: int, ranks: int, link_gb_s: float, latency_s: float = 20e-6
) -> float:
    """Seconds of one optimizer step of ``tokens`` tokens over ``ranks`` ranks with sharded experts.

    compute = (T / W) x s_per_token (each rank its share of the tokens; under uniform routing each owner's
    expert work is its share too); exchange = L x 4 x (1 - 1/W) x (T / W) k H x value_bytes / bandwidth (rows
    there and back, forward and backward) + 4 L latencies; all-reduce = 2 (W - 1) / W x allreduce_bytes /
    bandwidth (ring) + a latency. Nothing overlapped: an upper bound on the step.
    """
    w = ranks
    compute = tokens / w * costs.s_per_token
    if w == 1:
        return compute
    bw = link_gb_s * 1e9
    rows = costs.layers * 4 * (1 - 1 / w) * tokens / w * costs.top_k * costs.hidden * costs.value_bytes
    exchange = rows / bw + 4 * costs.layers * latency_s
    allreduce = 2 * (w - 1) / w * costs.allreduce_bytes / bw + latency_s
    return compute + exchange + allreduce


def scaling_table(costs: StepCosts, tokens: int, links: dict[str, float], ranks: tuple[int, ...]) -> str:
    """A Markdown table: the speed-up over one rank of :func:`expected_step` for each link and rank count."""
    one = expected_step(costs, tokens, 1, 1.0)
    head = "| link (GB/s) | " + " | ".join(f"{w} ranks" for w in ranks) + " |"
    rows = [head, "|---|" + "---|" * len(ranks)]
    for name, bw in links.items():
        cells = [f"{one / expected_step(costs, tokens, w, bw):.2f}x" for w in ranks]
        rows.append(f"| {name} ({bw:g}) | " + " | ".join(cells) + " |")
    return "\n".join(rows)


# links of the docs' table: GB/s one way per rank
LINKS = {"2-socket UPI/xGMI": 40.0, "100 Gb/s Ethernet/IB": 12.5, "400 Gb/s IB": 50.0}


def measured_costs(results: dict[int, list[dict[str, Any]]], args: Any) -> StepCosts:
    """The scaling model's inputs from this run: one process's step per token, and the payload the 2-process
    run all-reduced per step (its collectives' bytes)."""
    one = results[min(results)][0]
    two = results.get(2, results[max(results)])
    return StepCosts(
        s_per_token=one["step_s"] / one["tokens"],
        layers=args.layers,
        hidden=args.hidden,
        top_k=args.top_k,
        value_bytes=FP32,
        allreduce_bytes=max(r["collective_bytes"] for r in two),
    )
