"""The routed experts' options: one frozen, typed object for ``load_model``'s keywords and the YAML.

``ExpertOptions`` is what ``moetune.load_model(..., expert_format=..., num_threads=...)`` accepts and what the
training YAML's ``moetune:`` mapping holds (besides ``device``); ``LoadOptions`` contains it, the training
recipe passes it whole, and ``LoadOptions.engine`` is the one place that turns it into the engine's settings.
:func:`expert_option_problems` is the one validation behind both; it reports every problem at once.

The YAML path first coerces strings as LLaMA-Factory's argument parser does (``"true"``, ``"4"``), then runs
the same checks; the library path checks Python values as given (``num_threads=True`` is an error).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.errors import ConfigError

AUTO = "auto"  # expert_format resolved per layer from what the checkpoint stores
# Spellings accepted besides the registered format names.
FORMAT_ALIASES = {"bf16": "dense", "fp8": "fp8_block"}
INT4_OPTIONS = ("int4_group_size", "int4_symmetric")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


class ActivationPolicy(str, enum.Enum):
    """What the engine's forward keeps for its backward."""

    RETAIN = "retain"  # gate_up pre-activations [N, 2I] and the LoRA A-projections [N, r]
    RECOMPUTE = "recompute"  # only the inputs; backward recomputes gate_up (one third of forward's GEMMs)


class ExpertParallel(str, enum.Enum):
    """How several processes (torchrun / accelerate launch) hold the routed experts (docs/distributed.md)."""

    REPLICATED = "replicated"  # every rank holds every expert; DDP averages the expert LoRA's gradients
    SHARDED = "sharded"  # rank r holds experts [r E/world, (r+1) E/world); tokens travel to their owners


class ExpertResidency(str, enum.Enum):
    """Where routed experts read from a converted store live while training."""

    RAM = "ram"  # every layer's pages in memory
    DISK = "disk"  # paged in just in time, at most the budget at once


def parse_bytes(value: object) -> int | None:
    """``1073741824``, ``"64GB"``, ``"1.5 GiB"``, ``"512MB"`` -> bytes; None if it is none of these."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value > 0 else None
    if not isinstance(value, str):
        return None
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if m is None or m.group(2).lower() not in _UNITS:
        return None
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    return n if n > 0 else None


def expert_format_names() -> list[str]:
    """Every accepted ``expert_format``: ``auto``, the names in the engine's format registry, the aliases."""
    from moetune.engine.formats import FORMATS  # the registry is the source of truth for format names

    return [AUTO, *FORMATS.names(), *FORMAT_ALIASES]


def int8_activation_formats() -> tuple[str, ...]:
    """The formats whose kernels offer ``int8_activations`` (the kernel registry's ``int8_rows``)."""
    from moetune.engine.kernels import int8_rows_formats

    return int8_rows_formats()


def int4_group_sizes() -> tuple[int, ...]:
    """The int4 group sizes the int4 format implements."""
    from moetune.engine.formats.int4 import GROUP_SIZES

    return tuple(GROUP_SIZES)


