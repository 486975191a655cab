"""Sharded expert LoRA: each rank trains, steps and keeps only its experts' LoRA rows; saves hold the whole adapter.

With ``expert_parallel: sharded`` under several processes each ``ExpertsLora`` holds the rows of the rank's
experts only (``moetune.adapters.expert_rows``: ``E / world`` of every layer's E). Training:

- **Gradient.** The exchange brings every rank's tokens for an expert to its owner, so the owner's rows already
  receive the gradient of the whole global batch, and no other rank has one. They are kept out of DDP and out of
  ``host_grads``' all-reduce; their gradient is divided by the number of ranks instead (the Trainer multiplies
  each rank's loss by it, ``average_tokens_across_devices``, for DDP's average), which makes it one process's.
- **Clipping and the logged norm** need the norm over every gradient: the squares of the sharded rows are summed
  over the ranks (one all-reduce of a scalar) before the clip coefficient is formed, so every rank clips with
  one process's coefficient (:meth:`ShardedLora.clip_grad_norm_`, torch's formula).
- **Optimizer state** (AdamW's moments) is created by the optimizer next to each parameter, so it covers the
  rank's rows only.

Saving: every save gathers the rows to the main process (``dist.gather`` over the exchange's gloo group, one tensor
at a time, rank order) and the main process alone writes, one writer per file: the adapter (checkpoints' and the
final one) is the whole stock-PEFT adapter one process writes, and the optimizer state in a checkpoint is
gathered the same way into the ``optimizer.pt`` one process writes (moments of shape ``[E r, in]`` /
``[out, r E]``). A checkpoint therefore does not depend on the number of processes that wrote it: resuming cuts
the adapter (``ExpertsLora``'s ``load_state_dict`` pre-hook) and the moments (an optimizer load pre-hook here)
to the rank's rows, under any number of processes, sharded or replicated, and one process reads it with stock
code. The price is the whole LoRA and its moments on the main process during a checkpoint save (the other ranks
send theirs and keep only their rows).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moetune.adapters.expert_rows import HeldRows, held_part, joined
from moetune.errors import DistError

logger = logging.getLogger(__name__)

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: the clip coefficient is max_norm / (norm + 1e-6)


@dataclass(frozen=True)
class HeldTensor:
    """One sharded expert-LoRA weight: its name (as in ``model.state_dict()``), parameter and rows."""

    name: str
    param: torch.Tensor
    rows: HeldRows


def held_tensors(model: nn.Module) -> tuple[list[HeldTensor], Any]:
    """The expert-LoRA weights of ``model`` that hold only this rank's experts' rows, in ``named_modules`` order
    (the same on every rank), and the exchange group of their experts (None when there are none)."""
    from moetune.adapters.expert_layer import ExpertsLora
    from moetune.layer.sharded import ShardedExperts

    out, group = [], None
    for prefix, module in model.named_modules():
        if not isinstance(module, ExpertsLora) or not isinstance(module.experts, ShardedExperts):
            continue
        group = module.experts.group
        for kind, tensors in (("A", module.lora_A), ("B", module.lora_B)):
            for adapter, linear in tensors.items():
                rows = module.held_rows(kind, adapter)  # type: ignore[arg-type]
                if not rows.whole:
                    assert isinstance(linear, nn.Linear)
                    out.append(HeldTensor(f"{prefix}.lora_{kind}.{adapter}.weight", linear.weight, rows))
    return out, group


class ShardedLora:
    """The sharded expert-LoRA weights of one model and the gloo group they are gathered and summed over."""

    def __init__(self, tensors: list[HeldTensor], group: Any) -> None:
        import torch.distributed as dist

        self.tensors, self.group = tensors, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = {t.param for t in tensors}
        held = sum(t.param.numel() for t in tensors)
        logger.info(
            "moetune: sharded expert LoRA: this rank holds %d tensors, %.2f M values (1/%d of every layer's), "
            "outside DDP and host_grads' all-reduce",
            len(tensors),
            held / 1e6,
            self.world,
        )

    @classmethod
    def of(cls, model: nn.Module) -> ShardedLora | None:
        """``model``'s sharded expert LoRA, or None (replicated experts, one process, no expert LoRA)."""
        tensors, group = held_tensors(model)
        return cls(tensors, group) if tensors else None

    def scale_grads(self) -> None:
        """After the step's last backward: each held row's gradient (every rank's tokens, each rank's loss scaled
        by the number of ranks) divided by that number: one process's gradient."""
        for t in self.tensors:
            if t.param.grad is None:  # no token reached this layer's experts anywhere: a zero gradient
                t.param.grad = torch.zeros_like(t.param)
            t.param.grad.div_(self.world)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` over ``parameters`` (every rank's own and replicated ones) with the held
        rows' squares summed over the ranks: the norm and the clip of one process. Returns the norm (fp32, CPU)."""
        import torch.distributed as dist

        mine = [t.param.grad for t in self.tensors if t.param.grad is not None]
        rest = [p.grad for p in parameters if p.grad is not None and p not in self.params]
        held = torch.zeros(
            (), dtype=torch.float64
        )  # fp64 sums of squares: the order of the sums does not show
        for g in mine:
            held += g.double().square().sum()
        dist.all_reduce(held, op=dist.ReduceOp.SUM, group=self.group)
        for g in rest:
            held += g.detach().double().square().sum().cpu()
        norm = held.sqrt().float()
        coef = max_norm / (float(norm) + _EPS) if max_norm < math.inf else 1.0
        if coef < 1.0:
            for g in (*mine, *rest):
                g.mul_(coef)
        return norm

    def gather(self, local: torch.Tensor, rows: HeldRows) -> torch.Tensor | None:
        """Every rank's ``local`` held part -> the whole tensor on the main process (None elsewhere)."""
        import torch.distributed as dist

        local = local.detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(local, parts, group_dst=0, group=self.group)
        return joined(parts, rows) if parts is not None else None

    def whole_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """Every rank calls it: on the main process ``model.state_dict()`` with each held weight replaced by the
        whole one (what one process's state dict holds), None elsewhere."""
        whole = {t.name: self.gather(t.param, t.rows) for t in self.tensors}
        if self.rank != 0:
            return None
        state = model.state_dict()
        assert set(whole) <= set(state), sorted(set(whole) - set(state))[:4]
        state.update({k: v for k, v in whole.items() if v is not None})
        return state

    def whole_optimizer_state(self, optimizer: Any) -> dict[int, dict[str, torch.Tensor]] | None:
        """Every rank calls it: on the main process ``{index in optimizer.state_dict(): {key: whole tensor}}`` for
        the held weights' state tensors shaped like their rows (AdamW's moments), None elsewhere.
        ``DistError`` for an optimizer whose state for them has another shape (it cannot be cut by rows)."""
        inner = torch_optimizer(optimizer)
        index = _indices(inner)
        out: dict[int, dict[str, torch.Tensor]] = {}
        for t in self.tensors:
            for key, value in sorted(inner.state.get(t.param, {}).items()):
                if not isinstance(value, torch.Tensor) or value.ndim == 0:
                    continue
                if value.shape != t.param.shape:
                    raise DistError(
                        f"optimizer {type(inner).__name__}: its state {key!r} of {t.name} has shape "
                        f"{list(value.shape)}, not the parameter's {list(t.param.shape)}; with expert_parallel: "
                        "sharded the expert LoRA's optimizer state is gathered by rows. Use an optim whose state "
                        "is shaped like its parameters (adamw_torch, sgd, ...) or expert_parallel: replicated"
                    )
                whole = self.gather(value, t.rows)
                if whole is not None:
                    out.setdefault(index[id(t.param)], {})[key] = whole
        return out if self.rank == 0 else None

    @contextmanager
    def whole_optimizer_saves(self, optimizer: Any) -> Any:
        """Inside: ``optimizer.state_dict()`` on the main process holds the whole state of the held weights
        (gathered on entry: every rank enters)."""
        whole = self.whole_optimizer_state(optimizer)
        inner = torch_optimizer(optimizer)

        def put(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
            for i, values in (whole or {}).items():
                state_dict["state"][i] = {**state_dict["state"][i], **values}
            return state_dict

        handle = inner.register_state_dict_post_hook(put)
        try:
            yield
        finally:
            handle.remove()

    @contextmanager
    def held_optimizer_loads(self, optimizer: Any) -> Any:
        """Inside: ``optimizer.load_state_dict`` cuts whole state tensors of the held weights (a checkpoint of
        any number of processes) to this rank's rows."""
        inner = torch_optimizer(optimizer)
        index = _indices(inner)
        by_index = {index[id(t.param)]: t for t in self.tensors}

        def cut(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
            state = dict(state_dict["state"])
            for i, t in by_index.items():
                if i in state:
                    state[i] = {
                        k: held_part(v, t.rows) if isinstance(v, torch.Tensor) and t.rows.is_whole(v) else v
                        for k, v in state[i].items()
                    }
            return {**state_dict, "state": state}

        handle = inner.register_load_state_dict_pre_hook(cut)
        try:
            yield
        finally:
            handle.remove()


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    assert isinstance(inner, torch.optim.Optimizer), type(inner)
    return inner


def _indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``{id(param): its index in optimizer.state_dict()}`` (torch numbers the parameters of every group in order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}


class ShardsExpertLora:
    """Mixin for a transformers ``Trainer`` subclass (before the Trainer in the bases): with ``sharded_lora`` set
    (``host_grads.attach_host_grads``), clipping and the logged norm are one process's, and the adapter and the
    optimizer state are gathered whole to the main process for every save (module docstring)."""

    sharded_lora: ShardedLora | None = None
    args: Any
    accelerator: Any
    model: Any
    optimizer: Any

    def _clip_grad_norm(self, model: Any) -> Any:
        if self.sharded_lora is None:
            return super()._clip_grad_norm(model)  # type: ignore[misc]
        self.accelerator.unscale_gradients()
        return self.sharded_lora.clip_grad_norm_(list(model.parameters()), self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if self.sharded_lora is not None and grad_norm is None:  # no clipping: the norm is still every rank's
            grad_norm = self.sharded_lora.clip_grad_norm_(list(model.parameters()), math.inf)
        return super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if (
            self.sharded_lora is not None and state_dict is None
        ):  # every rank sends its rows; the main one writes
            state_dict = self.sharded_lora.whole_state_dict(self.model)
        super()._save(output_dir, state_dict)  # type: ignore[misc]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharded_lora is None:
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
            return
        with self.sharded_lora.whole_optimizer_saves(self.optimizer):
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self.sharded_lora is None or checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        with self.sharded_lora.held_optimizer_loads(self.optimizer):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
