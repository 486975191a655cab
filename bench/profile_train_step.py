"""Where a LoRA training step's CPU time goes, moetune against transformers + PEFT: torch.profiler per op.

    python bench/profile_train_step.py [--threads 1] [--variants moetune transformers] [--rows 12]

The training-step benchmark's ``--quick`` model (``bench/train_step.py``: a random Qwen3-MoE, 2 layers,
H = 512, 32 experts of I = 256, top-8; LoRA r = 8 on attention and routed experts; bf16), one micro-batch of
1 x 512 tokens per step, each variant loaded the way that benchmark loads it (``moetune.bench.model_worker``),
in one process. Prints 3 timed steps per variant (variants alternating), then for each variant the
profiler's top ops by self CPU time over one more step. Each variant should be run in its own process to
compare absolute times (two models in one process slowed transformers' step by about 2x here); the op
shares are what this script is for.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from moetune.bench.model_worker import LOADERS, StepShape, Variant, _stepper
from moetune.bench.train_step import QUICK
from moetune.sysinfo import cpu_info
from moetune.testing.wide import write_wide_checkpoint


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--variants", nargs="+", choices=list(LOADERS.names()), default=["moetune", "transformers"]
    )
    p.add_argument("--rows", type=int, default=12, help="ops printed per variant")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    print(f"bench/profile_train_step.py | {cpu.model} ({', '.join(cpu.isa)}), {args.threads} threads")
    with tempfile.TemporaryDirectory() as tmp:
        path = write_wide_checkpoint(Path(tmp) / "checkpoint", QUICK.shape, seed=0)
        steppers = {}
        for impl in args.variants:
            model = LOADERS.get(impl)(str(path), torch.bfloat16, args.threads)
            shape = StepShape(batch=1, seq=QUICK.seq, lora_rank=8, accumulation=1)
            steppers[impl] = _stepper(model, Variant(impl, torch.bfloat16), shape)
        for rep in range(4):  # the first warms up
            for impl, stepper in steppers.items():
                result = stepper.step()
                if rep:
                    print(
                        f"{impl}: step {rep}: CPU {result['cpu_s'] * 1e3:.0f} ms, loss {result['loss']:.4f}"
                    )
        for impl, stepper in steppers.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                stepper.step()
            print(f"== {impl}: one step, top ops by self CPU time")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
