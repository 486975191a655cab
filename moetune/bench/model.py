"""The model benchmark: training-step throughput and peak host memory of a whole MoE model, moetune against
transformers on the same checkpoint. ``bench/model.py`` runs :func:`main`.

The checkpoint is a wide random Qwen3-MoE (``moetune.testing.wide``; default 8 layers, H = 1024, 64 experts
of I = 512, top-8, 1.6 GB of bf16 experts), written once, or any checkpoint given with ``--checkpoint``.
Four variants load it, each in its own process (``moetune.bench.model_worker``): ``moetune-bf16``,
``transformers-bf16``, ``moetune-fp32``, ``transformers-fp32``. They are loaded one after another, then
stepped in turns: every repetition runs one forward + backward in each live variant before the next
repetition starts, so a change in machine load hits all of them alike. Per variant: load time, resident size
after loading, peak resident size (load and steps), median forward / backward times, tokens per second and
the loss (the same weights and tokens: the fp32 losses agree, the bf16 ones within bf16 rounding), and for
moetune the ratio to transformers in the same dtype. The method is in ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from moetune.atomic import write_text_atomically
from moetune.bench.model_worker import VARIANTS, StepShape
from moetune.bench.report import BUSY_LOAD, Columns, dtype_name, print_row, print_table_head
from moetune.bench.timing import TimingPolicy
from moetune.errors import ConfigError, MoetuneError
from moetune.sysinfo import cpu_info, default_num_threads
from moetune.testing.wide import WideShape, write_wide_checkpoint

REQUIRED_KEYS = (
    "variant", "impl", "dtype", "experts_impl", "layers", "hidden", "experts", "intermediate", "top_k",
    "batch", "seq", "threads", "load_s", "rss_after_load_mib", "peak_rss_mib", "fwd_ms", "bwd_ms",
    "tokens_per_s", "samples", "loss", "vs_transformers", "note",
)  # fmt: skip
MIB = 2**20


@dataclass(frozen=True)
class ModelBenchConfig:
    """What to run and how to time it. The defaults are the full benchmark."""

    shape: WideShape = WideShape(layers=8, experts=64, top_k=8, hidden=1024, intermediate=512, vocab=8192)
    checkpoint: Path | None = None  # an existing checkpoint instead of writing ``shape``
    batch: int = 1
    seq: int = 512
    lora_rank: int = (
        0  # 0: experts frozen, the rest trained, no optimizer; r: LoRA training steps (train_step)
    )
    accumulation: int = 1  # micro-batches per step
    variants: tuple[str, ...] = tuple(VARIANTS)
    timing: TimingPolicy = field(
        default_factory=lambda: TimingPolicy(warmup=1, reps=3, budget_s=120.0, max_call_s=600.0)
    )
    threads: int | None = None  # None: physical cores (the engine's default), for every variant
    workdir: Path | None = None  # where the checkpoint is written (a temporary directory inside, removed)
    seed: int = 0

    @property
    def step_shape(self) -> StepShape:
        """What each worker's step runs."""
        return StepShape(self.batch, self.seq, self.lora_rank, self.accumulation, self.seed)

    @property
    def tokens_per_step(self) -> int:
        return self.accumulation * self.batch * self.seq

    def describe_step(self) -> str:
        """One phrase for the header: what a step trains."""
        micro = f"{self.accumulation} x " if self.accumulation > 1 else ""
        tokens = f"{micro}batch {self.batch} x {self.seq} tokens"
        if self.lora_rank:
            return f"{tokens}, LoRA r={self.lora_rank} on attention + routed experts, AdamW step"
        return f"{tokens}, experts frozen, the rest trained"

    def validate(self) -> None:
        """Raise :class:`ConfigError` listing every bad field at once."""
        s = self.shape
        problems = [
            f"{name} must be a positive integer; got {value}"
            for name, value in (
                ("layers", s.layers),
                ("experts", s.experts),
                ("top_k", s.top_k),
                ("hidden", s.hidden),
                ("intermediate", s.intermediate),
                ("vocab", s.vocab),
                ("batch", self.batch),
                ("seq", self.seq),
                ("accumulation", self.accumulation),
            )
            if value < 1
        ]
        if self.lora_rank < 0:
            problems.append(f"lora_rank must be >= 0 (0: experts frozen, no LoRA); got {self.lora_rank}")
        if s.top_k > s.experts:
            problems.append(f"top_k must be <= experts ({s.experts}); got {s.top_k}")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown or not self.variants:
            problems.append(f"variants {list(self.variants)}: choose one or more of {', '.join(VARIANTS)}")
        t = self.timing
        if t.reps < 1 or t.warmup < 0 or t.budget_s <= 0 or t.max_call_s <= 0:
            problems.append(
                f"reps >= 1, warmup >= 0, budget_s > 0 and max_call_s > 0 required; got reps={t.reps}, "
                f"warmup={t.warmup}, budget_s={t.budget_s}, max_call_s={t.max_call_s}"
            )
        if self.threads is not None and self.threads < 1:
            problems.append(f"threads must be >= 1; got {self.threads}")
        if self.checkpoint is not None and not (self.checkpoint / "config.json").is_file():
            problems.append(f"checkpoint {self.checkpoint} has no config.json")
        if self.workdir is not None and not self.workdir.is_dir():
            problems.append(f"workdir {self.workdir} is not a directory")
        if problems:
            raise ConfigError("model benchmark: " + "; ".join(problems))


