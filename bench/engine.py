"""The engine benchmark as a script: ``python bench/engine.py [--quick] [--json PATH] [--cases ...]``.

The same as ``moetune bench engine`` (options: ``--help``); the logic lives in ``moetune.bench.engine``.
"""

import sys

from moetune.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["bench", "engine", *sys.argv[1:]]))