@dataclass(frozen=True)
class ExpertOptions:
    """How routed experts are held and computed. Build with :meth:`create` (validated).

    Attributes:
        expert_format: how routed experts are held in host RAM: ``auto`` (default: as the checkpoint stores
            them: ``fp8_block`` for FP8 checkpoints, ``mxfp4`` for MXFP4 ones (gpt-oss), else dense in the load
            dtype), a name in the engine's
            format registry (``dense``, ``int8``, ``int4``, ``fp8_block``, ...) or an alias (``bf16`` = dense,
            ``fp8`` = fp8_block). Stored as the registered name, or ``auto``.
        int4_group_size: int4 only: inputs per scale (None: 64); must divide H and I.
        int4_symmetric: int4 only: no zero points (None: True).
        int8_activations: int8 and int4 only: the fused kernels round each row of the experts' inputs (and of
            the gradients their backward takes, int4: per group of columns, times its scales) to 8-bit integers, a
            step of its largest magnitude / 127, and multiply them with the codes exactly (vpdpbusd; AVX2:
            vpmaddubsw): per product int8 1.3-1.8x its default (16-bit rows, a step of max / 32767) from 8 rows per
            expert, int4 1.1-1.7x its default (bf16) on AVX512-BF16, 1.5-3.9x its default (fp32) on AVX2; the
            error that adds is at most half a step per value (``kernels/int8_rows.h``, ``kernels/avx2_int8.h``;
            docs/formats.md).
            None / False: the default.
            Only the CPU kernels round: hot experts (``gpu_experts``) and experts past the kernels' rows are
            multiplied unrounded. int8 needs the AVX512-BF16 kernels (CPUs with AVX512-BF16 and VNNI, AMX ones
            included) and bf16 compute; int4 those, or the AVX2 kernels with fp32 compute (an AVX2-only CPU, or a
            float32 load); elsewhere the load's plan raises ``ConfigError`` before any weight is read
            (``loading.options.check_int8_activations``).
        expert_path: a store written by ``moetune convert`` to take the routed experts from.
        expert_residency: with ``expert_path``: ``ram`` or ``disk`` (paged layer by layer).
        expert_residency_budget: disk only: bytes (an int or a size such as ``"64GB"``); None: the two
            largest layers' files (with ``expert_parallel: sharded``: this process's experts of them; the
            budget is per process).
        activation_policy: ``retain`` (forward keeps what backward needs) or ``recompute``.
        num_threads: CPU threads of the expert engine (None: the physical cores visible to the process);
            ``load_model`` and ``moetune convert`` size torch's process-wide intra-op pool to it once
            (``moetune.engine.threads.set_engine_threads``).
        expert_workers: experts the engine computes at once, each on ``num_threads // expert_workers``
            intra-op threads (None: ``min(num_threads, 4)``, measured best on 2 to 16 cores; 1: one expert at a
            time on every thread; ``moetune.engine.threads.split_threads``).
        check_finite: the engine raises ``NonFiniteError`` on NaN/Inf, naming tensor and expert.
        gpu_experts: routed experts held and computed on the model's device ("hot" experts,
            ``moetune.layer.hot``): None or 0 (default: none), an int N (experts ``0..N-1`` of every MoE
            layer), one list of expert ids per MoE layer (a tuple of tuples once validated), or ``auto``: the
            experts most routed to over the first ``gpu_experts_warmup`` training steps, as many as
            ``gpu_experts_budget`` bytes of device memory hold (``moetune.layer.hot_auto``). Checked against the
            model's E and MoE layer count before anything loads (``hot_sets``).
        gpu_experts_budget: ``auto`` only: device bytes for the hot experts' copies (an int or ``"2GB"``).
        gpu_experts_warmup: ``auto`` only: training steps whose routing is counted before choosing (None: 4).
        expert_parallel: with several processes, ``replicated`` (default: every rank holds every expert) or
            ``sharded`` (each rank holds E / world experts of every MoE layer and computes every rank's tokens
            routed to them: ``moetune.layer.sharded``); one process holds every expert either way.
    """

    expert_format: str = AUTO
    int4_group_size: int | None = None
    int4_symmetric: bool | None = None
    int8_activations: bool | None = None
    expert_path: Path | None = None
    expert_residency: ExpertResidency = ExpertResidency.RAM
    expert_residency_budget: int | None = None
    activation_policy: ActivationPolicy = ActivationPolicy.RETAIN
    num_threads: int | None = None
    expert_workers: int | None = None
    check_finite: bool = False
    gpu_experts: int | str | tuple[tuple[int, ...], ...] | None = None
    gpu_experts_budget: int | None = None
    gpu_experts_warmup: int | None = None
    expert_parallel: ExpertParallel = ExpertParallel.REPLICATED

    @classmethod
    def names(cls) -> list[str]:
        """The option names (the keyword arguments and YAML keys)."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def create(cls, **values: Any) -> ExpertOptions:
        """Validate ``values`` (a subset of :meth:`names`; others raise) into options; ``ConfigError``
        listing every problem."""
        problems = expert_option_problems(values)
        if problems:
            raise ConfigError("; ".join(f"{name} {message}" for name, message in problems))
        return cls.from_valid(values)

    @classmethod
    def from_valid(cls, values: Mapping[str, Any]) -> ExpertOptions:
        """Options from values :func:`expert_option_problems` found nothing wrong with (canonical forms)."""
        out = dict(values)
        if "expert_format" in out:
            out["expert_format"] = FORMAT_ALIASES.get(out["expert_format"], out["expert_format"])
        if out.get("expert_path") is not None:
            out["expert_path"] = Path(out["expert_path"]).expanduser()
        if "expert_residency" in out:
            out["expert_residency"] = ExpertResidency(out["expert_residency"])
        if out.get("expert_residency_budget") is not None:
            out["expert_residency_budget"] = parse_bytes(out["expert_residency_budget"])
        if "activation_policy" in out:
            out["activation_policy"] = ActivationPolicy(out["activation_policy"])
        if out.get("gpu_experts_budget") is not None:
            out["gpu_experts_budget"] = parse_bytes(out["gpu_experts_budget"])
        if isinstance(out.get("gpu_experts"), (list, tuple)):
            out["gpu_experts"] = tuple(tuple(layer) for layer in out["gpu_experts"])
        if "expert_parallel" in out:
            out["expert_parallel"] = ExpertParallel(out["expert_parallel"])
        return cls(**out)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_of(allowed: list[str]) -> Callable[[object], str | None]:
    def check(value: object) -> str | None:
        return None if value in allowed else f"allowed: {', '.join(allowed)}"  # str enums equal their values

    return check


def _field_checks() -> dict[str, Callable[[object], str | None]]:
    """Per option: what is wrong with a value (None: nothing). None values are the defaults, always valid
    where the default is None."""
    sizes = int4_group_sizes()
    return {
        "expert_format": _one_of(expert_format_names()),
        "int4_group_size": lambda v: (
            None if _is_int(v) and v in sizes else f"allowed: {', '.join(map(str, sizes))}"
        ),
        "int4_symmetric": lambda v: None if isinstance(v, bool) else "allowed: true or false",
        "int8_activations": lambda v: None if isinstance(v, bool) else "allowed: true or false",
        "expert_path": lambda v: None if isinstance(v, (str, Path)) else "must be a directory path",
        "expert_residency": _one_of([r.value for r in ExpertResidency]),
        "expert_residency_budget": lambda v: (
            None
            if parse_bytes(v) is not None
            else "allowed: a positive number of bytes, or a size such as '64GB' or '512MiB'"
        ),
        "activation_policy": _one_of([p.value for p in ActivationPolicy]),
        "num_threads": lambda v: None if _is_int(v) and v >= 1 else "must be a positive integer",
        "expert_workers": lambda v: None if _is_int(v) and v >= 1 else "must be a positive integer",
        "check_finite": lambda v: None if isinstance(v, bool) else "allowed: true or false",
        "gpu_experts": _gpu_experts_problem,
        "gpu_experts_budget": lambda v: (
            None
            if parse_bytes(v) is not None
            else "allowed: a positive number of bytes, or a size such as '2GB'"
        ),
        "gpu_experts_warmup": lambda v: None if _is_int(v) and v >= 1 else "must be a positive integer",
        "expert_parallel": _one_of([p.value for p in ExpertParallel]),
    }


GPU_EXPERTS_ALLOWED = (
    "allowed: 0 (none), a number N of experts per MoE layer (ids 0..N-1), one list of distinct expert ids "
    "per MoE layer, e.g. [[0, 5], [3]], or auto (with gpu_experts_budget)"
)
GPU_AUTO_OPTIONS = ("gpu_experts_budget", "gpu_experts_warmup")


def _gpu_experts_problem(value: object) -> str | None:
    """What is wrong with a ``gpu_experts`` value on its own (the model's E and layer count are checked by
    :func:`hot_sets`)."""
    if value == AUTO:
        return None
    if _is_int(value):
        return None if value >= 0 else GPU_EXPERTS_ALLOWED  # type: ignore[operator]
    if not isinstance(value, (list, tuple)) or not all(isinstance(layer, (list, tuple)) for layer in value):
        return GPU_EXPERTS_ALLOWED
    for j, layer in enumerate(value):
        if not all(_is_int(e) and e >= 0 for e in layer):
            return f"layer {j} lists {list(layer)!r}, not expert ids (integers >= 0); {GPU_EXPERTS_ALLOWED}"
        if len(set(layer)) != len(layer):
            return f"layer {j} lists an expert twice: {list(layer)!r}; {GPU_EXPERTS_ALLOWED}"
    return None


def hot_sets(
    gpu_experts: int | str | tuple[tuple[int, ...], ...] | None, num_experts: list[int]
) -> list[tuple[int, ...]]:
    """The hot expert ids of each MoE layer (``num_experts[j]``: E of layer j, in the model's module order),
    sorted; ``ConfigError`` naming ``gpu_experts``, its value and what the model allows when they do not fit.
    ``auto``: none yet (they are chosen during training, ``moetune.layer.hot_auto``)."""
    if not gpu_experts or isinstance(gpu_experts, str):  # str: auto (validated)
        return [() for _ in num_experts]
    if isinstance(gpu_experts, int):
        too_many = [e for e in num_experts if gpu_experts > e]
        if too_many:
            raise ConfigError(
                f"gpu_experts: got {gpu_experts}, more than the {min(too_many)} routed experts of a MoE layer of "
                f"this model; allowed: 0..{min(num_experts)} (every layer's experts on the device is not what "
                "moetune is for: load the model with transformers instead)"
            )
        return [tuple(range(gpu_experts)) for _ in num_experts]
    if len(gpu_experts) != len(num_experts):
        raise ConfigError(
            f"gpu_experts: got {len(gpu_experts)} per-layer lists, but the model has {len(num_experts)} MoE layers; "
            f"allowed: one list of expert ids per MoE layer (an empty list for none), or a number N"
        )
    for j, (layer, e) in enumerate(zip(gpu_experts, num_experts)):
        bad = [i for i in layer if i >= e]
        if bad:
            raise ConfigError(
                f"gpu_experts: MoE layer {j} lists expert ids {bad}, but that layer has E = {e} experts; "
                f"allowed: ids 0..{e - 1}"
            )
    return [tuple(sorted(layer)) for layer in gpu_experts]


def expert_option_problems(values: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(option, what is wrong and what is allowed)`` for every problem of ``values``: unknown names, bad
    values, and options that contradict each other. The one check behind ``load_model`` and the YAML."""
    checks = _field_checks()
    problems = [
        (name, f"is not an expert option; allowed: {', '.join(ExpertOptions.names())}")
        for name in values
        if name not in checks
    ]
    # null is the default only where the default is None; elsewhere (a YAML `activation_policy:` left empty) it is
    # checked like any other value
    nullable = {f.name for f in dataclasses.fields(ExpertOptions) if f.default is None}
    for name, check in checks.items():
        value = values.get(name)
        if (value is not None or (name in values and name not in nullable)) and (
            message := check(value)
        ) is not None:
            problems.append((name, f"got {value!r}; {message}"))
    bad = {name for name, _ in problems}
    expert_format = values.get("expert_format", AUTO)
    if "expert_format" not in bad and FORMAT_ALIASES.get(expert_format, expert_format) != "int4":
        problems += [
            (
                name,
                f"is set ({values[name]!r}) but applies to expert_format int4 only; expert_format is "
                f"{expert_format!r}. Set expert_format: int4, or remove {name}",
            )
            for name in INT4_OPTIONS
            if values.get(name) is not None and name not in bad
        ]
    if (
        "expert_format" not in bad
        and "int8_activations" not in bad
        and values.get("int8_activations")
        and FORMAT_ALIASES.get(expert_format, expert_format) not in int8_activation_formats()
    ):
        problems.append(
            (
                "int8_activations",
                f"is true but applies to expert_format {' or '.join(int8_activation_formats())} only (their kernels); "
                f"expert_format is {expert_format!r}. Set one of them, or remove int8_activations",
            )
        )
    if "gpu_experts" not in bad:
        auto = values.get("gpu_experts") == AUTO
        if auto and values.get("gpu_experts_budget") is None:
            problems.append(
                (
                    "gpu_experts",
                    "is 'auto' but gpu_experts_budget is not set; set gpu_experts_budget to the device memory the "
                    "hot experts may take, e.g. '2GB'",
                )
            )
        problems += [
            (
                name,
                f"is set ({values[name]!r}) but applies to gpu_experts: auto only; gpu_experts is "
                f"{values.get('gpu_experts')!r}. Set gpu_experts: auto, or remove {name}",
            )
            for name in GPU_AUTO_OPTIONS
            if not auto and values.get(name) is not None and name not in bad
        ]
    sharded = values.get("expert_parallel") == ExpertParallel.SHARDED and "expert_parallel" not in bad
    if sharded and values.get("gpu_experts"):
        problems.append(
            (
                "expert_parallel",
                f"is 'sharded' but gpu_experts is set ({values['gpu_experts']!r}); sharded experts are held "
                "in engines without hot experts for now. Remove gpu_experts, or use expert_parallel: replicated",
            )
        )
    residency = values.get("expert_residency", ExpertResidency.RAM)
    if "expert_residency" not in bad:
        disk = ExpertResidency(residency) is ExpertResidency.DISK
        if disk and values.get("expert_path") is None:
            problems.append(
                (
                    "expert_residency",
                    "'disk' pages experts from a converted store: convert once (moetune convert SRC DST "
                    "--format int8) and set expert_path to DST",
                )
            )
        budget = values.get("expert_residency_budget")
        if not disk and budget is not None and "expert_residency_budget" not in bad:
            problems.append(
                ("expert_residency_budget", f"is set ({budget!r}) but applies to expert_residency disk only")
            )
    return problems