QUICK = ModelBenchConfig(
    shape=WideShape(
        layers=2,
        experts=16,
        top_k=4,
        hidden=256,
        intermediate=128,
        heads=4,
        kv_heads=2,
        head_dim=64,
        vocab=1024,
    ),  # fmt: skip
    seq=128,
    timing=TimingPolicy(warmup=1, reps=2, budget_s=10.0, max_call_s=120.0),
)
"""``--quick``: 2 layers, H = 256, 16 experts of I = 128, top-4, sequence 128 (seconds per variant)."""


class _Worker:
    """One variant's process: requests on its stdin, one JSON answer per line on its stdout."""

    def __init__(
        self, name: str, checkpoint: Path, config: ModelBenchConfig, threads: int, log: Path
    ) -> None:
        self.name = name
        self.log = log
        self.note = ""
        cmd = [
            sys.executable, "-m", "moetune.bench.model_worker", name, str(checkpoint), "--threads", str(threads),
            *config.step_shape.args(),
        ]  # fmt: skip
        self._stderr = log.open("w")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True, bufsize=1
        )

    @property
    def alive(self) -> bool:
        return not self.note

    def request(self, command: str | None, timeout: float) -> dict[str, Any] | None:
        """Send ``command`` (None: only wait for the next answer) and read the answer; on a timeout or a
        dead process, stop the process, keep why in ``note`` and return None."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            if command is not None:
                self.proc.stdin.write(command + "\n")
                self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
            line = self.proc.stdout.readline() if ready else None
        except BrokenPipeError:
            line = ""
        if line:
            return json.loads(line)
        self.stop()
        if line is None:
            self.note = f"stopped: one call took longer than max_call_s = {timeout:g} s"
        else:
            tail = self.log.read_text()[-2000:] if self.log.is_file() else ""
            self.note = f"failed (exit {self.proc.returncode}); its log ends:\n{tail}"
        return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._stderr.close()


def _record(
    name: str,
    config: ModelBenchConfig,
    shape: WideShape,
    threads: int,
    load: dict,
    steps: list,
    end: dict | None,
) -> dict[str, Any]:
    variant = VARIANTS[name]
    fwd = statistics.median(s["fwd_s"] for s in steps) if steps else None
    bwd = statistics.median(s["bwd_s"] for s in steps) if steps else None
    opt = statistics.median(s["opt_s"] for s in steps) if steps else None
    cpu = statistics.median(s["cpu_s"] for s in steps) if steps else None
    return {
        "variant": name,
        "impl": variant.impl,
        "dtype": dtype_name(variant.dtype),
        "experts_impl": load.get("experts"),
        "layers": shape.layers,
        "hidden": shape.hidden,
        "experts": shape.experts,
        "intermediate": shape.intermediate,
        "top_k": shape.top_k,
        "vocab": shape.vocab,
        "batch": config.batch,
        "seq": config.seq,
        "accumulation": config.accumulation,
        "lora_rank": config.lora_rank,
        "trainable_params": load.get("trainable"),
        "threads": threads,
        "load_s": load.get("load_s"),
        "rss_after_load_mib": load["rss_after_load"] / MIB if "rss_after_load" in load else None,
        "load_peak_rss_mib": load["load_peak_rss"] / MIB if "load_peak_rss" in load else None,
        "peak_rss_mib": None if end is None else end["peak_rss"] / MIB,
        "fwd_ms": None if fwd is None else 1e3 * fwd,
        "bwd_ms": None if bwd is None else 1e3 * bwd,
        "opt_ms": None if opt is None else 1e3 * opt,
        "cpu_s_per_step": cpu,
        "step_ms": None if fwd is None or bwd is None or opt is None else 1e3 * (fwd + bwd + opt),
        "tokens_per_s": None
        if fwd is None or bwd is None or opt is None
        else config.tokens_per_step / (fwd + bwd + opt),
        "samples": len(steps),
        "loss": steps[0]["loss"] if steps else None,
        "vs_transformers": None,
        "note": "",
    }


def _shape_of(checkpoint: Path) -> WideShape:
    """The fields of ``WideShape`` read back from a checkpoint's config (for the report)."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(checkpoint).get_text_config()

    def first(*names: str) -> int:
        return int(next((getattr(text, n) for n in names if getattr(text, n, None) is not None), 0))

    return WideShape(
        layers=text.num_hidden_layers,
        experts=first("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
        top_k=first("num_experts_per_tok", "moe_k"),
        hidden=text.hidden_size,
        intermediate=first("moe_intermediate_size", "intermediate_size"),
        vocab=text.vocab_size,
    )


def _run_variants(
    checkpoint: Path, config: ModelBenchConfig, threads: int, logs: Path, progress: TextIO
) -> dict[str, tuple[dict, list, dict | None, str]]:
    """Load each variant in turn, step them in alternation, end them: name -> (load, steps, end, note).
    One line per load and per step goes to ``progress``."""
    timing = config.timing
    total = timing.warmup + timing.reps

    def say(w: _Worker, what: str) -> None:
        print(f"moetune bench model: {w.name}: {what if w.alive else w.note.splitlines()[0]}", file=progress)

    load_timeout = max(timing.max_call_s, 600.0)  # a load may take longer than a step
    workers: list[_Worker] = []
    loads: dict[str, dict] = {}
    steps: dict[str, list] = {}
    try:
        workers = [_Worker(n, checkpoint, config, threads, logs / f"{n}.log") for n in config.variants]
        for w in workers:  # imports overlap; loads run one at a time, undisturbed by each other
            ready = w.request(None, load_timeout)
            loads[w.name] = (w.request("load", load_timeout) if ready else None) or {}
            steps[w.name] = []
            say(w, f"loaded in {loads[w.name].get('load_s', 0):.1f} s")
        for rep in range(timing.warmup + timing.reps):
            for w in workers:
                timed = steps[w.name]
                if not w.alive or (timed and sum(s["fwd_s"] + s["bwd_s"] for s in timed) >= timing.budget_s):
                    continue
                answer = w.request("step", timing.max_call_s)
                warm = " (warm-up)" if rep < timing.warmup else ""
                say(
                    w,
                    f"step {rep + 1}/{total}{warm}: {answer['fwd_s'] + answer['bwd_s']:.2f} s"
                    if answer
                    else "",
                )
                if answer is None:
                    continue
                if rep >= timing.warmup or answer["fwd_s"] + answer["bwd_s"] >= timing.budget_s:
                    timed.append(answer)  # a warm-up step longer than the budget is the only sample
        ends = {w.name: w.request("quit", load_timeout) if w.alive else None for w in workers}
    finally:
        for w in workers:
            w.stop()
    return {w.name: (loads[w.name], steps[w.name], ends[w.name], w.note) for w in workers}


@dataclass(frozen=True)
class TableStyle:
    """How a run is printed: the header's name, the columns, and the legend under the table."""

    title: str
    columns: Columns
    legend: str


def run_model_bench(
    config: ModelBenchConfig, out: TextIO | None = None, style: TableStyle | None = None
) -> list[dict[str, Any]]:
    """Write (or take) the checkpoint, run every variant, print the table to ``out`` (stdout) in ``style``
    (default: the model benchmark's) and return one record per variant (the keys of ``REQUIRED_KEYS`` and
    more)."""
    config.validate()
    out = out or sys.stdout
    style = style or MODEL_STYLE
    threads = config.threads or default_num_threads()
    load_avg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with tempfile.TemporaryDirectory(prefix="moetune-bench-model-", dir=config.workdir) as tmp:
        checkpoint = config.checkpoint
        if checkpoint is None:
            checkpoint = write_wide_checkpoint(Path(tmp) / "checkpoint", config.shape, seed=config.seed)
        shape = config.shape if config.checkpoint is None else _shape_of(checkpoint)
        _print_header(out, shape, config, threads, load_avg, style)
        results = _run_variants(checkpoint, config, threads, Path(tmp), sys.stderr)
    records = []
    for name, (load, steps, end, note) in results.items():
        rec = _record(name, config, shape, threads, load, steps, end)
        rec["note"], rec["load_avg_1m"] = note, load_avg
        records.append(rec)
    by_name = {r["variant"]: r for r in records}
    for rec in records:
        base = by_name.get(f"transformers-{rec['dtype']}")
        if rec["impl"] == "moetune" and base and base["step_ms"] is not None and rec["step_ms"] is not None:
            rec["vs_transformers"] = base["step_ms"] / rec["step_ms"]
    _print_table(out, records, style)
    return records


MODEL_COLUMNS: Columns = (
    ("variant", 20, "variant", "{}"),
    ("load s", 9, "load_s", "{:.1f}"),
    ("fwd ms", 10, "fwd_ms", "{:.0f}"),
    ("bwd ms", 10, "bwd_ms", "{:.0f}"),
    ("tokens/s", 10, "tokens_per_s", "{:.1f}"),
    ("RSS MiB", 10, "rss_after_load_mib", "{:.0f}"),
    ("peak MiB", 10, "peak_rss_mib", "{:.0f}"),
    ("loss", 9, "loss", "{:.4f}"),
    ("vs hf", 8, "vs_transformers", "{:.2f}x"),
)
MODEL_STYLE = TableStyle(
    "moetune bench model",
    MODEL_COLUMNS,
    "fwd/bwd ms: medians of alternated steps (one forward + backward of the LM loss); tokens/s = batch x seq / "
    "(fwd + bwd); RSS = resident after loading, peak = the process's high-water mark (load and steps); vs hf = "
    "transformers' step time in the same dtype / moetune's.",
)


def _print_header(
    out: TextIO,
    shape: WideShape,
    config: ModelBenchConfig,
    threads: int,
    load: float | None,
    style: TableStyle,
) -> None:
    from moetune.engine import resolve_compute_dtype

    cpu = cpu_info()
    print(
        f"{style.title} | {cpu.model} ({', '.join(cpu.isa) or 'no SIMD flags found'}), {threads} threads | "
        f"{shape.layers} layers, H={shape.hidden}, E={shape.experts} x I={shape.intermediate}, top-{shape.top_k}, "
        f"vocab {shape.vocab} | {config.describe_step()}",
        file=out,
    )
    if resolve_compute_dtype(torch.bfloat16) != torch.bfloat16:
        print(
            "note: no AMX-BF16/AVX512-BF16 here: bf16 GEMMs are emulated (slow); moetune's engine computes bf16 "
            "experts in fp32 tiles, everything else (and transformers' experts) computes in bf16",
            file=out,
        )
    if load is not None and load > BUSY_LOAD:
        print(f"warning: load average {load:.1f} before the run: other processes share the cores", file=out)
    print_table_head(out, style.columns)


def _print_table(out: TextIO, records: list[dict[str, Any]], style: TableStyle) -> None:
    for rec in records:
        print_row(out, rec, style.columns)
    print("\n" + style.legend, file=out)
    for rec in records:
        print(f"{rec['variant']}: experts computed by {rec['experts_impl'] or '-'}", file=out)
        if rec["note"]:
            print(f"{rec['variant']}: {rec['note']}", file=out)


@dataclass(frozen=True)
class Preset:
    """One command built on this runner: its name and help, its full and ``--quick`` configurations, its table."""

    prog: str
    description: str
    quick_help: str
    full: ModelBenchConfig
    quick: ModelBenchConfig
    style: TableStyle


MODEL_PRESET = Preset(
    "python bench/model.py",
    "Time training steps and measure peak host memory of a whole MoE model, moetune against transformers on "
    "the same weights, bf16 and fp32 (docs/benchmarks.md).",
    "a small model: 2 layers, H=256, 16 experts, seq 128",
    ModelBenchConfig(),
    QUICK,
    MODEL_STYLE,
)


def parser(preset: Preset) -> argparse.ArgumentParser:
    """The command line of ``preset``: every field of its configuration can be overridden."""
    p = argparse.ArgumentParser(prog=preset.prog, description=preset.description)
    p.add_argument("--quick", action="store_true", help=preset.quick_help)
    p.add_argument("--json", type=Path, metavar="PATH", help="write one JSON record per variant to PATH")
    p.add_argument(
        "--checkpoint", type=Path, help="benchmark this checkpoint instead of writing a random one"
    )
    p.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="variants to run")
    shape = p.add_argument_group("the random checkpoint (defaults: the full benchmark, or --quick's)")
    for name in ("layers", "experts", "top_k", "hidden", "intermediate", "vocab"):
        shape.add_argument(f"--{name.replace('_', '-')}", type=int)
    p.add_argument("--batch", type=int, help="sequences per micro-batch")
    p.add_argument("--seq", type=int, help="tokens per sequence")
    p.add_argument("--accumulation", type=int, help="micro-batches per step (gradient accumulation)")
    p.add_argument(
        "--lora-rank",
        type=int,
        help="LoRA rank on attention + experts, with an AdamW step (0: experts frozen)",
    )
    p.add_argument("--reps", type=int, help="timed steps per variant (median reported)")
    p.add_argument("--warmup", type=int, help="untimed steps per variant first")
    p.add_argument("--budget-s", type=float, help="stop a variant's repetitions once they add up to this")
    p.add_argument("--max-call-s", type=float, help="stop a variant whose one step takes longer than this")
    p.add_argument("--threads", type=int, help="torch threads of every variant (default: physical cores)")
    p.add_argument("--workdir", type=Path, help="where to write the checkpoint (default: the temp directory)")
    return p


