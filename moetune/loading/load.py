"""``load_model``: a Hugging Face MoE checkpoint as its own transformers model, experts in the CPU engine.

    path -> Checkpoint (headers)  -> config -> ArchSpec -> model on meta -> experts sites
         -> plan: expert tensors per site; experts modules replaced on the instance by placeholders;
            non-expert keys checked against the model (every check before any tensor is read)
         -> non-expert weights through transformers' loader onto ``device``
         -> each layer's experts streamed from the shards into an engine; placeholder -> CpuExperts

The model's class, router modules, routing math, shared experts, output hooks (``output_router_logits``,
aux loss) and generation all stay transformers' own; only the ``experts`` modules are instances of
``moetune.layer.CpuExperts``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from moetune.arch import ExpertsSite, find_experts, resolve_arch
from moetune.errors import LoadError
from moetune.layer import CpuExperts
from moetune.layer.overlap import attach_shared_ahead
from moetune.loading import hf
from moetune.loading.checkpoint import Checkpoint
from moetune.loading.expert_plan import plan_experts
from moetune.loading.options import LoadOptions
from moetune.loading.stream import format_bytes, stream_experts

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


class PendingExperts(nn.Module):
    """Holds an experts module's place while the rest of the model loads; it has no tensors to materialise."""

    def __init__(self, site: ExpertsSite) -> None:
        super().__init__()
        self.site = site

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


def load_model(
    path: str | Path,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype = "bfloat16",
    **options: Any,
) -> PreTrainedModel:
    """Load a local Hugging Face MoE checkpoint into its transformers causal-LM class, experts on the CPU.

    Args:
        path: directory with config.json and safetensors weights (one file, or shards with an index).
        device: where everything but the routed experts lives; default ``cuda:0`` when CUDA is available,
            else ``cpu``.
        dtype: ``"bfloat16"`` (default), ``"float16"``, ``"float32"`` (exactness tests) or ``"float64"``: the
            dtype of every weight, routed experts included.
        **options: the other fields of :class:`LoadOptions` (``num_threads``, ``progress``, ``adapter``,
            ``adapter_trainable``).

    Returns:
        The model's own class (e.g. ``Qwen3MoeForCausalLM``) in eval mode; every experts module is a
        :class:`~moetune.layer.CpuExperts` whose weights never were torch model parameters.

    Raises:
        ConfigError: a bad option. LoadError: a checkpoint problem (named file and key).
        ArchError: an architecture moetune cannot run (the supported ones are listed).
    """
    opts = LoadOptions.create(device=device, dtype=dtype, **options)
    checkpoint = Checkpoint.open(path)
    config = hf.load_config(checkpoint)
    spec = resolve_arch(config.model_type)
    model = hf.empty_model(config, opts.dtype, str(checkpoint.path))
    sites = find_experts(model, spec, config.model_type)
    keys = list(checkpoint.tensors)
    targets = hf.checkpoint_targets(model, keys)
    plan = plan_experts(checkpoint, sites, targets)
    for site in sites:
        model.set_submodule(site.path, PendingExperts(site))
    hf.check_non_expert(model, checkpoint, targets, plan.other_keys)

    hf.load_weights(model, checkpoint, plan.other_keys, opts.device, opts.dtype)
    for layer, engine in stream_experts(
        checkpoint, plan.layers, opts.dtype, opts.engine, progress=opts.progress
    ):
        model.set_submodule(layer.site.path, CpuExperts(engine))
    hf.finish(model, checkpoint)
    if spec.shared_attr is not None:
        attach_shared_ahead(model, [s.path for s in sites], spec.shared_attr)

    routers = [s.router for s in sites if s.router is not None]
    logger.info(
        "moetune: %s (%s routing): %d experts modules run in the CPU engine (%s, %s): %s; "
        "routers kept on %s%s",
        type(model).__name__,
        spec.name,
        len(sites),
        format_bytes(plan.nbytes),
        opts.dtype,
        layer_summary([s.path for s in sites]),
        opts.device,
        f": {layer_summary(routers)}" if routers else "",
    )
    if opts.adapter is not None:
        from moetune.adapters import load_adapter

        return load_adapter(model, opts.adapter, is_trainable=opts.adapter_trainable)
    return model
