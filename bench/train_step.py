"""The training-step benchmark as a script: ``python bench/train_step.py [--quick] [--json PATH] [...]``.

Tokens/s and peak memory of full LoRA training steps (gradient accumulation 4, AdamW) of a small MoE model,
moetune against transformers + PEFT with ``grouped_mm`` experts on the same CPU (options: ``--help``); the
logic lives in ``moetune.bench.train_step``.
"""

import sys

from moetune.bench.train_step import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