def config_from_args(args: argparse.Namespace, preset: Preset = MODEL_PRESET) -> ModelBenchConfig:
    """The preset (full or ``--quick``) with every option the user gave applied on top."""
    config = preset.quick if args.quick else preset.full
    shape = {
        n: getattr(args, n)
        for n in ("layers", "experts", "top_k", "hidden", "intermediate", "vocab")
        if getattr(args, n) is not None
    }
    timing = {
        n: getattr(args, n)
        for n in ("reps", "warmup", "budget_s", "max_call_s")
        if getattr(args, n) is not None
    }
    fields = {
        "shape": dataclasses.replace(config.shape, **shape) if shape else None,
        "checkpoint": args.checkpoint,
        "variants": tuple(args.variants) if args.variants else None,
        "batch": args.batch,
        "seq": args.seq,
        "accumulation": args.accumulation,
        "lora_rank": args.lora_rank,
        "timing": dataclasses.replace(config.timing, **timing) if timing else None,
        "threads": args.threads,
        "workdir": args.workdir,
    }
    return dataclasses.replace(config, **{k: v for k, v in fields.items() if v is not None})


def _write_json(path: Path, records: list[dict[str, Any]]) -> None:
    write_text_atomically(path, json.dumps(records, indent=2) + "\n", durable=False)


def main(argv: list[str] | None = None, out: TextIO | None = None, preset: Preset = MODEL_PRESET) -> int:
    """``bench/model.py`` (or another ``preset``): parse, run, print, and with ``--json`` write the records.
    User errors exit 2."""
    args = parser(preset).parse_args(argv)
    try:
        config = config_from_args(args, preset)
        if args.json is not None and not args.json.parent.is_dir():
            raise ConfigError(f"--json {args.json}: directory {args.json.parent} does not exist")
        records = run_model_bench(config, out, preset.style)
    except (ConfigError, MoetuneError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json is not None:
        _write_json(args.json, records)
        print(f"wrote {len(records)} records to {args.json}", file=out or sys.stdout)
    return 0
