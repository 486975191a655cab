"""``accelerate launch --cpu --num_processes 2`` starts one process (accelerate's simple launcher, no MPI): moetune
refuses it by its variables, naming the command that starts two, instead of training alone."""

from __future__ import annotations

import pytest

from moetune.dist.group import Ranks
from moetune.errors import DistError

# what accelerate's simple launcher sets for --cpu --num_processes 2 (accelerate/utils/launch.py)
SIMPLE_CPU = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


def test_lone_process_of_accelerate_cpu_refused() -> None:
    with pytest.raises(DistError, match="--multi_gpu --num_processes N"):
        Ranks.from_env(SIMPLE_CPU)


@pytest.mark.parametrize(
    "env",
    [
        {"ACCELERATE_USE_CPU": "True"},  # --cpu with one process: no MASTER_ADDR
        {"MASTER_ADDR": "127.0.0.1"},  # a shell variable, no accelerate
        {**SIMPLE_CPU, "OMPI_COMM_WORLD_SIZE": "2"},  # under mpirun (--mpirun_hostfile): not this case
    ],
)
def test_single_process_otherwise(env) -> None:
    assert Ranks.from_env(env) == Ranks()
