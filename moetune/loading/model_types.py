"""Checkpoint model types transformers does not know, loaded as a model type it does once the fields that
decide the semantics are checked to agree (``MODEL_TYPE_ALIASES``). No code from the checkpoint ever runs.

``kimi_k2`` (Moonshot's Kimi-K2-Base, -Instruct, -Instruct-0905, -Thinking): ``architectures:
[DeepseekV3ForCausalLM]``, an ``auto_map`` naming the repository's ``configuration_deepseek.DeepseekV3Config``
and ``modeling_deepseek.DeepseekV3ForCausalLM`` (DeepSeek-V3's remote code), and DeepSeek-V3's field names.
Moonshot set the model type apart only so inference engines can tell the two models apart, and documents
renaming it to ``deepseek_v3`` as the way to run K2 elsewhere; transformers' ``kimi_k25`` config does the
same for its text model. Here the config dict with ``model_type: deepseek_v3`` (``auto_map`` dropped)
becomes transformers' own ``DeepseekV3Config``, exactly what ``AutoConfig`` builds from the renamed file,
and the model is transformers' ``DeepseekV3ForCausalLM``.

Checked first, because transformers' DeepSeek-V3 hard-codes what the remote code reads from them; an
absent field takes the remote configuration class's default, which is the value required:

    scoring_func: sigmoid        sigmoid router scores (transformers: DeepseekV3TopkRouter)
    topk_method: noaux_tc        top-k of scores + e_score_correction_bias within the best groups
    moe_layer_freq: 1            every layer from first_k_dense_replace on is an MoE layer
    architectures                [DeepseekV3ForCausalLM]
    norm_topk_prob               a bool (transformers honours either value)
    n_group, topk_group          n_group divides n_routed_experts; 1 <= topk_group <= n_group

Fields transformers reads itself (sizes, ``routed_scaling_factor``, ``first_k_dense_replace``, the YaRN
``rope_scaling``, ``q_lora_rank`` ...) pass through unchanged. ``aux_loss_alpha``/``seq_aux`` (no auxiliary
loss with ``noaux_tc`` routing) and ``ep_size`` (expert parallelism) do not change the model's outputs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from moetune.errors import ArchError
from moetune.registry import Registry


@dataclass(frozen=True)
class ModelTypeAlias:
    """A checkpoint model type loaded as transformers' ``target``.

    ``fixed``: field -> (the value transformers' target implements, the value when the field is absent);
    ``architectures``: the class names ``architectures`` may list; ``problems``: further checks of the dict.
    """

    target: str
    architectures: tuple[str, ...]
    fixed: Mapping[str, tuple[Any, Any]]
    problems: Callable[[Mapping[str, Any]], list[str]] = field(default=lambda config: [], compare=False)
    source: str = ""  # what the checkpoints are, for messages

    def config_dict(self, config: Mapping[str, Any], where: str) -> dict[str, Any]:
        """``config`` (config.json as written) as the dict transformers' ``target`` class reads; ``ArchError``
        naming every field whose value transformers' model would not reproduce."""
        found = []
        for name, (value, default) in self.fixed.items():
            got = config.get(name, default)
            if got != value or type(got) is not type(value):
                found.append(
                    f"{name} is {got!r}; transformers' {self.target} implements {name} {value!r} only"
                )
        listed = config.get("architectures") or list(self.architectures)
        if not isinstance(listed, list) or any(a not in self.architectures for a in listed):
            found.append(f"architectures is {listed!r}; expected {list(self.architectures)}")
        found += self.problems(config)
        if found:
            raise ArchError(
                f"{where}: model_type {config.get('model_type')!r} ({self.source}) loads as transformers' "
                f"{self.target} without running the checkpoint's code, but its config disagrees with "
                f"{self.target}'s semantics:\n  " + "\n  ".join(found)
            )
        return {**{k: v for k, v in config.items() if k != "auto_map"}, "model_type": self.target}


def _deepseek_groups(config: Mapping[str, Any]) -> list[str]:
    """Group-limited routing that transformers' DeepSeek-V3 router can run."""
    out = []
    norm = config.get("norm_topk_prob", True)
    if not isinstance(norm, bool):
        out.append(f"norm_topk_prob is {norm!r}; it must be true or false")
    # absent: DeepSeek-V3's defaults, the same in its remote configuration class and in transformers'
    experts, groups, top = (
        config.get(k, d) for k, d in (("n_routed_experts", 256), ("n_group", 8), ("topk_group", 4))
    )
    if not (
        isinstance(experts, int)
        and isinstance(groups, int)
        and isinstance(top, int)
        and min(experts, groups, top) > 0
    ) or any(isinstance(v, bool) for v in (experts, groups, top)):
        out.append(
            f"n_routed_experts, n_group, topk_group are {experts!r}, {groups!r}, {top!r}; each must be a "
            "positive integer"
        )
    elif experts % groups or top > groups:
        out.append(
            f"n_group {groups} and topk_group {top} with n_routed_experts {experts}: n_group must divide "
            "n_routed_experts and topk_group must be at most n_group"
        )
    return out


MODEL_TYPE_ALIASES: Registry[ModelTypeAlias] = Registry("model type alias")

MODEL_TYPE_ALIASES.register("kimi_k2")(
    ModelTypeAlias(
        target="deepseek_v3",
        architectures=("DeepseekV3ForCausalLM",),
        fixed={
            "scoring_func": ("sigmoid", "sigmoid"),
            "topk_method": ("noaux_tc", "noaux_tc"),
            "moe_layer_freq": (1, 1),
        },
        problems=_deepseek_groups,
        source="Kimi-K2: DeepSeek-V3's architecture",
    )
)
