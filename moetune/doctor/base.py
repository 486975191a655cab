"""What every doctor check returns: a status and a verdict that says how to fix what is wrong."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

GIB = 1024**3
REPORT = "report it with the output of `moetune doctor --json`"


class Status(str, Enum):
    """A check's verdict."""

    OK = "ok"
    WARN = "warn"  # moetune runs, but slower or with less than this machine could give
    FAIL = "fail"  # moetune will not run, or will compute wrong numbers, until this is fixed


@dataclass(frozen=True)
class Check:
    """One check's verdict: a one-line summary, further facts, and (unless ok) how to fix it."""

    name: str
    status: Status
    summary: str
    details: tuple[str, ...] = ()
    fix: str = ""
