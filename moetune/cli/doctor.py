"""``moetune doctor``: print whether this machine can run moetune, check by check, with fixes.

Exit status 0 when no check fails (warnings allowed), 1 when one does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moetune.doctor import Check


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``doctor`` and its options."""
    parser = subparsers.add_parser(
        "doctor",
        help="check that this machine can run moetune",
        description="Check the interpreter, packages, CPU, threads, memory and GPUs, and run a tiny forward "
        "and backward of the expert engine against a float64 reference. Exit status 0 when no check fails "
        "(warnings allowed), 1 when one does.",
    )
    parser.add_argument("--json", action="store_true", help="print the checks as one JSON object")
    parser.add_argument(
        "--skip-selftest", action="store_true", help="skip the engine self-test (a tiny forward and backward)"
    )
    parser.set_defaults(func=run)


def format_text(checks: list[Check]) -> str:
    """One ``[status] name  summary`` line per check, its details and fix indented below, then a tally."""
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"[{c.status.value:^4}] {c.name:<{width}}  {c.summary}")
        lines += [f"{'':7}{'':<{width}}  {d}" for d in c.details]
        if c.fix:
            lines.append(f"{'':7}{'':<{width}}  fix: {c.fix}")
    failed, warned = (sum(c.status.value == s for c in checks) for s in ("fail", "warn"))
    lines.append(f"{len(checks)} checks: {failed} failed, {warned} with warnings")
    return "\n".join(lines)


def format_json(checks: list[Check]) -> str:
    """``{"ok": no check failed, "checks": [{name, status, summary, details, fix}, ...]}``."""
    from moetune.doctor import Status

    ok = all(c.status is not Status.FAIL for c in checks)
    return json.dumps({"ok": ok, "checks": [dataclasses.asdict(c) for c in checks]}, indent=2)


def run(args: argparse.Namespace) -> int:
    """Run the checks, print them, return 1 if any failed."""
    from moetune.doctor import Status, run_checks  # imports torch: only when the command runs

    checks = run_checks(selftest=not args.skip_selftest)
    print(format_json(checks) if args.json else format_text(checks))
    return 1 if any(c.status is Status.FAIL for c in checks) else 0
