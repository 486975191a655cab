"""The model benchmark as a script: ``python bench/model.py [--quick] [--json PATH] [--variants ...]``.

Training-step tokens/s and peak RSS of a whole MoE model, moetune against transformers on the same weights
(options: ``--help``); the logic lives in ``moetune.bench.model``, the method in ``docs/benchmarks.md``.
"""

import sys

from moetune.bench.model import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
