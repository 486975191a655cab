"""Several processes: the parameters the CPU engine trains are averaged over ranks outside DDP.

What the expert engine trains (expert LoRA, ``ExpertsLora``'s fp32 host tensors; in full/freeze mode the routed
experts' own weights, ``CpuExperts`` parameters) lives in host RAM whatever device the rest of the model uses.
DDP cannot hold a module whose parameters sit on a GPU and on the CPU (NCCL buckets are device tensors), so:

- those parameters are kept out of DDP (torch's ``_set_params_and_buffers_to_ignore_for_model`` on the module
  the Trainer wraps, before it wraps it), and DDP averages the rest (attention, routers, shared experts, ... on
  the GPU over NCCL, or on the CPU over gloo);
- after the backward of the micro-batch that ends an optimizer step (``accelerator.sync_gradients``), their
  gradients are summed over every rank on a gloo group of their own and divided by the number of ranks: the
  average DDP forms, before gradient clipping, the numerical guard and the optimizer see them.

The same path runs on the CPU (how the tests run it) and with GPUs, where the default group is
``cuda:nccl,cpu:gloo`` (:func:`moetune.dist.start`). Sharded experts' LoRA (each rank holds its experts' rows
only, which receive every rank's tokens' gradient) is kept out of DDP too but not summed: its gradient is
divided by the number of ranks (``moetune.train.sharded_lora``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from moetune.train.expert_optim import ExpertLayer

logger = logging.getLogger(__name__)


def host_trained(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every trainable parameter the CPU engine computes with (names as in
    ``model.named_parameters()``): those of the routed experts and their LoRA (``modes.host_modules``)."""
    from moetune.train.modes import host_modules

    host = {q for m in host_modules(model) for q in m.parameters()}
    return [(n, p) for n, p in model.named_parameters() if p in host and p.requires_grad]


class HostGrads:
    """The host-trained parameters of one model, kept out of DDP and averaged over ranks by :meth:`average`."""

    def __init__(self, model: nn.Module, world: int, fsdp: bool = False) -> None:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel

        from moetune.train.fsdp import averaged_outside
        from moetune.train.sharded_lora import ShardedLora

        named = host_trained(model)
        self.sharded = ShardedLora.of(model)  # held rows only: scaled, not summed
        held = self.sharded.params if self.sharded is not None else set()
        # under FSDP2 (``fsdp``) the LoRA experts are left whole too (moetune.train.fsdp.unsharded_modules)
        self.params = [p for _, p in named if p not in held] + (averaged_outside(model) if fsdp else [])
        self.world = world
        # a gloo group of their own: their sums never interleave with DDP's buckets on the default group
        self.group = dist.new_group(backend="gloo")
        ignored = {n for n, _ in named}
        # nothing left for DDP (lora_target naming only the experts): the model is not wrapped in DDP at all
        # (AveragesHostGrads._wrap_model); every trained tensor is averaged here
        self.alone = not fsdp and not any(
            p.requires_grad for n, p in model.named_parameters() if n not in ignored
        )
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(ignored))
        logger.info(
            "moetune: %d host-trained tensors (%.1f M values) averaged over %d ranks outside %s%s",
            len(self.params),
            sum(p.numel() for p in self.params) / 1e6,
            world,
            "FSDP2" if fsdp else "DDP",
            "; no dense tensor trains, so the model is not wrapped in DDP" if self.alone else "",
        )

    def average(self, sparse: Sequence[ExpertLayer] = ()) -> None:
        """Every rank's gradient of each host-trained parameter replaced by the mean over ranks (a rank without
        one contributes zeros). The routed experts of ``sparse`` layers (full mode under moetune's expert
        optimizer) hold their gradients in the layer's buffer instead of ``.grad``: see :func:`average_sparse`."""
        import torch.distributed as dist

        if self.sharded is not None:
            self.sharded.scale_grads()
        in_buffers = {param for layer in sparse for param in layer.params.values()}
        for layer in sparse:
            average_sparse(layer, self.world, self.group)
        for p in self.params:
            if p in in_buffers:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.group)
            p.grad.div_(self.world)


