"""The CPU/device schedule benchmark as a script: ``python bench/pipeline.py [--tokens 512 ...]``.

MoE layers' routed experts on the real CPU engine, the device's work (attention, router, shared experts,
copies) on a simulated device thread; prints the fraction of device time hidden behind CPU time for moetune's
schedule today, the plain serial one and a two-halves pipeline (options: ``--help``); the logic lives in
``moetune.bench.pipeline``.
"""

import sys

from moetune.bench.pipeline import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
