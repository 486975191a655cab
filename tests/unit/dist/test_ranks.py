"""moetune.dist in one process: the launcher's variables, and that one process never touches torch.distributed."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from moetune.dist import Ranks, failures_end_every_rank, main_writes
from moetune.dist.group import start
from moetune.errors import DistError


def test_no_launcher_is_one_process() -> None:
    assert Ranks.from_env({}) == Ranks(0, 1, 0, 1)
    assert not Ranks().distributed and Ranks().is_main


def test_torchrun_variables() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    ranks = Ranks.from_env(env)
    assert ranks == Ranks(3, 4, 1, 2) and ranks.distributed and not ranks.is_main
    # LOCAL_WORLD_SIZE is torchrun's; a launcher without it counts as one process per node
    assert Ranks.from_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}).local_world == 1


@pytest.mark.parametrize(
    "env, words",
    [
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=None"),
        ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK='x'"),
        ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, "RANK=2 with WORLD_SIZE=2"),
    ],
)
def test_bad_launcher_variables(env, words) -> None:
    with pytest.raises(DistError, match=words.replace("(", r"\(")):
        Ranks.from_env(env)


def test_one_process_touches_no_process_group(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr("moetune.dist.group._started", None)
    assert start(cpu=False, timeout_s=10) == Ranks()
    assert not dist.is_initialized()
    assert main_writes(Ranks(), lambda: "written") == "written"
    with pytest.raises(ValueError, match="passes through"), failures_end_every_rank(Ranks()):
        raise ValueError("passes through")


def test_a_gpu_process_without_its_gpu_is_refused_before_any_group(monkeypatch) -> None:
    import torch

    local = torch.cuda.device_count()  # the first local rank this machine has no GPU for
    for name, value in {"RANK": str(local), "WORLD_SIZE": str(local + 2), "LOCAL_RANK": str(local)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr("moetune.dist.group._started", None)
    with pytest.raises(
        DistError, match=f"LOCAL_RANK={local} needs GPU {local}, but this machine shows {local}"
    ):
        start(cpu=False, timeout_s=10)
    assert not dist.is_initialized()
