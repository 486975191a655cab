"""FSDP2 for the dense part of a multi-process run; the routed experts stay out of it.

Asked for as LLaMA-Factory / transformers users ask (``fsdp: full_shard auto_wrap`` or ``fsdp: true`` with
``fsdp_config: {fsdp_version: 2, ...}``), as accelerate users ask (``accelerate launch --config_file`` with
``distributed_type: FSDP`` and ``fsdp_version: 2``: accelerate's ``ACCELERATE_USE_FSDP`` / ``FSDP_*`` variables), or
through ``deepspeed: ds_z3_config.json`` (``moetune.config.hf_args``: ZeRO stage 3 -> FSDP2 full shard). In every
case the sharding is accelerate's ``FullyShardedDataParallelPlugin`` (``fsdp_version: 2``), which the Trainer's
accelerator applies with ``torch.distributed.fsdp.fully_shard`` to each decoder layer, the embeddings and the
root. moetune adds two things:

- **The routed experts are not sharded.** Every module the CPU engine computes with (``modes.host_modules``:
  ``CpuExperts``, whose weights train in full/freeze mode, and their expert LoRA, host tensors) and the LoRA
  experts (``lora_experts``) are the plugin's ``ignored_modules`` (:func:`unsharded_modules`): ``fully_shard``
  leaves their parameters as they are (plain tensors, never DTensors), and their gradients are averaged over the
  ranks outside FSDP, as under DDP (``moetune.train.host_grads``).
- **The CPU stands in for the GPUs** (``device: cpu``, how the tests run it). accelerate turns FSDP on only for
  accelerator devices: on the CPU (``DistributedType.MULTI_CPU``) it drops the plugin and would wrap the model in
  DDP. ``fully_shard`` itself runs on the CPU over gloo (torch 2.13), so :func:`attach_fsdp` gives the Trainer's
  accelerator the plugin and the ``FSDP`` distributed type there, and from then on accelerate's own FSDP2 paths
  run (model preparation, gathered state dicts, ``save_fsdp_model`` / ``save_fsdp_optimizer``).

What is refused before the model loads (:func:`fsdp_plugin`), by the setting's name: FSDP version 1 (moetune's
ignored modules and gathered adapter are FSDP2's), parameter offload (the routed experts already live in host
RAM; the dense part is what must stay on the GPU), ``cpu_ram_efficient_loading`` (it moves the model to the meta
device, engines included), a ``state_dict_type`` other than ``FULL_STATE_DICT`` (the final adapter is gathered
whole on the main process), FSDP's own ``activation_checkpointing`` (use ``gradient_checkpointing``: moetune's
recompute reuses the experts' forward), ``ignored_modules`` (moetune sets them); one process trains unsharded.

A LoRA run's checkpoints are accelerate's FSDP files (``pytorch_model_fsdp.bin``, ``optimizer.bin``: full state
dicts written by the main process) beside the stock adapter; a DDP or one-process checkpoint has ``optimizer.pt``
instead. A checkpoint of the other kind is converted as it is read (:func:`load_adapter_sharded`,
:func:`load_optimizer_whole`), with the expert LoRA sharded by rows too (its per-rank optimizer files put together
for this run's rows by ``sharded_lora.rows_loading``, as within one kind of run). A full/freeze run writes the
layer files of one process (``moetune.train.layered``) from the shards gathered whole (:func:`gathered_state_dict`,
:func:`gathered_optimizer_state`) and cuts them back to shards on resume (:func:`shard_like`), so its checkpoints
resume with or without FSDP.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.errors import ConfigError, listing

if TYPE_CHECKING:
    from moetune.train.sharded_lora import HeldTensor

logger = logging.getLogger(__name__)

FSDP_MODEL = "pytorch_model_fsdp.bin"  # accelerate's full-state-dict model file in an FSDP checkpoint
FSDP_OPTIMIZER = "optimizer.bin"
DDP_OPTIMIZER = "optimizer.pt"  # the Trainer's optimizer file without FSDP


def fsdp_plugin(cfg: Any, world: int) -> Any:
    """The run's accelerate ``FullyShardedDataParallelPlugin`` (FSDP2), or None without FSDP; checked here, before
    the model loads (``ConfigError`` naming the setting). ``world``: the number of processes."""
    from moetune.config import training_arguments_kwargs

    kwargs = training_arguments_kwargs(cfg)
    if not kwargs.get("fsdp") and not _accelerate_fsdp():
        return None
    where = "fsdp / fsdp_config" if kwargs.get("fsdp") else "accelerate's FSDP config (ACCELERATE_USE_FSDP)"
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import TrainingArguments

    if kwargs.get("fsdp"):
        plugin_args = TrainingArguments(**kwargs).fsdp_plugin_args
        version = int(plugin_args["fsdp_version"])
    else:  # accelerate launch's FSDP: its FSDP_* variables, FSDP_VERSION absent meaning 1 (accelerate's default)
        plugin_args = {}
        version = int(os.environ.get("FSDP_VERSION", "1"))
    if version != 2:  # checked first: accelerate refuses to build an FSDP1 plugin on the CPU
        raise ConfigError(
            f"{where}: fsdp_version {version}: moetune shards the dense part with FSDP2 only; set fsdp_config: "
            "{fsdp_version: 2} (transformers' default; in an accelerate config, fsdp_version: 2)"
        )
    # no arguments: the plugin reads accelerate's FSDP_* variables, as accelerate does
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    problems = _plugin_problems(plugin)
    if problems:
        raise ConfigError(f"{where}: FSDP2 cannot run as configured:{listing(problems)}")
    if world < 2:
        logger.warning("%s: one process, nothing to shard: the model trains unsharded", where)
        return None
    return plugin


def unsharded(args: dict[str, Any], world: int) -> dict[str, Any]:
    """TrainingArguments keyword arguments for ``world`` processes: one process drops ``fsdp`` / ``fsdp_config``
    (the Trainer refuses FSDP outside a distributed launch; :func:`fsdp_plugin` logged that it trains unsharded)."""
    if world > 1:
        return args
    return {k: v for k, v in args.items() if k not in ("fsdp", "fsdp_config")}


def _plugin_problems(plugin: Any) -> list[str]:
    from torch.distributed.fsdp import CPUOffloadPolicy

    problems = []
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) or plugin.cpu_offload is True:
        problems.append(
            "offload / cpu_offload / offload_params: the routed experts already live in host RAM (moetune's "
            "engine) and the dense part is what must stay on the GPU; remove the offload"
        )
    if plugin.cpu_ram_efficient_loading:
        problems.append(
            "cpu_ram_efficient_loading: it moves the model to the meta device, the CPU engines included; set it "
            "to false (moetune loads the routed experts once per rank itself)"
        )
    if "FULL_STATE_DICT" not in str(plugin.state_dict_type):
        problems.append(
            f"state_dict_type {plugin.state_dict_type}: moetune writes the adapter gathered on the main process; "
            "use FULL_STATE_DICT (the default)"
        )
    if plugin.activation_checkpointing:
        problems.append(
            "activation_checkpointing: use gradient_checkpointing: true instead (moetune's recompute reuses the "
            "routed experts' forward)"
        )
    if plugin.ignored_modules is not None:
        problems.append("ignored_modules: moetune sets them (the routed experts); remove it")
    return problems


def attach_fsdp(trainer: Any) -> None:
    """Before ``trainer.train()`` of a run :func:`fsdp_plugin` checked: FSDP2 through the Trainer's accelerator,
    the routed experts and their LoRA left out (``ignored_modules``). On the CPU (accelerate's ``MULTI_CPU``,
    where it drops FSDP) the accelerator is given the plugin (the Trainer's arguments', or accelerate's
    variables') and the ``FSDP`` type here. (Not :func:`fsdp_plugin` again: building ``TrainingArguments`` resets
    accelerate's shared state under the Trainer.)"""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type is DistributedType.MULTI_CPU:
        args = trainer.args.fsdp_plugin_args
        plugin = (
            FullyShardedDataParallelPlugin(**args) if args is not None else FullyShardedDataParallelPlugin()
        )
        # AcceleratorState copies PartialState's shared fields whenever it is built again: both say FSDP
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        state.distributed_type = DistributedType.FSDP
        state.fsdp_plugin = plugin
        trainer.is_fsdp_enabled = True
        logger.info(
            "moetune: FSDP2 on the CPU over gloo (accelerate enables it for accelerator devices only)"
        )
    elif state.distributed_type is not DistributedType.FSDP:
        raise ConfigError(
            f"fsdp: accelerate chose {state.distributed_type.value} for this launch, not FSDP; launch with torchrun or "
            "accelerate launch --multi_gpu (docs/distributed.md)"
        )
    plugin = state.fsdp_plugin
    ignored = unsharded_modules(trainer.model)
    plugin.ignored_modules = ignored
    logger.info(
        "moetune: FSDP2 shards the dense part; %d routed-expert and LoRA-expert modules (%.1f M values) stay whole "
        "on every rank",
        len(ignored),
        sum(p.numel() for m in ignored for p in m.parameters(recurse=False)) / 1e6,
    )


def unsharded_modules(model: Any) -> list[Any]:
    """The modules FSDP2 leaves whole (``ignored_modules``): the host-side ones (``modes.host_modules``: routed
    experts, their LoRA, in full/freeze mode their trained weights) and the LoRA experts
    (``moetune.adapters.lora_experts``: small device MLPs whose file is written from the live tensors). Their
    gradients are averaged by ``moetune.train.host_grads`` (:func:`averaged_outside`)."""
    from moetune.adapters.lora_experts import LoraExperts
    from moetune.train.modes import host_modules

    return [*host_modules(model), *(m for m in model.modules() if isinstance(m, LoraExperts))]


def averaged_outside(model: Any) -> list[Any]:
    """The trainable parameters FSDP2 leaves to moetune beyond the host-trained ones (which ``host_grads``
    averages under DDP too): the LoRA experts' (DDP averages them; FSDP2 ignores them)."""
    from moetune.adapters.lora_experts import LoraExperts

    return [
        p for m in model.modules() if isinstance(m, LoraExperts) for p in m.parameters() if p.requires_grad
    ]


def full_state_dict(trainer: Any) -> dict[str, Any] | None:
    """The model's whole state dict gathered on the main process (every rank must call it: it is a collective);
    None without FSDP, and an empty dict on the other ranks."""
    if not getattr(trainer, "is_fsdp_enabled", False):
        return None
    return gathered_state_dict(trainer.model, trainer.args.should_save)


def gather(value: Any, keep: bool) -> Any:
    """``value`` whole: an FSDP2 shard (a ``DTensor``) all-gathered (a collective: every rank calls it for the same
    tensors in the same order) and brought to the CPU where ``keep`` (the writer), else dropped (None); any other
    value as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value
    whole = value.full_tensor()
    return whole.cpu() if keep else None


def gathered_state_dict(model: Any, keep: bool) -> dict[str, Any]:
    """``model.state_dict()`` with each FSDP2 shard gathered whole, one tensor at a time (:func:`gather`): on the
    writer (``keep``) the whole state dict, the tensors FSDP2 does not hold (routed experts in host RAM) by
    reference, not copied; an empty dict elsewhere. Every rank must call it."""
    state = {k: gather(v, keep) for k, v in model.state_dict().items()}
    return state if keep else {}


def gathered_optimizer_state(optimizer: Any, keep: bool) -> dict[str, Any]:
    """``optimizer.state_dict()`` with each FSDP2-sharded state tensor (AdamW's moments of a sharded parameter)
    gathered whole (:func:`gather`; every rank must call it): the writer's (``keep``) to write, as one process
    writes it; an empty dict elsewhere."""
    sd = optimizer.state_dict()
    state = {i: {k: gather(v, keep) for k, v in values.items()} for i, values in sd["state"].items()}
    return {**sd, "state": state} if keep else {}


def shard_like(whole: Any, like: Any) -> Any:
    """This rank's FSDP2 shard of ``whole`` (a tensor read from a checkpoint) laid out as ``like`` (a ``DTensor``
    parameter, or state of one, of the same global shape); ``whole`` as it is when ``like`` is no ``DTensor`` or
    has another shape (a scalar such as AdamW's ``step``). Every rank holds ``whole``: no communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor) or tuple(whole.shape) != tuple(like.shape):
        return whole
    return distribute_tensor(
        whole.to(device=like.device, dtype=like.dtype), like.device_mesh, like.placements, src_data_rank=None
    )


def check_fsdp(cfg: Any, world: int) -> None:
    """Before the model loads: the FSDP2 settings (:func:`fsdp_plugin`; ``ConfigError`` naming the setting). A
    checkpoint of the other kind (FSDP or not) needs no check here: it is converted as it is read, the expert LoRA's
    per-rank optimizer rows included (:func:`load_optimizer_whole`)."""
    fsdp_plugin(cfg, world)


def other_kind(folder: str | Path, fsdp: bool) -> bool:
    """Whether the LoRA checkpoint ``folder`` was written by the other kind of run: under FSDP (accelerate's
    ``pytorch_model_fsdp.bin`` / ``optimizer.bin``) when this run has none, or without it (``optimizer.pt``)."""
    src = Path(folder)
    if fsdp:
        return not (src / FSDP_OPTIMIZER).is_file() and (src / DDP_OPTIMIZER).is_file()
    return (src / FSDP_OPTIMIZER).is_file() or (src / FSDP_MODEL).is_file()


def load_optimizer_whole(
    optimizer: Any, model: Any, folder: str | Path, held: list[HeldTensor] | None = None
) -> None:
    """The optimizer state of a LoRA checkpoint written by the other kind of run (:func:`other_kind`), loaded into
    ``optimizer`` (accelerate's wrapper or the torch optimizer) over ``model``'s parameters: FSDP's
    ``optimizer.bin`` (whole tensors keyed by parameter name: torch's full optimizer state dict) or DDP's / one
    process's ``optimizer.pt`` (keyed by position in the Trainer's parameter groups, which both kinds build over
    the same model in the same order). Each tensor is cut to this rank's shard where the parameter is an FSDP2
    shard (:func:`shard_like`). The expert LoRA's weights (``held``: ``sharded_lora.HeldTensor`` s, by default
    ``model``'s) get their rows' moments as within one kind of run (``sharded_lora.rows_loading``, inside the same
    ``load_state_dict``): put together from the checkpoint's per-rank rows files (a sharded run of any number of
    processes, whose optimizer file holds only their step), or cut from whole moments. ``LoadError`` when the
    saved parameters are not this run's."""
    import torch

    from moetune.errors import LoadError
    from moetune.train.sharded_lora import expert_lora_tensors, rows_loading

    src = Path(folder)
    held = expert_lora_tensors(model) if held is None else held
    # a weight held by rows ([count r, in] or [out, r count]) takes the whole tensor's moments too: rows_loading
    # cuts them
    whole_shape = {id(t.param): t.rows.whole_shape(t.param.shape) for t in held}
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps torch's
    by_id = {id(p): n for n, p in model.named_parameters()}
    groups = [[by_id[id(p)] for p in g["params"]] for g in inner.param_groups]
    names = [n for g in groups for n in g]
    path = src / (DDP_OPTIMIZER if (src / DDP_OPTIMIZER).is_file() else FSDP_OPTIMIZER)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    saved_groups = [list(g["params"]) for g in saved["param_groups"]]
    if path.name == DDP_OPTIMIZER:  # positions: the same order in both kinds of run
        saved_groups = [[names[i] for i in g if 0 <= i < len(names)] for g in saved_groups]
        state = {names[i]: v for i, v in saved["state"].items() if 0 <= i < len(names)}
    else:
        state = dict(saved["state"])
    if [sorted(g) for g in saved_groups] != [sorted(g) for g in groups] or not set(state) <= set(names):
        raise LoadError(
            f"{path}: its optimizer trains other parameters than this run ({sum(map(len, saved_groups))} in "
            f"{len(saved_groups)} groups, this run {len(names)} in {len(groups)}); resume with the same lora_target, "
            "lora settings and additional_target"
        )
    params = dict(model.named_parameters())
    wrong = [
        f"{n}/{k} {tuple(v.shape)} for {tuple(params[n].shape)}"
        for n, values in state.items()
        for k, v in values.items()
        if isinstance(v, torch.Tensor)
        and v.dim()
        and tuple(v.shape) not in (tuple(params[n].shape), whole_shape.get(id(params[n])))
    ]
    if wrong:
        raise LoadError(
            f"{path}: its optimizer state has other shapes than this run's parameters ({wrong[:3]}); resume with the "
            "same lora_rank and lora_target"
        )
    position = {n: i for i, n in enumerate(names)}
    whole = {
        position[n]: {
            k: shard_like(v, params[n]) if isinstance(v, torch.Tensor) else v for k, v in values.items()
        }
        for n, values in state.items()
    }
    start, param_groups = 0, []
    for group, ours in zip(saved["param_groups"], groups, strict=True):
        param_groups.append({**group, "params": list(range(start, start + len(ours)))})
        start += len(ours)
    with rows_loading(optimizer, held, src):
        optimizer.load_state_dict({"state": whole, "param_groups": param_groups})
    logger.warning(
        "moetune: %s (written %s FSDP) loaded into this run's optimizer (%s FSDP)",
        path,
        "under" if path.name == FSDP_OPTIMIZER else "without",
        "without" if path.name == FSDP_OPTIMIZER else "under",
    )


def load_adapter_sharded(peft_model: Any, folder: str | Path) -> None:
    """A checkpoint's stock-PEFT adapter (``adapter_model.safetensors``, written by any kind of run) loaded into
    ``peft_model`` whose dense part FSDP2 shards: each tensor cut to this rank's shard (:func:`shard_like`) of the
    live tensor with the same stock key. ``LoadError`` when the keys differ (accelerate's ``load_fsdp_model`` reads
    its own ``pytorch_model_fsdp.bin`` only)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from moetune.adapters.save import put_adapter_state, stock_key
    from moetune.errors import LoadError

    path = Path(folder) / "adapter_model.safetensors"
    saved = load_file(str(path))
    # stock keys; PEFT 0.22 gathers sharded tensors whole here (a collective), so the shards come from `places`
    live = get_peft_model_state_dict(peft_model)
    if saved.keys() != live.keys():
        raise LoadError(
            f"{path}: its LoRA tensors are not this run's (missing {sorted(live.keys() - saved.keys())[:4]}, "
            f"extra {sorted(saved.keys() - live.keys())[:4]}); resume with the same lora_target and lora settings"
        )
    places = {stock_key(n): p for n, p in peft_model.named_parameters()}  # this rank's shards where sharded
    put_adapter_state(peft_model, {k: shard_like(t, places.get(k, live[k])) for k, t in saved.items()}, path)


def fsdp_requested(trainer: Any) -> bool:
    """Whether the run asks for FSDP: ``fsdp`` in the Trainer's arguments or accelerate's FSDP launch config."""
    return bool(trainer.args.fsdp) or _accelerate_fsdp()


def _accelerate_fsdp() -> bool:
    """``accelerate launch`` was asked for FSDP (``--use_fsdp`` or ``distributed_type: FSDP``): the variable it
    sets for the processes it starts, read at the edge as accelerate reads it."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def dense_memory(model: Any) -> dict[str, Any]:
    """What this rank holds of the dense part (every parameter outside the routed experts): ``sharding``
    (``fsdp2`` when any parameter is an FSDP2 DTensor shard, else ``whole``) and ``params_gb``, the bytes of its
    local tensors (a DTensor counts its local shard)."""
    from torch.distributed.tensor import DTensor

    from moetune.train.modes import host_modules

    host = {id(p) for m in host_modules(model) for p in m.parameters()}
    dense = [p for p in model.parameters() if id(p) not in host]
    local = [p.to_local() if isinstance(p, DTensor) else p for p in dense]
    return {
        "sharding": "fsdp2" if any(isinstance(p, DTensor) for p in dense) else "whole",
        "params_gb": round(sum(t.numel() * t.element_size() for t in local) / 1e9, 6),
    }
