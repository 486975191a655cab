"""``load_model``: a Hugging Face MoE checkpoint as its own transformers model, experts in the CPU engine.

    path -> Checkpoint (headers; quantized weights' codes and scales paired, under logical keys: loading.quant)
         -> config (transformers' own class; kimi_k2 mapped onto deepseek_v3: model_types) -> ArchSpec
         -> model on meta -> experts sites -> plan: expert tensors per site, each layer's expert format
            (``plan_load``, shared with ``moetune convert``); experts modules replaced on the instance by
            placeholders; non-expert keys checked against the model (every check before any tensor is read)
         -> non-expert weights through transformers' loader onto ``device``
         -> each layer's experts streamed from the shards into an engine; placeholder -> CpuExperts

The model's class, router modules, routing math, shared experts, output hooks (``output_router_logits``,
aux loss) and generation all stay transformers' own; only the ``experts`` modules are instances of
``moetune.layer.CpuExperts``.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moetune.arch import ArchSpec, ExpertsSite, find_experts, resolve_arch
from moetune.config.experts import AUTO, hot_sets
from moetune.dist.shard import ExpertShard, expert_shard
from moetune.engine import ExpertEngine
from moetune.engine.threads import set_engine_threads
from moetune.errors import LoadError
from moetune.layer import EXPERTS_MODULES, CpuExperts
from moetune.layer.overlap import attach_shared_ahead
from moetune.layer.sharded import SHARDED_MODULES
from moetune.loading import hf
from moetune.loading.checkpoint import Checkpoint
from moetune.loading.expert_plan import ExpertPlan, LayerPlan, plan_experts
from moetune.loading.hf import KeyTarget
from moetune.loading.options import ExpertFormatChoice, LoadOptions, check_int8_activations
from moetune.loading.quant import (
    QuantizedWeight,
    QuantMethod,
    checkpoint_quantization,
    logical_tensors,
    quantized_weights,
)
from moetune.loading.stream import stream_experts
from moetune.progress import format_bytes
from moetune.store.engines import open_store, store_engines
from moetune.store.files import ExpertStore
from moetune.store.manifest import SourceIdentity

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


class PendingExperts(nn.Module):
    """Holds an experts module's place while the rest of the model loads; its only tensors are those of the
    submodules the family keeps on the device (``ExpertsSite.kept``), which transformers loads here."""

    def __init__(self, site: ExpertsSite, replaced: nn.Module) -> None:
        super().__init__()
        self.site = site
        for name in site.kept:
            self.add_module(name, getattr(replaced, name))

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise LoadError(f"{self.site.path}: routed experts were never loaded (load_model was interrupted)")


def layer_summary(paths: list[str]) -> str:
    """``model.layers.{1,3-5}.mlp.experts`` for module paths that differ in their first index."""
    groups: dict[str, list[int]] = {}
    for path in paths:
        m = re.search(r"\.(\d+)\.", path)
        key = path if m is None else f"{path[: m.start()]}.{{}}.{path[m.end() :]}"
        groups.setdefault(key, []).extend([] if m is None else [int(m.group(1))])
    out = []
    for pattern, idx in groups.items():
        runs: list[str] = []
        for i in sorted(idx):
            if runs and runs[-1].split("-")[-1] == str(i - 1):
                runs[-1] = f"{runs[-1].split('-')[0]}-{i}"
            else:
                runs.append(str(i))
        out.append(pattern.replace("{}", "{" + ",".join(runs) + "}") if idx else pattern)
    return ", ".join(out)


def shard_slices(shard: ExpertShard | None, planned: PlannedLoad) -> list[range] | None:
    """The experts of each planned layer this rank reads (None: every expert), from float and quantized
    checkpoints alike (``stream_experts`` reads only their tensors or slices); ``ConfigError`` naming
    ``expert_parallel`` where E is not divisible by the number of processes, from headers, before any tensor is
    read. Every call form has its sharded module (``SHARDED_MODULES``)."""
    if shard is None:
        return None
    for layer in planned.plan.layers:
        shard.owners(layer.site.layout.num_experts, layer.site.path)  # raises where E does not split evenly
    return [shard.experts(layer.site.layout.num_experts) for layer in planned.plan.layers]


def _read_nbytes(layers: list[LayerPlan], slices: list[range] | None, store: ExpertStore | None) -> int:
    """Bytes of routed experts this process read: of the checkpoint, or of the store (``expert_path``), for
    every expert or this rank's ``slices``."""
    shares: list[range | None] = [None] * len(layers) if slices is None else list(slices)
    if store is not None:
        return sum(
            store.share_nbytes(layer.site.path, mine) for layer, mine in zip(layers, shares, strict=True)
        )
    return sum(
        layer.nbytes if mine is None else layer.read_nbytes(mine) for layer, mine in zip(layers, shares)
    )


