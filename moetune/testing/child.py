"""The environment of a child Python process that tests and benchmarks start."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with this checkout first on ``PYTHONPATH`` and ``extra`` set.

    The caller's own ``PYTHONPATH`` stays after the checkout: packages installed beside the interpreter's
    (``pip install --target DIR`` and ``PYTHONPATH=DIR``) are found by the child as by the parent.
    """
    inherited = os.environ.get("PYTHONPATH", "")
    path = os.pathsep.join(p for p in (str(ROOT), inherited) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}
