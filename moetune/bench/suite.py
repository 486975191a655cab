"""``moetune bench all``: every benchmark at one size, one JSON and one Markdown table with the runtime tuple.

Benchmarks (registered in ``SUITE``, run in this order): ``engine`` (the expert engine against a loop and
transformers' experts, with the roofline), ``scaling`` (the engine's thread scaling, 1 .. N threads),
``model`` (whole-model forward + backward against transformers), ``train_step`` (full LoRA training steps
against transformers + PEFT), ``pipeline`` (the CPU/device schedule with a simulated device), and the scripts
under the source tree's ``bench/`` folder (``formats``, ``overhead``, ``residency``, ``profile_engine``,
``row_padding``, ``huge_pages``, ``store_layout``, ``products``), run as
subprocesses (recorded as failed, naming the missing script, where moetune is installed without its source
tree).

Sizes: ``tiny`` (seconds: checks that everything runs, what the unit test uses), ``small`` (the default:
meant for minutes on 2 idle cores; 16 measured on a heavily shared 2-core machine), ``full`` (each
benchmark's own full preset: hours on small machines). A benchmark that fails is recorded with its error and
the others still run; the command then exits 1.

The output folder gets ``bench-all.json`` (``{"runtime", "size", "command", "benchmarks": [{"name",
"status", "seconds", "shapes", "headline", "records", "output", "error"}]}``) and ``bench-all.md`` (the
runtime tuple, a summary row per benchmark, then each benchmark's printed table), both written atomically.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass, replace
from pathlib import Path
from typing import Any, TextIO, cast

from moetune.atomic import write_text_atomically
from moetune.errors import ConfigError
from moetune.registry import Registry

SIZES = ("tiny", "small", "full")
JSON_NAME, MARKDOWN_NAME = "bench-all.json", "bench-all.md"
SOURCE_BENCH = Path(__file__).resolve().parents[2] / "bench"  # the scripts, when run from a source tree


@dataclass
class Context:
    """What every benchmark of one run shares: the size, the torch thread count, a scratch folder, the output
    stream its table goes to, and the shapes it ran (filled in by the benchmark, for the report)."""

    size: str
    threads: int
    workdir: Path
    out: TextIO
    shapes: dict[str, Any] = field(default_factory=dict)


Bench = Callable[[Context], list[dict[str, Any]]]
SUITE: Registry[Bench] = Registry("benchmark")
ORDER: list[str] = []  # registration order: the order of the run and of the report
HEADLINES: dict[str, Callable[[list[dict[str, Any]]], str]] = {}


def suite_bench(
    name: str, headline: Callable[[list[dict[str, Any]]], str] | None = None
) -> Callable[[Bench], Bench]:
    """Register a benchmark of the suite, with the one line its summary row shows."""

    def add(fn: Bench) -> Bench:
        SUITE.register(name)(fn)
        ORDER.append(name)
        if headline is not None:
            HEADLINES[name] = headline
        return fn

    return add


def _shapes(config: Any) -> dict[str, Any]:
    """A configuration as JSON-able values (dtypes and enums as their names)."""
    raw = asdict(config) if is_dataclass(config) and not isinstance(config, type) else dict(config)
    return json.loads(json.dumps(raw, default=str))


def _engine_config(ctx: Context) -> Any:
    from moetune.bench.engine import QUICK, EngineBenchConfig
    from moetune.bench.timing import TimingPolicy
    from moetune.engine import ActivationPolicy, TrainMode

    if ctx.size == "full":
        return replace(EngineBenchConfig(), threads=ctx.threads)
    if ctx.size == "small":
        return replace(QUICK, threads=ctx.threads)
    return EngineBenchConfig(
        experts=(8,),
        tokens=(16,),
        hidden=64,
        intermediate=32,
        top_k=2,
        modes=(TrainMode.LORA,),
        policies=(ActivationPolicy.RETAIN,),
        timing=TimingPolicy(warmup=0, reps=1, budget_s=1.0, max_call_s=10.0),
        gemm_rows=(16,),
        bandwidth_bytes=1 << 20,
        threads=ctx.threads,
    )


def _fraction_headline(records: list[dict[str, Any]]) -> str:
    best = max(records, key=lambda r: r.get("roofline_fraction") or 0.0)
    return f"best {best['case']}: {best['roofline_fraction']:.0%} of roofline"


@suite_bench("engine", _fraction_headline)
def _engine(ctx: Context) -> list[dict[str, Any]]:
    from moetune.bench.engine import run_engine_bench

    config = _engine_config(ctx)
    ctx.shapes = _shapes(config)
    return run_engine_bench(config, ctx.out)


def _scaling_headline(records: list[dict[str, Any]]) -> str:
    top = max(records, key=lambda r: r.get("threads") or 0)
    keys = [k for k in ("speedup", "efficiency") if k in top]
    return (
        ", ".join(f"{k} {top[k]:.2f}" for k in keys) + f" at {top.get('threads')} threads ({top.get('case')})"
    )


@suite_bench("scaling", _scaling_headline)
def _scaling(ctx: Context) -> list[dict[str, Any]]:
    from moetune.bench.scaling import run_thread_scaling

    config = _engine_config(ctx)
    if ctx.size != "full":  # one case per mode at the largest T: the curve, not the grid
        config = replace(config, tokens=config.tokens[-1:], baselines=())
    counts = tuple(sorted({1, ctx.threads}))
    ctx.shapes = {**_shapes(config), "thread_counts": list(counts)}
    return run_thread_scaling(config, counts, ctx.out)


def _vs_hf_headline(records: list[dict[str, Any]]) -> str:
    parts = [
        f"{r['variant']} {r['tokens_per_s']:.0f} tokens/s"
        + (f" ({r['vs_transformers']:.2f}x transformers)" if r.get("vs_transformers") else "")
        for r in records
        if r.get("tokens_per_s") is not None
    ]
    return "; ".join(parts) or "no step finished"


def _tiny_model(config: Any) -> Any:
    from moetune.bench.timing import TimingPolicy
    from moetune.testing.wide import WideShape

    shape = WideShape(
        layers=2, experts=8, top_k=2, hidden=64, intermediate=32, heads=2, kv_heads=1, head_dim=32, vocab=128
    )
    return replace(
        config, shape=shape, seq=16, timing=TimingPolicy(warmup=0, reps=1, budget_s=10.0, max_call_s=120.0)
    )


def _model_like(ctx: Context, full: Any, quick: Any, style: Any) -> list[dict[str, Any]]:
    from moetune.bench.model import run_model_bench

    config = {"full": full, "small": quick, "tiny": _tiny_model(quick)}[ctx.size]
    config = replace(config, threads=ctx.threads, workdir=ctx.workdir)
    ctx.shapes = _shapes(config)
    return run_model_bench(config, ctx.out, style)


@suite_bench("model", _vs_hf_headline)
def _model(ctx: Context) -> list[dict[str, Any]]:
    from moetune.bench.model import MODEL_STYLE, QUICK, ModelBenchConfig
    from moetune.bench.train_step import default_variants

    variants = default_variants()  # the dtype the CPU computes natively; bench/model.py runs all four
    return _model_like(
        ctx, replace(ModelBenchConfig(), variants=variants), replace(QUICK, variants=variants), MODEL_STYLE
    )


@suite_bench("train_step", _vs_hf_headline)
def _train_step(ctx: Context) -> list[dict[str, Any]]:
    from moetune.bench.train_step import FULL, QUICK, STYLE

    return _model_like(ctx, FULL, QUICK, STYLE)


def _pipeline_headline(records: list[dict[str, Any]]) -> str:
    """Hidden fraction and speed against serial, threaded run (replay on the virtual clock)."""
    return "; ".join(
        f"{r['schedule']} hides {r['hidden_fraction']:.0%} ({r['replay_hidden_fraction']:.0%}), "
        f"{r['vs_serial']:.2f}x ({r['replay_vs_serial']:.2f}x) serial"
        for r in records
    )


@suite_bench("pipeline", _pipeline_headline)
def _pipeline(ctx: Context) -> list[dict[str, Any]]:
    from moetune.bench.pipeline import DeviceModel, PipelineShape, run_pipeline_bench

    shape = {
        "full": PipelineShape(),
        "small": PipelineShape(
            layers=2, tokens=256, hidden=512, experts=16, intermediate=256, shared_intermediate=512
        ),
        "tiny": PipelineShape(
            layers=2,
            tokens=16,
            hidden=64,
            heads=2,
            kv_heads=1,
            head_dim=32,
            experts=4,
            intermediate=32,
            shared_intermediate=64,
            top_k=2,
        ),  # fmt: skip
    }[ctx.size]
    device = DeviceModel()
    ctx.shapes = {**_shapes(shape), **_shapes(device)}
    return run_pipeline_bench(
        shape, device, reps=1 if ctx.size == "tiny" else 3, threads=ctx.threads, out=ctx.out
    )


SCRIPT_ARGS: dict[str, dict[str, str]] = {  # script -> size -> its options ("full": its own defaults)
    "formats": {
        "tiny": "--experts 4 --hidden 128 --inter 64 --tokens 16 --top-k 2 --reps 1",
        "small": "--experts 16 --hidden 1024 --inter 512 --tokens 256 --reps 3",
    },
    "overhead": {
        "tiny": "--experts 8 --tokens 32 --top-k 2 --reps 1",
        "small": "--experts 64 --tokens 512 --reps 3",
    },
    "residency": {
        "tiny": "--layers 2 --experts 4 --hidden 64 --inter 32 --tokens 16 --reps 1 --budget-layers 2",
        "small": "--layers 4 --experts 16 --hidden 512 --inter 256 --tokens 128 --reps 2",
    },
    "profile_engine": {
        "tiny": "--experts 8 --tokens 16 --modes lora",
        "small": "--experts 16 --tokens 128 512",
    },
    "row_padding": {
        "tiny": "--cols 64 2048 --rows 1 9 --tokens 16 --experts 4 --reps 1",
        "small": "--rows 1 8 32 --experts 32 --tokens 128 512 --reps 3",
    },
    "huge_pages": {
        "tiny": "--experts 4 --hidden 64 --inter 32 --tokens 16 --top-k 2 --reps 1 --rounds 1",
        "small": "--experts 32 --tokens 128 512 --reps 2 --rounds 2",
    },
    "store_layout": {
        "tiny": "--experts 4 --tokens 16 --reps 1",
        "small": "--experts 32 --tokens 128 512 --reps 3",
    },
    "products": {  # (the -a8 labels only where the CPU has them: bench/formats.py times them in steps)
        "tiny": "--experts 2 --hidden 128 --inter 64 --rows 1 9 --reps 1 --formats int8 int4-g64 fp8_block mxfp4",
        "small": "--experts 16 --rows 1 8 32 128 --reps 3 --formats int8 int4-g64 fp8_block mxfp4",
    },
}
# scripts that write files: given a folder under the run's scratch folder
DIR_SCRIPTS = ("residency", "store_layout")


def _script_bench(name: str) -> Bench:
    def run(ctx: Context) -> list[dict[str, Any]]:
        script = SOURCE_BENCH / f"{name}.py"
        if not script.is_file():
            raise FileNotFoundError(
                f"{script} not found: moetune runs bench/ scripts from its source tree only"
            )
        args = SCRIPT_ARGS[name].get(ctx.size, "").split() + ["--threads", str(ctx.threads)]
        if name in DIR_SCRIPTS:
            (ctx.workdir / name).mkdir(parents=True, exist_ok=True)
            args += ["--dir", str(ctx.workdir / name)]
        ctx.shapes = {"argv": " ".join(args)}
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(SOURCE_BENCH.parent), os.environ.get("PYTHONPATH")])
            ),
        }
        done = subprocess.run(
            [sys.executable, str(script), *args], capture_output=True, text=True, env=env, cwd=ctx.workdir
        )
        print(done.stdout, end="", file=ctx.out)
        if done.returncode != 0:
            raise RuntimeError(
                f"{script.name} {' '.join(args)} exited {done.returncode}; stderr ends:\n{done.stderr[-2000:]}"
            )
        return []  # these scripts print tables only; their output is kept whole

    return run


for _name in SCRIPT_ARGS:
    suite_bench(_name, lambda records: "see its table")(_script_bench(_name))


class _Tee(io.TextIOBase):
    """Writes to a buffer (kept for the report) and to a live stream (the user sees progress)."""

    def __init__(self, live: TextIO) -> None:
        self.buffer_ = io.StringIO()
        self.live = live

    def write(self, text: str) -> int:
        self.buffer_.write(text)
        self.live.write(text)
        return len(text)

    def flush(self) -> None:
        self.live.flush()


def run_suite(
    out_dir: Path,
    size: str = "small",
    threads: int | None = None,
    only: tuple[str, ...] = (),
    command: str = "moetune bench all",
    live: TextIO | None = None,
) -> dict[str, Any]:
    """Run the benchmarks (all, or those named in ``only``) at ``size``; write ``bench-all.json`` and
    ``bench-all.md`` into ``out_dir`` (atomically) and return what the JSON holds.

    Bad arguments raise ``ConfigError`` before anything runs."""
    from moetune.bench.runtime import markdown, runtime_info
    from moetune.engine.threads import set_engine_threads

    problems = []
    if size not in SIZES:
        problems.append(f"size {size!r}: choose one of {', '.join(SIZES)}")
    unknown = [n for n in only if n not in SUITE]
    if unknown:
        problems.append(f"benchmarks {unknown}: choose from {', '.join(ORDER)}")
    if out_dir.exists() and not out_dir.is_dir():
        problems.append(f"output folder {out_dir} is a file: name a folder (made if missing)")
    if threads is not None and threads < 1:
        problems.append(f"threads must be >= 1; got {threads}")
    if problems:
        raise ConfigError("moetune bench all: " + "; ".join(problems))
    out_dir.mkdir(parents=True, exist_ok=True)
    live = live or sys.stdout
    threads = set_engine_threads(threads)
    result: dict[str, Any] = {
        "runtime": runtime_info(threads),
        "size": size,
        "command": command,
        "benchmarks": [],
    }
    for name in [n for n in ORDER if not only or n in only]:
        print(f"\n=== moetune bench all: {name} ({size}) ===", file=live, flush=True)
        tee = _Tee(live)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix=f"moetune-bench-{name}-") as tmp:
            ctx = Context(size, threads, Path(tmp), cast(TextIO, tee))
            entry: dict[str, Any] = {"name": name, "status": "ok", "error": "", "headline": "", "records": []}
            try:
                with contextlib.redirect_stdout(tee):
                    entry["records"] = SUITE.get(name)(ctx)
                entry["headline"] = HEADLINES[name](entry["records"]) if name in HEADLINES else ""
            except Exception:  # recorded and reported; the other benchmarks still run
                entry["status"] = "failed"
                entry["error"] = traceback.format_exc()
                print(f"moetune bench all: {name} failed:\n{entry['error']}", file=live, flush=True)
            finally:
                set_engine_threads(threads)  # a benchmark may change the process-wide count
        entry.update(seconds=time.perf_counter() - start, shapes=ctx.shapes, output=tee.buffer_.getvalue())
        result["benchmarks"].append(entry)
    write_text_atomically(
        out_dir / JSON_NAME, json.dumps(result, indent=2, default=str) + "\n", durable=False
    )
    write_text_atomically(out_dir / MARKDOWN_NAME, markdown(result), durable=False)
    print(f"\nmoetune bench all: wrote {out_dir / JSON_NAME} and {out_dir / MARKDOWN_NAME}", file=live)
    return result