def experts_module(
    planned: PlannedLoad, engine: ExpertEngine, site: ExpertsSite, shard: ExpertShard | None
) -> CpuExperts:
    """The module that takes ``site``'s place: the family's (``EXPERTS_MODULES``), or with a shard of the
    experts the sharded one of the same call form (``SHARDED_MODULES``)."""
    if shard is None:
        return EXPERTS_MODULES[planned.spec.call](engine, layout=site.layout)
    owners = shard.owners(site.layout.num_experts, site.path)
    return SHARDED_MODULES[planned.spec.call](
        engine, site.layout, owners=owners, rank=shard.rank, group=shard.group
    )


@dataclass
class PlannedLoad:
    """Everything decided from headers and config before any tensor is read.

    ``checkpoint`` shows quantized weights under their logical keys (``quant.logical_tensors``); ``quantized``
    maps those keys to their stored tensors, read by ``method`` (None: a float checkpoint); ``model`` is on the
    meta device with its experts modules still in place; ``formats[j]`` is the format of ``plan.layers[j]``;
    ``hot`` maps each experts module's path to the expert ids it computes on the device (``gpu_experts``).
    """

    checkpoint: Checkpoint
    spec: ArchSpec
    model: PreTrainedModel
    sites: list[ExpertsSite]
    targets: dict[str, KeyTarget]
    method: QuantMethod | None
    quantized: dict[str, QuantizedWeight]
    plan: ExpertPlan
    formats: list[ExpertFormatChoice]
    hot: dict[str, tuple[int, ...]]


def plan_load(path: str | Path, opts: LoadOptions) -> PlannedLoad:
    """Open ``path``, build its model on the meta device and plan its experts; every check that needs no
    tensor data (files, config, quantization, expert tensors and their scales, formats) runs here."""
    stored = Checkpoint.open(path)
    method = checkpoint_quantization(stored)
    quantized = quantized_weights(stored, method)
    checkpoint = stored.with_tensors(logical_tensors(stored, quantized))
    config = hf.load_config(checkpoint, opts.trust_remote_code)
    spec = resolve_arch(config.model_type)
    model = hf.empty_model(config, opts.dtype, str(checkpoint.path))
    sites = find_experts(model, spec, config.model_type)
    targets = hf.checkpoint_targets(model, list(checkpoint.tensors))
    plan = plan_experts(checkpoint, sites, targets, quantized, method)
    formats = [
        opts.layer_format(
            None if layer.method is None else layer.method.native,
            layer.site.layout.hidden_size,
            layer.site.layout.intermediate_size,
            layer.site.path,
        )
        for layer in plan.layers
    ]
    check_int8_activations(opts, formats)
    hot = dict(
        zip(
            [s.path for s in sites],
            hot_sets(opts.experts.gpu_experts, [s.layout.num_experts for s in sites]),
        )
    )
    return PlannedLoad(checkpoint, spec, model, sites, targets, method, quantized, plan, formats, hot)


