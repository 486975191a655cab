"""Several processes training one model: process groups, one writer per file, failure propagation.

``moetune train`` launched by ``torchrun --nproc-per-node N`` (or ``accelerate launch``) runs one process per
rank. :func:`start` reads the launcher's environment once, sets up the process group through accelerate
(gloo on CPU, NCCL on GPUs; the collectives time out after ``ddp_timeout``) and starts the failure watchdog.
Every rank holds a full copy of the routed experts (replicated experts) and the Trainer's own DDP averages every
gradient, the expert LoRA's (fp32 CPU parameters of the PEFT model) included; or, with ``expert_parallel:
sharded``, each rank holds E / world experts of every MoE layer (:mod:`moetune.dist.shard`) and the token exchange
of :mod:`moetune.dist.exchange` brings every rank's tokens to their experts' owners and back
(``moetune.layer.sharded``). Files are written by the main process only (:func:`main_writes`); an exception on any
rank ends every rank, each printing the cause (:mod:`moetune.dist.watchdog`). docs/distributed.md has the design
and what is left.
"""

from moetune.dist.group import Ranks, barrier, main_writes, start
from moetune.dist.watchdog import failures_end_every_rank

__all__ = ["Ranks", "barrier", "failures_end_every_rank", "main_writes", "start"]
