"""The training-step benchmark: tokens/s and peak memory of full LoRA training steps of a small but not trivial
MoE model, moetune against transformers + stock PEFT with transformers' ``grouped_mm`` experts, on the same CPU
and the same weights, side by side in one run. ``bench/train_step.py`` runs :func:`main`.

A step is what a LoRA fine-tune runs per optimizer step: ``accumulation`` micro-batches (forward and backward
of the causal-LM loss / accumulation each, gradients accumulating), then one AdamW step over the LoRA
parameters (rank r on the attention projections and the routed experts). moetune trains through its own path
(``moetune.load_model`` -> ``moetune.attach_lora``: expert LoRA in the CPU engine); transformers loads the same
checkpoint with ``experts_implementation="grouped_mm"`` and stock PEFT puts LoRA on the same modules (experts
through ``target_parameters``). Both variants run in one dtype: bf16 where the CPU has bf16 dot products
(AMX-BF16 or AVX512-BF16), else fp32 (emulated bf16 GEMMs would time the emulation); ``--variants`` overrides.
Each variant is its own process (its peak RSS is its own) and the variants step in turns, so machine load
hits both alike (``moetune.bench.model`` runs them). Printed per variant: tokens/s, the step's forward,
backward and optimizer times, RSS after loading and peak RSS, the first step's loss (the same weights, B = 0
LoRA and the same tokens: the two agree to the dtype's rounding), and moetune's speed relative to transformers.
"""

from __future__ import annotations

from typing import TextIO

import torch

from moetune.bench.model import ModelBenchConfig, Preset, TableStyle
from moetune.bench.model import main as run_preset
from moetune.bench.report import Columns, dtype_name
from moetune.bench.timing import TimingPolicy
from moetune.sysinfo import cpu_info
from moetune.testing.wide import WideShape

LORA_RANK = 8
ACCUMULATION = 4


def native_dtype() -> torch.dtype:
    """bf16 where the CPU has bf16 dot products (AMX-BF16, AVX512-BF16), else fp32."""
    return torch.bfloat16 if cpu_info().native_bf16_gemm else torch.float32


def default_variants() -> tuple[str, ...]:
    """moetune and transformers in :func:`native_dtype`."""
    name = dtype_name(native_dtype())
    return (f"moetune-{name}", f"transformers-{name}")


def _config(shape: WideShape, seq: int, timing: TimingPolicy) -> ModelBenchConfig:
    return ModelBenchConfig(
        shape=shape,
        seq=seq,
        lora_rank=LORA_RANK,
        accumulation=ACCUMULATION,
        variants=default_variants(),
        timing=timing,
    )


FULL = _config(
    WideShape(
        layers=4, experts=64, top_k=8, hidden=1024, intermediate=512, heads=8, kv_heads=4, head_dim=128
    ),
    seq=1024,
    timing=TimingPolicy(warmup=1, reps=3, budget_s=300.0, max_call_s=900.0),
)
"""The benchmark: 4 layers, H = 1024, 64 experts of I = 512, top-8 (805 MB of bf16 experts), 4 x 1024 tokens."""

QUICK = _config(
    WideShape(layers=2, experts=32, top_k=8, hidden=512, intermediate=256, heads=8, kv_heads=4, head_dim=64),
    seq=512,
    timing=TimingPolicy(warmup=1, reps=2, budget_s=60.0, max_call_s=300.0),
)
"""``--quick`` (what ``moetune bench all`` runs): 2 layers, H = 512, 32 experts of I = 256, top-8, 4 x 512."""

COLUMNS: Columns = (
    ("variant", 20, "variant", "{}"),
    ("tokens/s", 10, "tokens_per_s", "{:.1f}"),
    ("step ms", 10, "step_ms", "{:.0f}"),
    ("fwd ms", 10, "fwd_ms", "{:.0f}"),
    ("bwd ms", 10, "bwd_ms", "{:.0f}"),
    ("opt ms", 9, "opt_ms", "{:.0f}"),
    ("CPU s", 8, "cpu_s_per_step", "{:.1f}"),
    ("RSS MiB", 10, "rss_after_load_mib", "{:.0f}"),
    ("peak MiB", 10, "peak_rss_mib", "{:.0f}"),
    ("loss", 9, "loss", "{:.4f}"),
    ("vs hf", 8, "vs_transformers", "{:.2f}x"),
)

STYLE = TableStyle(
    "bench/train_step.py",
    COLUMNS,
    "step = accumulation micro-batches (forward + backward of loss / accumulation) + one AdamW step over the LoRA "
    "parameters; ms are medians of alternated steps (fwd / bwd summed over the micro-batches); tokens/s = "
    "accumulation x batch x seq / step; CPU s = the process's CPU time per step, all threads (steadier than wall time on a shared machine); RSS = resident after loading and attaching LoRA, peak = the process's "
    "high-water mark; loss = mean over the micro-batches; vs hf = transformers + PEFT step time / moetune's, "
    "same dtype.",
)

PRESET = Preset(
    "python bench/train_step.py",
    "Full LoRA training steps (gradient accumulation + AdamW) of a small MoE model: moetune against "
    "transformers + PEFT with grouped_mm experts on the same CPU, tokens/s and peak memory, side by side "
    "(docs/performance.md).",
    "the small model moetune bench all runs: 2 layers, H=512, 32 experts of I=256, 4 x 512 tokens",
    FULL,
    QUICK,
    STYLE,
)


def main(argv: list[str] | None = None, out: TextIO | None = None) -> int:
    """``bench/train_step.py``: parse, run, print, and with ``--json`` write the records. User errors exit 2."""
    return run_preset(argv, out, PRESET)
