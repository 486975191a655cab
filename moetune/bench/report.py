"""The engine benchmark's printed table: a one-line header about the machine, one row per case, notes."""

from __future__ import annotations

from typing import Any, TextIO

import torch

from moetune.bench.machine import Roofline
from moetune.sysinfo import CpuInfo

BUSY_LOAD = 0.5  # a 1-minute load average above this means another process was using a core

Columns = tuple[tuple[str, int, str, str], ...]  # (title, width, record key, format) per column

ENGINE_COLUMNS: Columns = (
    ("case", 28, "case", "{}"),
    ("fwd ms", 10, "fwd_ms", "{:.1f}"),
    ("bwd ms", 10, "bwd_ms", "{:.1f}"),
    ("TFLOP/s", 10, "tflops", "{:.3g}"),
    ("roofline ms", 13, "roofline_ms", "{:.1f}"),
    ("of roofline", 13, "roofline_fraction", "{:.1%}"),
    ("saved MiB", 11, "saved_mib", "{:.1f}"),
    ("vs loop", 9, "vs_loop", "{:.1f}x"),
    ("vs hf", 9, "vs_hf", "{:.1f}x"),
)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bf16"``, ``torch.float32`` -> ``"fp32"``."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}[
        dtype
    ]


def print_header(
    out: TextIO,
    cpu: CpuInfo,
    threads: int,
    weight_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    roofline: Roofline,
    load: float | None,
) -> None:
    """One line: machine, threads, dtypes, the measured peaks and bandwidth; then a note when bf16 is emulated
    and a warning when other processes were busy (``load``: the 1-minute load average before the run)."""
    peak = roofline.peak
    isa = ", ".join(cpu.isa) or "no SIMD flags found"
    print(
        f"moetune bench engine | {cpu.model} ({isa}), {threads} threads | {dtype_name(weight_dtype)} weights, "
        f"engine computes in {dtype_name(compute_dtype)} | GEMM peak bf16 {peak.by_dtype[torch.bfloat16]:.3f}, "
        f"fp32 {peak.by_dtype[torch.float32]:.3f} TFLOP/s | read bandwidth {roofline.bandwidth_gbs:.1f} GB/s",
        file=out,
    )
    best = peak.best_shape
    where = f"{best.name} [{best.m},{best.k}]x[{best.k},{best.n}]"
    if peak.best_dtype != weight_dtype:
        print(
            f"note: {dtype_name(weight_dtype)} GEMMs are emulated on this CPU (no AMX-BF16/AVX512-BF16), slower "
            f"than {dtype_name(peak.best_dtype)}; the roofline uses the {dtype_name(peak.best_dtype)} peak "
            f"{peak.best:.3f} TFLOP/s ({where}; see docs/benchmarks.md)",
            file=out,
        )
    else:
        print(f"roofline peak: {dtype_name(peak.best_dtype)} {peak.best:.3f} TFLOP/s ({where})", file=out)
    if load is not None and load > BUSY_LOAD:
        print(
            f"warning: load average {load:.1f} on {cpu.logical_cpus} CPUs before the run: other processes share "
            "the cores, so these timings are noisy (fewer --threads than free cores helps)",
            file=out,
        )


def print_table_head(out: TextIO, columns: Columns = ENGINE_COLUMNS) -> None:
    """The column titles (first left-aligned, the rest right-aligned) and a rule."""
    line = "".join(title.ljust(w) if i == 0 else title.rjust(w) for i, (title, w, _, _) in enumerate(columns))
    print(line, file=out)
    print("-" * len(line), file=out, flush=True)


def print_row(out: TextIO, record: dict[str, Any], columns: Columns = ENGINE_COLUMNS) -> None:
    """One record; a value that was not measured prints as ``-``."""
    cells = []
    for i, (_, width, key, fmt) in enumerate(columns):
        value = record.get(key)
        text = "-" if value is None else fmt.format(value)
        cells.append(text.ljust(width) if i == 0 else text.rjust(width))
    print("".join(cells), file=out, flush=True)


def print_notes(out: TextIO, records: list[dict[str, Any]]) -> None:
    """What the columns mean, and why any baseline is missing."""
    print(
        "\nroofline = max(GEMM FLOPs / peak, expert weight bytes read / bandwidth); of roofline = roofline / "
        "(fwd + bwd).\nvs loop / vs hf = baseline fwd+bwd time / engine fwd+bwd time; baselines hold the same "
        f"weights computed in {records[0]['baseline_dtype'] if records else '-'} (--baseline-dtype): loop = "
        "per-expert eager autograd loop (transformers v4 style); hf = transformers Qwen3MoeExperts grouped_mm "
        "(+ PEFT target_parameters in lora mode). saved MiB = activations the engine keeps for backward.",
        file=out,
    )
    beat = [rec["case"] for rec in records if rec["roofline_fraction"] > 1.0]
    if beat:
        print(
            f"note: {', '.join(beat)} ran faster than the roofline allows, so the peak or bandwidth measurement "
            "was disturbed (another process busy then?); rerun on an idle machine",
            file=out,
        )
    seen = set()
    for rec in records:
        for name in ("loop", "hf"):
            note = rec[f"{name}_note"]
            key = (name, rec["E"], rec["T"], rec["mode"], note)
            if note and key not in seen:
                seen.add(key)
                print(f"vs {name}, E={rec['E']} T={rec['T']} {rec['mode']}: {note}", file=out)
