"""Pinning the processes of one machine to their cores (moetune.dist.affinity) on fake and real topologies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moetune.dist.affinity import rank_cpus
from moetune.sysinfo import Core, parse_cpu_list, read_cores
from moetune.testing.child import child_env



def _fake_sysfs(tmp: Path, nodes: int, cores_per_node: int, smt: int) -> tuple[Path, Path, list[int]]:
    """A /sys tree like Linux's: CPU c's siblings are c + j * (nodes * cores_per_node), as on x86 hosts."""
    sys_cpu, sys_node = tmp / "cpu", tmp / "node"
    total = nodes * cores_per_node
    per_node: dict[int, list[int]] = {n: [] for n in range(nodes)}
    for j in range(smt):
        for core in range(total):
            cpu = core + j * total
            node = core // cores_per_node
            topo = sys_cpu / f"cpu{cpu}" / "topology"
            topo.mkdir(parents=True)
            (topo / "physical_package_id").write_text(f"{node}\n")  # one socket per node
            (topo / "core_id").write_text(f"{core % cores_per_node}\n")
            per_node[node].append(cpu)
    for node, cpus in per_node.items():
        (sys_node / f"node{node}").mkdir(parents=True)
        (sys_node / f"node{node}" / "cpulist").write_text(",".join(map(str, sorted(cpus))) + "\n")
    return sys_cpu, sys_node, sorted(c for cpus in per_node.values() for c in cpus)


def test_parse_cpu_list():
    assert parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpu_list("5") == [5]


def test_cores_group_siblings_by_node(tmp_path):
    sys_cpu, sys_node, cpus = _fake_sysfs(tmp_path, nodes=2, cores_per_node=4, smt=2)
    cores = read_cores(cpus, sys_cpu, sys_node)
    assert len(cores) == 8
    assert cores[0] == Core(0, (0, 8)) and cores[4] == Core(1, (4, 12))


@pytest.mark.parametrize(
    ("ranks", "want"),
    [
        # two ranks on a two-socket host: one socket each, siblings included
        (2, [[0, 1, 2, 3, 8, 9, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]),
        # four: two per socket, whole cores
        (4, [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]),
        # three: node 0 split between ranks 0 and 1, node 1 for rank 2
        (3, [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 6, 7, 12, 13, 14, 15]]),
        # one rank only: it gets both nodes (bind_local_rank does not pin one process at all)
        (1, [list(range(16))]),
        # more ranks than cores: one logical CPU each, on its node
        (16, [[c] for c in (0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15)]),
    ],
)
def test_rank_blocks(tmp_path, ranks, want):
    sys_cpu, sys_node, cpus = _fake_sysfs(tmp_path, nodes=2, cores_per_node=4, smt=2)
    cores = read_cores(cpus, sys_cpu, sys_node)
    got = [rank_cpus(cores, r, ranks) for r in range(ranks)]
    assert got == want
    flat = [c for block in got for c in block]  # disjoint, and every CPU used
    assert sorted(flat) == cpus


def test_more_ranks_than_cpus_are_not_pinned(tmp_path):
    sys_cpu, sys_node, cpus = _fake_sysfs(tmp_path, nodes=1, cores_per_node=2, smt=1)
    assert rank_cpus(read_cores(cpus, sys_cpu, sys_node), 0, 4) is None


def test_no_topology_files_count_each_cpu_as_a_core(tmp_path):
    cores = read_cores([0, 1, 2], tmp_path / "none", tmp_path / "none")
    assert cores == [Core(0, (0,)), Core(0, (1,)), Core(0, (2,))]


CHILD = """
import json, os, sys
from moetune.dist.affinity import bind_local_rank
if len(sys.argv) > 3:
    os.sched_setaffinity(0, [int(sys.argv[3])])  # as numactl / taskset would before moetune starts
got = bind_local_rank(int(sys.argv[1]), int(sys.argv[2]))
print(json.dumps([got, sorted(os.sched_getaffinity(0))]))
"""


def _child(*args: int) -> tuple[list[int] | None, list[int]]:
    env = child_env()
    out = subprocess.run(
        [sys.executable, "-c", CHILD, *map(str, args)], capture_output=True, text=True, env=env
    )
    assert out.returncode == 0, out.stderr
    return tuple(json.loads(out.stdout.splitlines()[-1]))  # type: ignore[return-value]


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_real_processes_are_pinned_to_disjoint_cpus():
    visible = sorted(os.sched_getaffinity(0))
    expected = [rank_cpus(read_cores(visible), r, 2) for r in range(2)]
    results = [_child(r, 2) for r in range(2)]
    for (pinned, affinity), want in zip(results, expected):
        if want is None:  # one CPU visible: not pinned, both share it
            assert pinned is None and affinity == visible
        else:
            assert pinned == want and affinity == want
    if expected[0] is not None:
        assert not set(results[0][1]) & set(results[1][1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_a_launcher_placement_is_kept():
    visible = sorted(os.sched_getaffinity(0))
    if len(visible) < 2:
        pytest.skip("needs two CPUs to narrow the affinity")
    pinned, affinity = _child(0, 2, visible[-1])
    assert pinned is None and affinity == [visible[-1]]
