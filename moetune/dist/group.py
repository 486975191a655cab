"""The ranks of a multi-process run and its process group.

A launcher (``torchrun``, ``accelerate launch``) starts one process per rank and tells each its place in the
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``); :meth:`Ranks.from_env` reads them
once, at the edge. :func:`start` sets up the process group through accelerate's ``PartialState`` (the state the
Trainer's accelerator then finds in place) with the run's ``ddp_timeout`` on every collective, and starts the
failure watchdog (:mod:`moetune.dist.watchdog`). One process (no launcher, or ``WORLD_SIZE=1``) touches no
``torch.distributed`` state at all.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TypeVar

from moetune.errors import DistError

logger = logging.getLogger(__name__)

T = TypeVar("T")
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the run: ``rank`` of ``world`` processes, ``local_rank`` of ``local_world`` on
    its node. One process is ``Ranks(0, 1, 0, 1)``."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    local_world: int = 1
    cpus: tuple[
        int, ...
    ] = ()  # the CPUs this process was pinned to (moetune.dist.affinity); () if not pinned

    @property
    def distributed(self) -> bool:
        """More than one process trains."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """The process that writes files (rank 0)."""
        return self.rank == 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Ranks:
        """The launcher's variables (``os.environ`` unless ``env``); ``Ranks()`` when no launcher set them."""
        env = os.environ if env is None else env
        if "WORLD_SIZE" not in env:
            _refuse_lone_accelerate_cpu_process(env)
            return cls()
        values = {}
        for name in _LAUNCHER_VARS:
            raw = env.get(name, "1" if name == "LOCAL_WORLD_SIZE" else None)
            if raw is None or not raw.strip().isdigit():
                raise DistError(
                    f"environment variable {name}={raw!r}: a multi-process launch sets RANK, WORLD_SIZE and "
                    "LOCAL_RANK to non-negative integers; start moetune with `torchrun --nproc-per-node N "
                    "$(which moetune) train CFG.yaml` or `accelerate launch`"
                )
            values[name] = int(raw)
        ranks = cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"], values["LOCAL_WORLD_SIZE"])
        if not 0 <= ranks.rank < ranks.world or ranks.world < 1:
            raise DistError(
                f"RANK={ranks.rank} with WORLD_SIZE={ranks.world}: RANK must be in [0, WORLD_SIZE)"
            )
        return ranks


# the process-count variables of MPI launchers: accelerate's simple launcher runs several CPU processes only
# under mpirun (--mpirun_hostfile)
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def _refuse_lone_accelerate_cpu_process(env: Mapping[str, str]) -> None:
    """``accelerate launch --cpu --num_processes N`` without MPI starts ONE process (accelerate's simple launcher:
    every multi-process launcher is skipped under ``--cpu``), which sets MASTER_ADDR for N > 1 but no
    WORLD_SIZE: refused, naming the command that starts N processes, instead of training alone."""
    from_accelerate_cpu = env.get("ACCELERATE_USE_CPU", "").lower() == "true" and "MASTER_ADDR" in env
    if from_accelerate_cpu and not any(name in env for name in _MPI_SIZE_VARS):
        raise DistError(
            "accelerate launch --cpu started this as a single process (with --cpu, accelerate runs several "
            "processes only through mpirun: --mpirun_hostfile). Launch without --cpu: `accelerate launch "
            "--multi_gpu --num_processes N $(which moetune) train CFG.yaml` (torchrun underneath; `moetune: "
            "{device: cpu}` keeps the model on the CPU) or `torchrun --nproc-per-node N $(which moetune) train "
            "CFG.yaml` (docs/distributed.md)"
        )


_started: Ranks | None = None
_timeout: timedelta | None = None  # every collective's, as start() set it


def collective_timeout() -> timedelta | None:
    """The timeout :func:`start` gave the process group (``ddp_timeout``), for further groups; None before."""
    return _timeout