def average_sparse(layer: ExpertLayer, world: int, group: Any) -> None:
    """The mean over ranks of one experts module's sparse base gradients (``ExpertGradBuffer``: fp32, only the
    experts that received rows on this rank). The ranks first agree on the union of their experts with rows
    (a max over an ``[E]`` mask), then sum ``[U, ...]`` stacks of those experts' gradients (zeros where a rank
    has none) and divide by ``world``: every rank ends with the same experts holding DDP's average, and the
    experts no rank routed to stay without a gradient."""
    import torch.distributed as dist

    held = layer.buffer.grads  # called after the step's last backward: no add() runs concurrently
    num_experts = next(iter(layer.params.values())).shape[0]
    mask = torch.zeros(num_experts, dtype=torch.int32)
    if held:
        mask[list(held)] = 1
    dist.all_reduce(mask, op=dist.ReduceOp.MAX, group=group)
    union = mask.nonzero().flatten().tolist()
    if not union:
        return
    mine = set(held)  # this rank's experts with rows, before the others are added below
    for name, param in layer.params.items():
        rows = [
            held[e][name] if e in mine else torch.zeros(param.shape[1:], dtype=torch.float32) for e in union
        ]
        stacked = torch.stack(rows)  # [U, ...] fp32
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=group)
        stacked.div_(world)
        for i, e in enumerate(union):
            held.setdefault(e, {})[name] = stacked[i]


class DataParallelByHost(nn.Module):
    """The model of a data-parallel run in which no tensor is left for DDP (``lora_target`` naming only the routed
    experts): it computes as the model does (attributes are the model's), and the gradients of everything it trains
    are averaged over the ranks by :class:`HostGrads`, not by a wrapper. The Trainer keeps it as its wrapped model
    (``model_wrapped``); ``Trainer.model`` stays the model itself (saves, evaluation)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class AveragesHostGrads:
    """Mixin for a transformers ``Trainer`` subclass: with ``host_grads`` set (:func:`attach_host_grads`), the
    host-trained parameters' gradients are averaged over ranks after the backward that completes a step."""

    host_grads: HostGrads | None = None
    accelerator: Any  # the Trainer's
    model: Any  # the Trainer's

    def _wrap_model(self, model: Any, training: bool = True, dataloader: Any = None) -> Any:
        """The Trainer's hook that wraps the model for distributed training; with no dense tensor left for DDP
        (``HostGrads.alone``: every trained tensor is the CPU engine's, averaged here) the model is prepared by
        accelerate without DDP (``evaluation_mode``: device placement and autocast only; torch's DDP refuses a
        model with nothing to reduce) and handed back in :class:`DataParallelByHost`, so the Trainer does not
        prepare it again with DDP. Every other run: the Trainer's own."""
        wrapped = super()._wrap_model(model, training, dataloader)  # type: ignore[misc]
        if not training or self.host_grads is None or not self.host_grads.alone or wrapped is not self.model:
            return wrapped
        return DataParallelByHost(self.accelerator.prepare_model(model, evaluation_mode=True))

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        if self.host_grads is not None and self.accelerator.sync_gradients:
            from moetune.train.expert_optim import unwrap

            experts = unwrap(getattr(self, "optimizer", None))
            self.host_grads.average(experts.layers if experts is not None else [])
        return loss


def attach_host_grads(trainer: Any, world: int, fsdp: bool = False) -> None:
    """Before ``trainer.train()`` of a run of ``world`` > 1 processes: keep the host-trained parameters of the
    model the Trainer will wrap out of its DDP (or FSDP2: ``fsdp``) and average them in the trainer (an
    :class:`AveragesHostGrads`)."""
    if not isinstance(trainer, AveragesHostGrads):
        raise TypeError(
            f"{type(trainer).__name__} does not mix in AveragesHostGrads; expert gradients would not sync"
        )
    from moetune.train.sharded_lora import ShardsExpertLora

    trainer.host_grads = HostGrads(trainer.model, world, fsdp)
    if (
        trainer.host_grads.sharded is not None
    ):  # clipping and saves of the held rows (moetune.train.sharded_lora)
        if not isinstance(trainer, ShardsExpertLora):
            raise TypeError(
                f"{type(trainer).__name__} does not mix in ShardsExpertLora; saves would lose rows"
            )
        trainer.sharded_lora = trainer.host_grads.sharded
