"""Expert stores as written before and as written now, side by side in one process: an engine step on each one's
memory-mapped weights.

    python bench/store_layout.py [--formats bf16 int8 int4-g64 fp8_block] [--tokens 128 2048] [--experts 128]
                                 [--modes lora frozen] [--reps 5] [--threads 1] [--dir DIR]

A store file is memory-mapped and its tensors are used where they lie (``moetune.store``). Written with
safetensors' own layout (``before``: the data section wherever the header's length puts it, 8-byte aligned;
dense bf16 rows contiguous), its weights sit 0-56 bytes off a cache line; written now (``StoreWriter``: the data
section on a page, the weights first, dense rows as the engine pads them, ``DenseExperts.state_tensors``) they
start on one. Per format, one layer of ``--experts`` experts (H = 2048, I = 768, Gaussian) is written both ways
into ``--dir`` (a temporary folder by default), each mapped and paged in, and one engine step (forward +
backward, k = 8, LoRA r = 8 or frozen) timed on each in turn; printed: where each file's weights start relative
to a 64-byte line, their row stride, median and minimum process CPU time over reps, before / now (> 1: now is
faster), and whether both steps' outputs are equal bit for bit (``=``).

Not a test: the ratios are this machine's, at the moment it ran (``docs/performance.md``, "Stores: weights on
cache lines").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from moetune.bench.runners import as_loaded, make_batch
from moetune.engine import EngineOptions, ExpertEngine, ExpertFormat, ExpertLoRA
from moetune.engine.formats import FORMATS, DenseExperts
from moetune.store.files import ExpertStore, StoreWriter
from moetune.store.manifest import SourceIdentity
from moetune.store.mapped import MappedFile
from moetune.sysinfo import cpu_info
from moetune.tensorfile import write_streamed

H, I, TOP_K, RANK = 2048, 768, 8, 8
MODULE = "model.layers.0.mlp.experts"
FORMAT_OPTIONS = {"bf16": ("dense", {}), "int8": ("int8", {}), "int4-g64": ("int4", {"group_size": 64})}
FORMAT_OPTIONS["fp8_block"] = ("fp8_block", {})


def layers(label: str, e: int) -> tuple[ExpertFormat, ExpertFormat]:
    """(as stored before, as stored now) for format ``label``: the same weights; dense bf16 contiguous, then in
    the loader's layout (``DenseExperts.empty``)."""
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(e, 2 * I, H, generator=gen).mul_(H**-0.5)
    down = torch.randn(e, H, I, generator=gen).mul_(I**-0.5)
    name, options = FORMAT_OPTIONS[label]
    if name == "dense":
        flat = (gate_up.bfloat16(), down.bfloat16())
        del gate_up, down
        return DenseExperts(*flat), DenseExperts(*as_loaded(*flat))
    fmt = FORMATS.get(name).from_dense(gate_up, down, **options)
    return fmt, fmt


def written_before(fmt: ExpertFormat, path: Path) -> tuple[ExpertFormat, MappedFile]:
    """``fmt`` written as ``StoreWriter`` wrote it before (safetensors' own layout, the tensors contiguous), mapped."""
    tensors = {k: t.contiguous() for k, t in fmt.state_tensors().items()}
    write_streamed(path, tensors, {"moetune_store": "1", "module": MODULE, "format": fmt.name})
    mapped = MappedFile(path)
    return FORMATS.get(fmt.name).from_state_tensors(mapped.tensors, **fmt.params()), mapped


def written_now(fmt: ExpertFormat, root: Path) -> tuple[ExpertFormat, MappedFile]:
    """``fmt`` written by ``StoreWriter`` into store ``root``, opened and mapped."""
    writer = StoreWriter.prepare(root, overwrite=True)
    writer.begin()
    writer.add(MODULE, fmt)
    writer.finish("qwen3_moe", SourceIdentity(str(root), "bench", (), "bench"))
    store = ExpertStore.open(root)
    mapped = store.map_layer(MODULE)
    return store.build(MODULE, mapped)[0], mapped


def placement(fmt: ExpertFormat) -> str:
    """Where the weights start relative to a 64-byte line, and their row stride."""
    t = fmt.state_tensors()
    w = (fmt.gate_up, fmt.down) if isinstance(fmt, DenseExperts) else (t["gate_up"], t["down"])
    return " ".join(f"{n} +{x.data_ptr() % 64} ld {x.stride(-2)}" for n, x in zip(("gate_up", "down"), w))


def run(args: argparse.Namespace, label: str, folder: Path) -> None:
    e, k = args.experts, min(TOP_K, args.experts)
    before_fmt, now_fmt = layers(label, e)
    held = {
        "before": written_before(before_fmt, folder / f"{label}.before.safetensors"),
        "now": written_now(now_fmt, folder / f"{label}.store"),
    }
    del before_fmt, now_fmt
    for _, mapped in held.values():
        mapped.populate()
    print(f"{label}: before {placement(held['before'][0])} | now {placement(held['now'][0])}", flush=True)
    gen = torch.Generator().manual_seed(1)
    lora = ExpertLoRA.init(e, H, I, RANK, 2 * RANK, dtype=torch.float32, generator=gen)
    lora.gate_up_B.normal_(0, 0.02, generator=gen)
    lora.down_B.normal_(0, 0.02, generator=gen)
    for t in args.tokens:
        batch = make_batch(t, e, k, H, torch.bfloat16, t)
        for mode in args.modes:
            engines = {
                name: ExpertEngine(fmt, lora=lora if mode == "lora" else None, options=EngineOptions())
                for name, (fmt, _) in held.items()
            }
            times: dict[str, list[float]] = {name: [] for name in engines}
            outs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
            for rep in range(args.reps + 1):  # the first a warm-up
                for name, engine in engines.items():
                    t0 = time.process_time()
                    y, saved = engine.forward(batch.x, batch.topk_ids, batch.topk_weights)
                    grads = engine.backward(saved, batch.grad_y)
                    if rep:
                        times[name].append((time.process_time() - t0) * 1e3)
                    outs[name] = (y, grads.x)
            med = {n: statistics.median(v) for n, v in times.items()}
            low = {n: min(v) for n, v in times.items()}
            same = all(torch.equal(a, b) for a, b in zip(outs["before"], outs["now"]))
            print(
                f"  T {t:5d} {mode:6s}  before median {med['before']:8.1f} min {low['before']:8.1f} | now median "
                f"{med['now']:8.1f} min {low['now']:8.1f} ms | {med['before'] / med['now']:.3f}x median, "
                f"{low['before'] / low['now']:.3f}x min {'=' if same else '!'}",
                flush=True,
            )
    for _, mapped in held.values():
        mapped.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--formats", nargs="+", default=list(FORMAT_OPTIONS), choices=list(FORMAT_OPTIONS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 2048])
    ap.add_argument("--modes", nargs="+", default=["lora", "frozen"], choices=["lora", "frozen"])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--dir", type=Path, default=None, help="where to write the stores (default: a temporary folder)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    print(
        f"bench/store_layout.py | {cpu.model} ({', '.join(cpu.isa) or 'no SIMD flags found'}) | threads "
        f"{args.threads} | E {args.experts}, H {H}, I {I}, k {min(TOP_K, args.experts)}"
    )
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for label in args.formats:
            run(args, label, Path(tmp))


if __name__ == "__main__":
    main()