def start(*, cpu: bool, timeout_s: int, backend: str | None = None, bind_cpus: bool = True) -> Ranks:
    """This process's :class:`Ranks`; with several, the process group is set up (once per process: later calls
    return the same ranks), the watchdog started and, with ``bind_cpus``, the process pinned to its share of the
    machine's cores (:mod:`moetune.dist.affinity`). ``cpu``: the model computes on the CPU (gloo);
    ``timeout_s``: every collective's timeout (``ddp_timeout``); ``backend``: ``ddp_backend`` if set."""
    global _started, _timeout
    if _started is not None:
        return _started
    ranks = Ranks.from_env()
    if not ranks.distributed:
        _started = ranks
        return ranks
    import torch
    import torch.distributed as dist
    from accelerate import PartialState

    _timeout = timeout = timedelta(seconds=timeout_s)
    if not cpu:  # one GPU per local rank; CPU tensors (expert gradients, token exchange) go over gloo
        gpus = torch.cuda.device_count()
        if ranks.local_rank >= gpus:
            raise DistError(
                f"LOCAL_RANK={ranks.local_rank} needs GPU {ranks.local_rank}, but this machine shows {gpus} "
                f"GPU(s): start at most {gpus} processes per machine (--nproc-per-node), or train on the CPU "
                "with `moetune: {device: cpu}`"
            )
        torch.cuda.set_device(ranks.local_rank)
        if not dist.is_initialized():  # the Trainer's accelerator then finds this group
            dist.init_process_group(backend=backend or "cuda:nccl,cpu:gloo", timeout=timeout)
    elif not dist.is_initialized():
        # accelerate's own setup (the Trainer's accelerator finds this group): gloo on the CPU
        PartialState(cpu=True, backend=backend, timeout=timeout)
    if dist.get_world_size() != ranks.world or dist.get_rank() != ranks.rank:
        raise DistError(
            f"the process group has rank {dist.get_rank()} of {dist.get_world_size()} but the launcher set "
            f"RANK={ranks.rank} WORLD_SIZE={ranks.world}; start every process with the same launcher"
        )
    from moetune.dist.watchdog import start_watchdog

    start_watchdog(ranks)
    if bind_cpus:
        from moetune.dist.affinity import bind_local_rank

        ranks = dataclasses.replace(
            ranks, cpus=tuple(bind_local_rank(ranks.local_rank, ranks.local_world) or ())
        )
    logger.info(
        "moetune: rank %d of %d (local %d of %d), backend %s, collective timeout %d s",
        ranks.rank,
        ranks.world,
        ranks.local_rank,
        ranks.local_world,
        dist.get_backend(),
        timeout_s,
    )
    _started = ranks
    return ranks


def barrier(ranks: Ranks) -> None:
    """Wait until every rank is here (nothing with one process)."""
    if ranks.distributed:
        import torch.distributed as dist

        dist.barrier()


def main_writes(ranks: Ranks, write: Callable[[], T]) -> T | None:
    """``write()`` on the main process only (its result; None elsewhere), then every rank waits for it: one
    writer per file, and what it wrote is in place when any rank goes on. If it raises, the other ranks are
    ended by the watchdog instead of waiting (``failures_end_every_rank``)."""
    result = write() if ranks.is_main else None
    barrier(ranks)
    return result


def check_shared_folder(ranks: Ranks, folder: Path) -> None:
    """Several nodes (``world`` > ``local_world``): every rank must see what the main process writes in
    ``folder`` (``output_dir``), since the main process alone writes the checkpoints (every rank's
    ``rng_state_R.pth`` goes inside them) and every rank reads them on resume. The main process writes a probe
    named by a random token it sends to every rank; a rank that does not see it raises :class:`DistError` (the
    watchdog then ends the others). Nothing is checked on one node: its processes share one filesystem."""
    if ranks.world == ranks.local_world:
        return
    import secrets

    import torch.distributed as dist

    token: list[str | None] = [secrets.token_hex(8) if ranks.is_main else None]
    dist.broadcast_object_list(token, src=0)
    probe = folder / f".moetune-shared-{token[0]}"
    if ranks.is_main:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_text(str(token[0]))
    barrier(ranks)
    seen = probe.is_file() and probe.read_text() == token[0]
    barrier(ranks)  # every rank has looked before the probe goes
    if ranks.is_main:
        probe.unlink()
    if not seen:
        raise DistError(
            f"output_dir {folder}: rank {ranks.rank} (local rank {ranks.local_rank} on its node) does not see the "
            "file rank 0 wrote there, so this node does not share rank 0's output_dir. With several nodes the "
            "global main process (rank 0) writes every checkpoint, adapter and log, every rank's rng_state_R.pth "
            "goes into its checkpoints and every rank reads them on resume: set output_dir to a folder on a "
            "filesystem every node mounts at the same path (NFS, Lustre, ...)"
        )
