"""Each of several processes on one machine pinned to its own share of the cores, NUMA node by node.

Our users' hosts have two sockets (one or more NUMA nodes each) and run one process per GPU. A process whose
threads wander over both sockets reads half its expert weights across the socket link. So before any weight
loads, each local rank is pinned (``os.sched_setaffinity``) to a block of whole physical cores:

- with fewer ranks than NUMA nodes, rank r gets whole nodes ``[r n / R, (r + 1) n / R)`` (n nodes, R ranks);
- otherwise the ranks are dealt to nodes in contiguous, balanced blocks (rank r to node ``r n / R``) and the
  ranks of a node split its cores into contiguous, balanced blocks; a core's SMT siblings go with it.

Memory follows: Linux places a page on the NUMA node of the CPU that first touches it, and the expert weights
are read (first touched) by the pinned process and its engine threads, so they land on the rank's node with no
NUMA library. The engine then sizes its thread pool to the cores it was given.

Nothing is pinned when the launcher already placed the process (its affinity is narrower than the online CPUs:
``numactl``, ``taskset``, ``torchrun --numa-binding``, which pins GPU ranks next to their GPUs and is the
better choice with GPUs), when one process runs, or when there are more ranks than CPUs (ranks then share them,
as before; logged). ``moetune: {bind_cpus: false}`` turns it off.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from moetune.sysinfo import SYS_CPU, Core, parse_cpu_list, read_cores, visible_cpus

logger = logging.getLogger(__name__)


def _block(items: list, part: int, parts: int) -> list:
    """Contiguous block ``part`` of ``parts`` nearly equal blocks of ``items``."""
    n = len(items)
    return items[part * n // parts : (part + 1) * n // parts]


def rank_cpus(cores: list[Core], local_rank: int, local_world: int) -> list[int] | None:
    """The logical CPUs local rank ``local_rank`` of ``local_world`` is pinned to (module docstring), or None
    when there are more ranks than CPUs to give (they then share)."""
    nodes = sorted({c.node for c in cores})
    if local_world <= len(nodes):
        mine = set(_block(nodes, local_rank, local_world))
        return sorted(cpu for c in cores if c.node in mine for cpu in c.cpus)
    def node_of(rank: int) -> int:  # ranks dealt to nodes in contiguous, balanced blocks
        return nodes[rank * len(nodes) // local_world]

    node = node_of(local_rank)
    on_node = [r for r in range(local_world) if node_of(r) == node]
    node_cores = [c for c in cores if c.node == node]
    if len(node_cores) >= len(on_node):  # whole cores, siblings together
        return sorted(
            cpu for c in _block(node_cores, on_node.index(local_rank), len(on_node)) for cpu in c.cpus
        )
    node_cpus = sorted(cpu for c in node_cores for cpu in c.cpus)
    if len(node_cpus) >= len(on_node):  # more ranks than cores on the node: split the SMT siblings
        return _block(node_cpus, on_node.index(local_rank), len(on_node))
    return None


def online_cpus(sys_cpu: Path = SYS_CPU) -> list[int] | None:
    """Every online CPU of the machine (None where the kernel does not say)."""
    try:
        return parse_cpu_list((sys_cpu / "online").read_text())
    except (OSError, ValueError):
        return None


def bind_local_rank(local_rank: int, local_world: int) -> list[int] | None:
    """Pin this process (``local_rank`` of ``local_world`` on its machine) to its CPUs; returns them, or None
    where nothing was pinned (module docstring says when, and each case is logged)."""
    if local_world <= 1 or not hasattr(os, "sched_setaffinity"):
        return None
    visible = visible_cpus()
    online = online_cpus()
    if online is not None and set(visible) != set(online):
        logger.info(
            "moetune local rank %d: CPU affinity already set (%d of %d CPUs, by the launcher or numactl); kept",
            local_rank,
            len(visible),
            len(online),
        )
        return None
    cpus = rank_cpus(read_cores(visible), local_rank, local_world)
    if cpus is None:
        logger.warning(
            "moetune local rank %d: %d processes on %d CPUs; not pinning them (they share every CPU)",
            local_rank,
            local_world,
            len(visible),
        )
        return None
    os.sched_setaffinity(0, cpus)
    from moetune.sysinfo import cpu_info

    cpu_info.cache_clear()  # the engine sizes its pool from the CPUs now visible
    logger.info("moetune local rank %d of %d: pinned to CPUs %s", local_rank, local_world, cpus)
    return cpus
