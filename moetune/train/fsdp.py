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
instead. :func:`resume_problem` refuses resuming one kind with the other (the Trainer would skip the optimizer
state it does not find, without a word). A full/freeze run writes the layer files of one process
(``moetune.train.layered``) from the shards gathered whole (:func:`gathered_state_dict`,
:func:`gathered_optimizer_state`) and cuts them back to shards on resume (:func:`shard_like`), so its checkpoints
resume with or without FSDP.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from moetune.errors import ConfigError, listing

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


def resume_problem(folder: Path, fsdp: bool) -> str | None:
    """Why checkpoint ``folder`` cannot be resumed by a run with (``fsdp``) or without FSDP, or None."""
    written_by_fsdp = (folder / FSDP_MODEL).is_file() or (folder / FSDP_OPTIMIZER).is_file()
    if written_by_fsdp and not fsdp:
        return (
            f"it was written under FSDP ({FSDP_OPTIMIZER}, {FSDP_MODEL}) and this run has no fsdp: its optimizer "
            "state would not be read. Resume with the same fsdp settings (any number of processes >= 2)"
        )
    if fsdp and not written_by_fsdp and (folder / DDP_OPTIMIZER).is_file():
        return (
            f"it was written without FSDP ({DDP_OPTIMIZER}) and this run has fsdp: accelerate reads {FSDP_MODEL} and "
            f"{FSDP_OPTIMIZER} only. Resume without fsdp, or start over"
        )
    return None


def check_fsdp(cfg: Any, world: int) -> None:
    """Before the model loads: the FSDP2 settings (:func:`fsdp_plugin`) and whether the checkpoint to resume from
    was written with the same kind of run (:func:`resume_problem`); ``ConfigError`` naming the setting."""
    from moetune.train.preflight import resume_checkpoint

    fsdp = fsdp_plugin(cfg, world) is not None
    folder = resume_checkpoint(cfg)
    if folder is not None and folder.is_dir() and (problem := resume_problem(folder, fsdp)) is not None:
        raise ConfigError(f"resume_from_checkpoint {folder} cannot be resumed here: {problem}")


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