def load_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "bfloat16",
    planned: PlannedLoad | None = None,
    **options: Any,
) -> PreTrainedModel:
    """Load a local Hugging Face MoE checkpoint into its own transformers class, experts on the CPU.

    Args:
        path: directory with config.json and safetensors weights (one file, or shards with an index).
        device: where everything but the routed experts lives; default ``cuda:0`` when CUDA is available,
            else ``cpu``.
        dtype: ``"bfloat16"`` (default), ``"float16"``, ``"float32"`` (exactness tests) or ``"float64"``: the
            dtype of every weight, dense routed experts included (quantized checkpoints: their non-expert
            weights dequantized to it).
        **options: ``progress`` (see :class:`LoadOptions`), and the routed
            experts' options, either as ``experts=`` (a validated
            :class:`~moetune.config.experts.ExpertOptions`, e.g. a training config's) or one by one
            (``expert_format``, ``int4_group_size``, ``int4_symmetric``, ``expert_path``, ``expert_residency``,
            ``expert_residency_budget``, ``activation_policy``, ``num_threads``, ``check_finite``, ``gpu_experts``,
            ``expert_parallel``: under a process group, ``sharded`` loads only this rank's share of every
            layer's experts, ``moetune.layer.sharded``), and
            ``trust_remote_code`` (see :class:`LoadOptions`).
        planned: :func:`plan_load`'s result for ``path`` made with the same ``dtype``, expert options and
            ``trust_remote_code``, when the caller checked it already (``moetune train``'s preflight,
            ``load_model(adapter=)``): its meta-device model is then built once. The load uses it up (that model
            becomes the loaded one).

    Returns:
        The model's own class (e.g. ``Qwen3MoeForCausalLM``; for a vision-language checkpoint its
        ``...ForConditionalGeneration``, vision tower on ``device``: see ``hf.model_class``) in eval mode;
        every experts module is a :class:`~moetune.layer.CpuExperts` whose weights never were torch model
        parameters.

    Raises:
        ConfigError: a bad option. LoadError: a checkpoint problem (named file and key).
        ArchError: an architecture moetune cannot run (the supported ones are listed).
    """
    opts = LoadOptions.create(device=device, dtype=dtype, **options)
    if planned is None:
        planned = plan_load(path, opts)
    assert planned.model.dtype == opts.dtype, "planned= is a plan_load of this load's dtype"
    checkpoint, spec, model, sites, plan = (
        planned.checkpoint,
        planned.spec,
        planned.model,
        planned.sites,
        planned.plan,
    )
    shard = expert_shard(opts.experts.expert_parallel)  # every rank, here: it may create a process group
    slices = shard_slices(shard, planned)
    for site in sites:
        model.set_submodule(site.path, PendingExperts(site, model.get_submodule(site.path)))
    hf.skip_weight_init(model, sorted({s.path.rpartition(".")[0] for s in sites} - {""}))
    hf.check_non_expert(model, checkpoint, planned.targets, plan.other_keys)
    store = (
        None
        if opts.experts.expert_path is None
        else open_store(opts.experts, checkpoint.model_type, SourceIdentity.of(checkpoint), sites)
    )  # before any read

    # process-wide, once: every engine below computes on this pool
    set_engine_threads(opts.experts.num_threads)
    hf.load_weights(  # quantized non-expert weights are dequantized
        model, checkpoint, plan.other_keys, opts.device, opts.dtype, planned.quantized, planned.method
    )
    held = hot_bytes = 0
    experts = (
        stream_experts(
            checkpoint,
            plan.layers,
            planned.formats,
            opts.dtype,
            opts.engine,
            progress=opts.progress,
            experts=slices,
        )
        if store is None
        else zip(
            plan.layers,
            store_engines(
                store,
                [layer.site for layer in plan.layers],
                opts.dtype,
                opts.engine,
                opts.experts.expert_residency,
                opts.experts.expert_residency_budget,
                progress=opts.progress,
                experts=slices,
            ),
        )
    )
    for layer, engine in experts:
        module = experts_module(planned, engine, layer.site, shard)
        pending = model.get_submodule(layer.site.path)
        for name in layer.site.kept:  # loaded on the device with the rest of the model
            module.add_module(name, getattr(pending, name))
        model.set_submodule(layer.site.path, module)
        held += engine.weights.nbytes
        module.place_hot(planned.hot[layer.site.path], opts.device, opts.dtype)
        hot_bytes += module.hot.nbytes if module.hot is not None else 0
    hf.finish(model, checkpoint)
    if spec.shared_attr is not None:
        blocks = [model.get_submodule(s.path.rpartition(".")[0]) for s in sites]
        shared = [getattr(block, spec.shared_attr, None) for block in blocks]
        attach_shared_ahead(
            [
                (model.get_submodule(s.path), m if isinstance(m, nn.Module) else None)
                for s, m in zip(sites, shared)
            ]
        )

    if opts.experts.gpu_experts == AUTO:
        from moetune.layer.hot_auto import start_counting

        logger.info(
            "moetune: gpu_experts auto: counting the routing of %d experts modules until the hot experts are chosen "
            "(moetune.layer.hot_auto.place_auto; moetune train does it after gpu_experts_warmup steps)",
            start_counting(model),
        )
    hot_layers = [path for path, ids in planned.hot.items() if ids]
    if hot_layers:
        logger.info(
            "moetune: gpu_experts: %d experts in %d layers computed on %s (%s there; the engine computes the "
            "others and keeps its copy of all): %s",
            sum(len(ids) for ids in planned.hot.values()),
            len(hot_layers),
            opts.device,
            format_bytes(hot_bytes),
            layer_summary(hot_layers),
        )
    routers = [s.router for s in sites if s.router is not None]
    logger.info(
        "moetune: %s (%s routing): %d experts modules run in the CPU engine (%s read; held as %s, %s; %s): "
        "%s; routers kept on %s%s",
        type(model).__name__,
        spec.name,
        len(sites),
        format_bytes(_read_nbytes(plan.layers, slices, store)),
        ", ".join(sorted({str(f) for f in planned.formats}))
        if store is None
        else f"{store.manifest.format} from {store.root}, {opts.experts.expert_residency.value} residency",
        format_bytes(held),
        opts.dtype,
        layer_summary([s.path for s in sites]),
        opts.device,
        f": {layer_summary(routers)}" if routers else "",
    )
    if shard is not None:
        logger.info(
            "moetune rank %d of %d: expert_parallel sharded: this rank holds experts %d-%d of every MoE layer (%s); "
            "tokens routed elsewhere are exchanged with their owners",
            shard.rank,
            shard.world,
            slices[0].start if slices else 0,
            slices[0].stop - 1 if slices else 0,
            format_bytes(held),
        )
    return model
