"""Checks behind ``moetune doctor``: can this machine run moetune, and how well?

Each check gathers facts (interpreter, installed packages, CPU, threads, memory, GPUs) and judges them into
a :class:`Check` with a status, the facts found and, unless all is well, how to fix it. The judging
functions take their facts as arguments so every verdict can be tested on any machine. The engine
self-test (``moetune.testing.selftest``) runs one tiny expert layer forward and backward through the op
training uses and compares the output and every gradient with a float64 per-expert loop.
Nothing here downloads or writes anything.

One file per check: ``packages`` (interpreter, install, requirements), ``cpu`` (ISA and measured GEMMs),
``threads``, ``memory``, ``gpu``, ``engine`` (the self-test); ``base`` holds the verdict types and
``runner`` runs them all in report order.
"""

from moetune.doctor.base import Check, Status
from moetune.doctor.cpu import check_cpu, check_gemm, parse_onednn_matmul
from moetune.doctor.engine import check_engine
from moetune.doctor.gpu import GpuFacts, check_gpu
from moetune.doctor.memory import check_memory
from moetune.doctor.packages import check_install, check_packages, check_python
from moetune.doctor.runner import guarded, run_checks
from moetune.doctor.threads import check_threads

__all__ = [
    "Check",
    "GpuFacts",
    "Status",
    "check_cpu",
    "check_engine",
    "check_gemm",
    "check_gpu",
    "check_install",
    "check_memory",
    "check_packages",
    "check_python",
    "check_threads",
    "guarded",
    "parse_onednn_matmul",
    "run_checks",
]
