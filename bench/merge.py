"""Time and peak memory of ``moetune export --merge`` on an FP8 checkpoint with DeepSeek-V3's expert matrices.

    python bench/merge.py [--experts 16 --hidden 7168 --inter 2048 --layers 2 --rank 8 --threads 2]

Writes a DeepSeek-V3-layout FP8 block checkpoint (``moetune.testing.fp8_checkpoint``: every decoder Linear and
routed expert e4m3 with 128 x 128 scales; the first layer dense, as ``first_k_dense_replace`` says) with real
expert-matrix shapes (gate/up ``[I, H]``, down ``[H, I]``) and a LoRA adapter on every target (random A and B:
the values do not change the work), then merges it twice, each in a fresh process: ``--quantized bfloat16`` (the
default: every FP8 weight dequantized to bf16) and ``--quantized requantize`` (the merged weights quantized again).
Printed: the machine, the checkpoint's size, seconds per merge (after a first plan that pays the imports), GB of the checkpoint read per second, the
output's size and the merging process's peak RSS (``VmHWM``) against the largest shard. On DeepSeek-V3
(58 MoE layers x 256 experts x 3 matrices) the time scales with the expert matrices merged.
"""

from __future__ import annotations

import argparse
import multiprocessing
import tempfile
import time
from pathlib import Path


def _merge(model: str, adapter: str, out: str, quantized: str, threads: int, result: dict) -> None:
    import torch

    from moetune.export import export_merged_checkpoint, plan_merge

    torch.set_num_threads(threads)
    start = time.perf_counter()
    plan_merge(model, adapter)  # imports, headers, the adapter: once, apart from the merge's own work
    result["plan"] = time.perf_counter() - start
    start = time.perf_counter()
    merged = export_merged_checkpoint(model, adapter, out, progress=False, quantized=quantized)  # type: ignore[arg-type]
    result["seconds"] = time.perf_counter() - start
    result["rss"] = _high_water()
    result["changed"] = len(merged.changed)


def _high_water() -> int:
    """This process's peak resident bytes (``VmHWM``: per address space, so not the parent's, which
    ``ru_maxrss`` keeps across the exec of a spawned child)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--layers", type=int, default=2, help="decoder layers, the first dense")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from moetune.sysinfo import cpu_info

    machine = cpu_info()
    print(
        f"bench/merge.py | {machine.model} ({', '.join(machine.isa) or 'no SIMD flags found'}), {args.threads} threads"
    )
    with tempfile.TemporaryDirectory(prefix="moetune-merge-bench-") as tmp:
        _run(args, Path(tmp))


def _run(args: argparse.Namespace, root: Path) -> None:
    """The checkpoint and adapter under ``root``, then the two merges."""
    import torch

    from moetune.adapters import attach_lora, save_adapter
    from moetune.adapters.load import load_model
    from moetune.testing.fp8_checkpoint import save_fp8_checkpoint

    model = save_fp8_checkpoint(
        "deepseek_v3",
        root / "model",
        hidden_size=args.hidden,
        moe_intermediate_size=args.inter,
        intermediate_size=args.inter,
        n_routed_experts=args.experts,
        num_hidden_layers=args.layers,
        first_k_dense_replace=1,
    )
    peft = attach_lora(
        load_model(model, device="cpu", dtype="bfloat16", progress=False), rank=args.rank, alpha=16
    )
    with torch.no_grad():
        for name, t in peft.named_parameters():
            if "lora_" in name:
                t.normal_(0, 0.01)
    save_adapter(peft, root / "adapter")
    del peft
    size = _size(model)
    largest = max(p.stat().st_size for p in model.glob("*.safetensors"))
    matrices = (args.layers - 1) * args.experts * 3
    print(
        f"checkpoint: {size / 1e9:.2f} GB FP8 ({matrices} expert matrices [{args.inter}, {args.hidden}] / "
        f"[{args.hidden}, {args.inter}]), largest shard {largest / 1e9:.2f} GB; LoRA r={args.rank} on every target"
    )
    ctx = multiprocessing.get_context("spawn")
    for quantized in ("bfloat16", "requantize"):
        with ctx.Manager() as manager:
            result = manager.dict()
            out = root / f"merged-{quantized}"
            proc = ctx.Process(
                target=_merge,
                args=(str(model), str(root / "adapter"), str(out), quantized, args.threads, result),
            )
            proc.start()
            proc.join()
            assert proc.exitcode == 0, proc.exitcode
            r = dict(result)
        print(
            f"--quantized {quantized:>10}: {r['seconds']:.1f} s (first plan {r['plan']:.1f} s apart), "
            f"{size / r['seconds'] / 1e9:.3f} GB/s read, "
            f"{r['seconds'] / matrices * 1e3:.0f} ms per expert matrix, {r['changed']} weights changed, output "
            f"{_size(out) / 1e9:.2f} GB, peak RSS {r['rss'] / 1e9:.2f} GB ({r['rss'] / largest:.2f}x the largest shard)"
        )


if __name__ == "__main__":
    main()
