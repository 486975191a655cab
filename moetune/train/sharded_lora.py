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

Saving, one writer per file: the adapter is gathered to the main process (``dist.gather`` over the exchange's gloo
group, one tensor at a time, rank order) and written by it alone, the whole stock-PEFT adapter one process
writes (checkpoints' and the final one). It is gathered as it is written (:class:`GatheredAdapter`): the file's
header first, from the known shapes, then each tensor's bytes, a held weight gathered when its turn comes and
dropped once written, so the main process holds one layer's weight beyond its own rows, never the whole expert
LoRA. The optimizer state is not gathered: the main process's
``optimizer.pt`` leaves out the held rows' moments and every rank writes its own rows' moments to
:func:`rows_file` in the checkpoint (as it writes its ``rng_state_R.pth``), so no rank ever holds more than its
rows. Resuming (:func:`optimizer_rows_loading`) gives each rank its rows whatever wrote the checkpoint: cut from
a whole ``optimizer.pt`` (one process, replicated) or put together by expert ranges from the rows files of a
sharded run of any number of processes; the adapter is cut by ``ExpertsLora``'s ``load_state_dict`` pre-hook.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetune.adapters.expert_rows import HeldRows, expert_axis, held_part, joined, rank_counts
from moetune.adapters.save import write_adapter_weights
from moetune.adapters.swap import WEIGHTS_NAME
from moetune.atomic import write_atomically
from moetune.errors import DistError

logger = logging.getLogger(__name__)

_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s: the clip coefficient is max_norm / (norm + 1e-6)


@dataclass(frozen=True)
class HeldTensor:
    """One sharded expert-LoRA weight: its name (as in ``model.state_dict()``), parameter and rows."""

    name: str
    param: torch.Tensor
    rows: HeldRows


def expert_lora_tensors(model: nn.Module, *, sharded_only: bool = False) -> list[HeldTensor]:
    """The expert-LoRA weights of ``model`` (``ExpertsLora``'s ``lora_A`` / ``lora_B``) with the rows each holds,
    in ``named_modules`` order (the same on every rank); ``sharded_only``: those holding a rank's rows only."""
    from moetune.adapters.expert_layer import ExpertsLora

    out = []
    for prefix, module in model.named_modules():
        if not isinstance(module, ExpertsLora):
            continue
        for kind, tensors in (("A", module.lora_A), ("B", module.lora_B)):
            for adapter, linear in tensors.items():
                rows = module.held_rows(kind, adapter)  # type: ignore[arg-type]
                if not (sharded_only and rows.whole):
                    assert isinstance(linear, nn.Linear)
                    out.append(HeldTensor(f"{prefix}.lora_{kind}.{adapter}.weight", linear.weight, rows))
    return out


def exchange_group(model: nn.Module) -> Any:
    """The exchange's process group of ``model``'s sharded experts (None without)."""
    from moetune.layer.sharded import ShardedExperts

    return next((m.group for m in model.modules() if isinstance(m, ShardedExperts)), None)


class ShardedLora:
    """The sharded expert-LoRA weights of one model and the gloo group they are gathered and summed over."""

    def __init__(self, tensors: list[HeldTensor], group: Any) -> None:
        import torch.distributed as dist

        self.tensors, self.group = tensors, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.params = {t.param for t in tensors}
        held = sum(t.param.numel() for t in tensors)
        logger.info(
            "moetune: sharded expert LoRA: this rank holds %d tensors, %.2f M values (its experts' rows, of %d "
            "ranks), outside DDP and host_grads' all-reduce",
            len(tensors),
            held / 1e6,
            self.world,
        )

    @classmethod
    def of(cls, model: nn.Module) -> ShardedLora | None:
        """``model``'s sharded expert LoRA, or None (replicated experts, one process, no expert LoRA)."""
        tensors = expert_lora_tensors(model, sharded_only=True)
        return cls(tensors, exchange_group(model)) if tensors else None

    def scale_grads(self) -> None:
        """After the step's last backward: each held row's gradient (every rank's tokens, each rank's loss scaled
        by the number of ranks) divided by that number: one process's gradient."""
        for t in self.tensors:
            if t.param.grad is None:  # no token reached this layer's experts anywhere: a zero gradient
                t.param.grad = torch.zeros_like(t.param)
            t.param.grad.div_(self.world)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """torch's ``clip_grad_norm_`` over ``parameters`` (every rank's own and replicated ones) with the held
        rows' squares summed over the ranks, and those of FSDP2's shards (``DTensor`` gradients: each rank's local
        shard) too: the norm and the clip of one process. Returns the norm (fp32, CPU)."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        mine = [t.param.grad for t in self.tensors if t.param.grad is not None]
        rest = [p.grad for p in parameters if p.grad is not None and p not in self.params]
        # fp64 sums of squares: the order of the sums does not show
        held = torch.zeros((), dtype=torch.float64)
        for g in mine:
            held += g.double().square().sum()
        for g in rest:
            if isinstance(
                g, DTensor
            ):  # a shard of the dense part: FSDP2 shards over every rank, as held rows are
                held += g.to_local().detach().double().square().sum().cpu()
        dist.all_reduce(held, op=dist.ReduceOp.SUM, group=self.group)
        for g in rest:
            if not isinstance(g, DTensor):  # the same on every rank: counted once
                held += g.detach().double().square().sum().cpu()
        norm = held.sqrt().float()
        coef = max_norm / (float(norm) + _EPS) if max_norm < math.inf else 1.0
        if coef < 1.0:
            for g in (*mine, *rest):
                g.mul_(coef)
        return norm

    def gather(
        self, local: torch.Tensor, rows: HeldRows, buffer: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Every rank's ``local`` held part -> the whole tensor on the main process (None elsewhere). The parts may
        be uneven (the last rank's with LongCat-Flash's zero-computation experts' rows): every rank knows every
        count (``expert_rows.rank_counts``) and sends its part padded to the largest, the main process drops the
        padding. ``buffer`` (main process): a flat tensor of ``local``'s dtype and at least
        :meth:`gather_elements` elements, which holds the parts and the whole instead of new tensors (the whole is
        then valid until the buffer is reused)."""
        import torch.distributed as dist

        counts = rank_counts(rows, self.rank, self.world)
        each = local.numel() // rows.count  # the elements of one expert's rows
        padded = max(counts) * each
        flat = local.detach().contiguous().view(-1)
        if flat.numel() < padded:
            flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
        parts = None
        if self.rank == 0:
            parts = [
                torch.empty_like(flat) if buffer is None else buffer[q * padded : (q + 1) * padded]
                for q in range(self.world)
            ]
        dist.gather(flat, parts, group_dst=0, group=self.group)
        if parts is None:
            return None
        held = [
            p[: n * each].view(rows.shape_for(local.shape, n)) for p, n in zip(parts, counts, strict=True)
        ]
        into = (
            None if buffer is None else buffer[self.world * padded : self.world * padded + rows.total * each]
        )
        return joined(held, rows, into)

    def gather_elements(self, t: HeldTensor) -> int:
        """The elements of :meth:`gather`'s ``buffer`` for ``t``: every rank's padded part, then the whole."""
        counts = rank_counts(t.rows, self.rank, self.world)
        each = t.param.numel() // t.rows.count
        return (self.world * max(counts) + t.rows.total) * each

    def gathered_adapter(
        self, model: nn.Module, base: dict[str, torch.Tensor] | None = None
    ) -> GatheredAdapter:
        """Every rank calls it before an adapter is written: the held weights in the order the adapter file lays
        them out (the same on every rank), to be gathered one at a time while the main process writes
        (:class:`GatheredAdapter`); on the main process the state dict to write from, ``base`` (FSDP2's gathered
        state dict) or else ``model.state_dict()``, each held weight in it a ``meta`` placeholder of the whole
        tensor's shape."""
        from moetune.adapters.save import adapter_state
        from moetune.tensorfile import layout

        placeholders = {
            t.name: torch.empty(t.rows.whole_shape(t.param.shape), dtype=t.param.dtype, device="meta")
            for t in self.tensors
        }
        by_id = {id(placeholders[t.name]): t for t in self.tensors}
        # the adapter's keys of the held weights, laid out as in the whole file (the order is by dtype and key)
        adapter = adapter_state(model, placeholders)
        order = [by_id[id(adapter[key])] for key in layout(adapter)[1]]
        assert len(order) == len(self.tensors), "every held weight is in the adapter once"
        state = None
        if self.rank == 0:
            state = dict(base) if base is not None else model.state_dict()
            assert set(placeholders) <= set(state), sorted(set(placeholders) - set(state))[:4]
            state.update(placeholders)
        return GatheredAdapter(self, order, [placeholders[t.name] for t in order], state)

    @contextmanager
    def held_state_left_out(self, optimizer: Any) -> Any:
        """Inside: ``optimizer.state_dict()`` leaves out the held weights' row-shaped state (AdamW's moments; each
        rank writes its rows to its own file, :meth:`write_rows`), keeping the rest (the step counters)."""
        inner = torch_optimizer(optimizer)
        index = _indices(inner)
        mine = {index[id(t.param)]: t for t in self.tensors}

        def drop(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
            state = dict(state_dict["state"])
            for i, t in mine.items():
                if i in state:
                    state[i] = {k: v for k, v in state[i].items() if not _row_shaped(v, t.param)}
            return {**state_dict, "state": state}

        handle = inner.register_state_dict_post_hook(drop)
        try:
            yield
        finally:
            handle.remove()

    def write_rows(self, optimizer: Any, folder: str | Path) -> Path:
        """This rank's held weights' row-shaped optimizer state to ``folder`` (:func:`write_rows_file`)."""
        return write_rows_file(self.tensors, optimizer, folder, self.rank, self.world)


def write_rows_file(
    tensors: list[HeldTensor], optimizer: Any, folder: str | Path, rank: int, world: int
) -> Path:
    """The row-shaped optimizer state of ``tensors`` (a rank's held weights) to ``folder/`` :func:`rows_file`
    (atomically; every rank writes its own file): tensors ``<weight name>/<state key>``, and in the header where
    each weight's rows sit (kind, r, first expert, experts, E). ``DistError`` for state of another shape."""
    from safetensors.torch import save_file

    inner = torch_optimizer(optimizer)
    saved: dict[str, torch.Tensor] = {}
    rows: dict[str, list[Any]] = {}
    for t in tensors:
        for key, value in inner.state.get(t.param, {}).items():
            if not isinstance(value, torch.Tensor) or value.ndim == 0:
                continue
            if not _row_shaped(value, t.param):
                raise DistError(
                    f"optimizer {type(inner).__name__}: its state {key!r} of {t.name} has shape "
                    f"{list(value.shape)}, not the parameter's {list(t.param.shape)}; with expert_parallel: "
                    "sharded the expert LoRA's optimizer state is saved by rows. Use an optim whose state is "
                    "shaped like its parameters (adamw_torch, sgd, ...) or expert_parallel: replicated"
                )
            saved[f"{t.name}/{key}"] = value.detach().contiguous()
        r = t.rows
        rows[t.name] = [r.kind, r.r, r.first, r.count, r.total]
    meta = {"format": ROWS_FORMAT, "rows": json.dumps(rows, sort_keys=True)}
    Path(folder).mkdir(parents=True, exist_ok=True)  # the main process may not have made it yet
    out = Path(folder) / rows_file(rank, world)
    return write_atomically(out, lambda path: save_file(saved, str(path), metadata=meta))


ROWS_FORMAT = "moetune_expert_lora_optimizer_rows/1"


def rows_file(rank: int, world: int) -> str:
    """The name of rank ``rank``'s file of its expert LoRA rows' optimizer state in a checkpoint."""
    return f"expert_lora_optimizer-rank{rank}-of-{world}.safetensors"


def _row_shaped(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim > 0 and value.shape == param.shape


def _rows_files(checkpoint: str | Path) -> list[Path]:
    """The rows files of a checkpoint written by sharded ranks (all ``world`` of them; ``LoadError`` if one is
    missing), in rank order; [] when it has none."""
    from moetune.errors import LoadError

    found = sorted(Path(checkpoint).glob("expert_lora_optimizer-rank*-of-*.safetensors"))
    if not found:
        return []
    world = int(found[0].stem.rpartition("-of-")[2])
    want = [Path(checkpoint) / rows_file(r, world) for r in range(world)]
    if sorted(found) != sorted(want):
        raise LoadError(
            f"{checkpoint}: its expert LoRA optimizer rows are split over {world} files, but it holds "
            f"{[p.name for p in found]}; the checkpoint is incomplete. Resume from another checkpoint"
        )
    return want


def optimizer_rows_loading(optimizer: Any, model: nn.Module, checkpoint: str | Path) -> Any:
    """Inside: ``optimizer.load_state_dict`` gives each expert-LoRA weight of ``model`` its rows' optimizer state,
    whatever wrote the checkpoint: cut from the whole tensors of a one-process or replicated ``optimizer.pt``,
    or put together from the per-rank rows files of a sharded run of any number of processes (the experts'
    rows this process holds, all of them without sharding). Nothing is changed for other parameters."""
    return rows_loading(optimizer, expert_lora_tensors(model), checkpoint)


@contextmanager
def rows_loading(optimizer: Any, tensors: list[HeldTensor], checkpoint: str | Path) -> Any:
    """:func:`optimizer_rows_loading` for the expert-LoRA weights ``tensors`` (with the rows each holds)."""
    from safetensors import safe_open

    from moetune.errors import LoadError

    inner = torch_optimizer(optimizer)
    index = _indices(inner)
    tensors = [t for t in tensors if id(t.param) in index]
    files = _rows_files(checkpoint)
    saved: list[tuple[Any, dict[str, HeldRows]]] = []
    for path in files:
        handle = safe_open(str(path), "pt")
        meta = handle.metadata() or {}
        if meta.get("format") != ROWS_FORMAT:
            raise LoadError(f"{path}: header format {meta.get('format')!r}, expected {ROWS_FORMAT!r}")
        rows = {name: HeldRows(*values) for name, values in json.loads(meta["rows"]).items()}
        saved.append((handle, rows))

    def assembled(t: HeldTensor) -> dict[str, torch.Tensor]:
        """The weight's rows of every saved state key, copied from the files whose experts overlap its own."""
        out: dict[str, torch.Tensor] = {}
        covered: dict[str, int] = {}
        for handle, rows in saved:
            if t.name not in rows:
                raise LoadError(
                    f"{checkpoint}: the expert LoRA optimizer rows do not cover {t.name}; was it written by this model?"
                )
            src = rows[t.name]
            lo, hi = max(src.first, t.rows.first), min(src.first + src.count, t.rows.first + t.rows.count)
            if lo >= hi:
                continue
            for key in handle.keys():  # noqa: SIM118 (safetensors' handle is not iterable)
                name, _, state_key = key.rpartition("/")
                if name != t.name:
                    continue
                if state_key not in out:
                    out[state_key] = torch.empty_like(t.param)
                axis = 2 if t.rows.kind == "B" else 0
                into = expert_axis(out[state_key], t.rows).narrow(axis, lo - t.rows.first, hi - lo)
                into.copy_(expert_axis(handle.get_tensor(key), src).narrow(axis, lo - src.first, hi - lo))
                covered[state_key] = covered.get(state_key, 0) + hi - lo
        gaps = {k: n for k, n in covered.items() if n != t.rows.count}
        assert not gaps, (t.name, gaps, t.rows)  # every rank's file is present: their experts cover E once
        return out

    def fill(opt: Any, state_dict: dict[str, Any]) -> dict[str, Any]:
        state = dict(state_dict["state"])
        for t in tensors:
            i = index[id(t.param)]
            entry = {
                k: held_part(v, t.rows)
                if isinstance(v, torch.Tensor) and not t.rows.whole and t.rows.is_whole(v)
                else v
                for k, v in state.get(i, {}).items()
            }
            entry.update(assembled(t) if saved else {})
            if entry:
                state[i] = entry
        return {**state_dict, "state": state}

    hook = inner.register_load_state_dict_pre_hook(fill)
    try:
        yield
    finally:
        hook.remove()


def torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or the optimizer itself)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    assert isinstance(inner, torch.optim.Optimizer), type(inner)
    return inner


def _indices(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """``{id(param): its index in optimizer.state_dict()}`` (torch numbers the parameters of every group in order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}


class GatheredAdapter:
    """One adapter save with sharded expert LoRA: every held weight is gathered whole to the main process when the
    adapter file reaches it and dropped once written, so the main process holds one weight (a layer's A or B)
    beyond its own rows instead of the whole expert LoRA. Main process: ``state_dict`` (placeholders for the
    held weights) and ``fetch`` for the writer (``moetune.adapters.save.write_adapter_weights``), called in file
    order, each weight gathered into one buffer reused for all of them (the largest weight's parts and whole); the other
    ranks call ``send`` (the same gathers, in the same order) and go on. A gather in another order than the
    file's is an internal error (``AssertionError``), never a silent mismatch."""

    def __init__(
        self,
        lora: ShardedLora,
        order: list[HeldTensor],
        placeholders: list[torch.Tensor],
        state_dict: dict[str, torch.Tensor] | None,
    ) -> None:
        self.lora, self.order, self.placeholders = lora, order, placeholders
        self.state_dict = state_dict
        self._next = 0
        # main process: one buffer for the parts and the whole of the largest weight, reused for every weight, so
        # what the save adds is that and no more (new tensors each time would leave the allocator's heap grown)
        self._buffer: torch.Tensor | None = None
        if state_dict is not None and order:
            self._buffer = order[0].param.new_empty(max(lora.gather_elements(t) for t in order))
            assert all(t.param.dtype == order[0].param.dtype for t in order), (
                "expert LoRA weights share a dtype"
            )

    def fetch(self, placeholder: torch.Tensor) -> torch.Tensor:
        """Main process, from the writer: the whole weight ``placeholder`` stands for (the next in file order)."""
        assert self._next < len(self.order) and placeholder is self.placeholders[self._next], (
            "the adapter writer asked for the held weights in another order than the file's"
        )
        t = self.order[self._next]
        self._next += 1
        # a view of the buffer: valid until the next fetch, by which time the writer has written it
        whole = self.lora.gather(t.param, t.rows, self._buffer)
        assert whole is not None
        return whole

    def send(self) -> None:
        """A rank other than the main one: its rows of every held weight, in file order."""
        assert self.lora.rank != 0
        for t in self.order:
            self.lora.gather(t.param, t.rows)

    def check_written(self) -> None:
        """Main process, after the write: every held weight was gathered (else the ranks' gathers would not pair);
        the buffer is released."""
        assert self._next == len(self.order), (self._next, len(self.order))
        self._buffer = None


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
        if self.sharded_lora is None:
            super()._save(output_dir, state_dict)  # type: ignore[misc]
            return
        # every rank sends its rows (into FSDP2's gathered dict, if any) as the main process writes the adapter
        gathered = self.sharded_lora.gathered_adapter(self.model, state_dict or None)
        if gathered.state_dict is None:
            gathered.send()
            super()._save(output_dir, None)  # type: ignore[misc]  # returns: the main process writes
            return
        # the Trainer's save (PEFT's save_pretrained: the adapter's config, its model card; the tokenizer, the
        # training arguments) with no LoRA tensor, then the adapter's weights streamed in the place of PEFT's
        # empty file, atomically (inside the checkpoint's staging folder as well)
        super()._save(output_dir, {})  # type: ignore[misc]
        out = Path(output_dir if output_dir is not None else self.args.output_dir) / WEIGHTS_NAME
        write_atomically(
            out,
            lambda tmp: write_adapter_weights(self.model, tmp, gathered.state_dict, gathered.fetch),
        )
        gathered.check_written()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self.sharded_lora is None:
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
            return
        with self.sharded_lora.held_state_left_out(self.optimizer):
            super()._save_optimizer_and_scheduler(output_dir)  # type: ignore[misc]
        self.sharded_lora.write_rows(self.optimizer, output_dir)  # every rank its own file, in the staging

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or (self.sharded_lora is None and not _rows_files(checkpoint)):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        with optimizer_rows_loading(self.optimizer, self.model, checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
