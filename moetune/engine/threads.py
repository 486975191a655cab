"""The CPU threads the expert engine's GEMMs run on.

The engine multiplies with torch on the CPU, so its threads are torch's intra-op pool, which is one per
process: sizing it is the caller's decision, made once (``load_model``, ``moetune convert``, the benchmarks),
never a side effect of building an engine.
"""

from __future__ import annotations

import torch

from moetune.errors import ConfigError
from moetune.sysinfo import default_num_threads


def set_engine_threads(requested: int | None = None) -> int:
    """Size torch's intra-op pool (process-wide) to ``requested`` threads, or to ``default_num_threads()``
    (the physical cores visible to the process, capped by its CPU quota) when None; returns the count.

    Raises ConfigError for anything but a positive int or None.
    """
    positive_int = isinstance(requested, int) and not isinstance(requested, bool) and requested >= 1
    if requested is not None and not positive_int:
        raise ConfigError(f"num_threads must be a positive int or None; got {requested!r}")
    threads = default_num_threads() if requested is None else requested
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
