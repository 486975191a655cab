"""Several processes training one model: process groups, one writer per file, failure propagation.

``moetune train`` launched by ``torchrun --nproc-per-node N`` (or ``accelerate launch``) runs one process per
rank. :func:`start` reads the launcher's environment once, sets up the process group through accelerate
(gloo on CPU, NCCL on GPUs; the collectives time out after ``ddp_timeout``) and starts the failure watchdog.
Every rank holds a full copy of the routed experts (replicated experts) or, with ``expert_parallel: sharded``,
E / world experts of every MoE layer (:mod:`moetune.dist.shard`), the token exchange of
:mod:`moetune.dist.exchange` bringing every rank's tokens to their experts' owners and back
(``moetune.layer.sharded``). The Trainer's own DDP averages the dense part's gradients and
``moetune.train.host_grads`` those of what the CPU engine trains (kept out of DDP, which cannot hold parameters on
a GPU and on the CPU). Each local rank is pinned to its share of the cores (:mod:`moetune.dist.affinity`). Files
are written by the main process only (:func:`main_writes`); an exception on any rank ends every rank, each
printing the cause (:mod:`moetune.dist.watchdog`). docs/distributed.md has the design and what is left.
"""

from moetune.dist.group import Ranks, barrier, main_writes, start
from moetune.dist.watchdog import failures_end_every_rank

__all__ = ["Ranks", "barrier", "failures_end_every_rank", "main_writes", "start"]
