"""``LoadOptions``: everything ``moetune.load_model`` accepts, parsed and validated once."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from moetune.engine import ActivationPolicy, EngineOptions
from moetune.engine.formats import FORMATS, ExpertFormat
from moetune.engine.formats.int4 import GROUP_SIZES
from moetune.errors import ConfigError
from moetune.loading.from_store import ExpertResidency, parse_bytes, residency_problems

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,  # reference runs only
}


def _dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in DTYPES.values():
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in DTYPES:
        return DTYPES[value.removeprefix("torch.")]
    raise ConfigError(
        f"dtype {value!r} is not supported; use one of {', '.join(DTYPES)} (or the torch dtype)"
    )


def _device(value: str | torch.device | None) -> torch.device:
    if value is None:  # the documented default: the first GPU when there is one
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {value!r} is not a torch device (e.g. 'cuda:0', 'cpu'): {e}") from e
    if device.type == "meta":
        raise ConfigError("device 'meta' holds no weights; use 'cuda:N' or 'cpu'")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                f"device {value!r} asks for CUDA, but torch sees no CUDA device; use device='cpu'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


AUTO = "auto"  # expert_format resolved per layer: fp8_block where the checkpoint stores FP8, else dense
# Spellings accepted besides the FORMATS names: the names for the dense and FP8 formats.
FORMAT_ALIASES = {"bf16": "dense", "fp8": "fp8_block"}
INT4_OPTIONS = ("int4_group_size", "int4_symmetric")
INT4_DEFAULT_GROUP_SIZE = 64  # 0.53 bytes/parameter at ~10% weight error (docs/formats.md)


def expert_format_names() -> list[str]:
    """Every accepted ``expert_format`` value: ``auto``, the registered format names, their aliases."""
    return [AUTO, *FORMATS.names(), *FORMAT_ALIASES]


def expert_format_problems(
    expert_format: object, int4_group_size: object = None, int4_symmetric: object = None
) -> list[tuple[str, str]]:
    """``(option, what is wrong and what is allowed)`` for each bad expert-format option.

    The one check behind both ``load_model``'s keyword arguments and the YAML's ``moetune:`` section.
    """
    problems = []
    if not isinstance(expert_format, str) or expert_format not in expert_format_names():
        problems.append(
            ("expert_format", f"got {expert_format!r}; allowed: {', '.join(expert_format_names())}")
        )
    if int4_group_size is not None and (
        not isinstance(int4_group_size, int)
        or isinstance(int4_group_size, bool)
        or int4_group_size not in GROUP_SIZES
    ):
        problems.append(
            ("int4_group_size", f"got {int4_group_size!r}; allowed: {', '.join(map(str, GROUP_SIZES))}")
        )
    if int4_symmetric is not None and not isinstance(int4_symmetric, bool):
        problems.append(("int4_symmetric", f"got {int4_symmetric!r}; allowed: true or false"))
    if not problems and FORMAT_ALIASES.get(str(expert_format), expert_format) != "int4":
        for name, value in zip(INT4_OPTIONS, (int4_group_size, int4_symmetric)):
            if value is not None:
                problems.append(
                    (
                        name,
                        f"is set ({value!r}) but applies to expert_format int4 only; expert_format is "
                        f"{expert_format!r}. Set expert_format: int4, or remove {name}",
                    )
                )
    return problems


@dataclass(frozen=True)
class ExpertFormatChoice:
    """The format one layer's routed experts are held in: a ``FORMATS`` name and its ``from_dense`` options."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    def from_dense(self, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertFormat:
        """gate_up ``[E, 2I, H]``, down ``[E, H, I]`` (float) in this format (``dense`` keeps them as given)."""
        return FORMATS.get(self.name).from_dense(gate_up, down, **dict(self.options))

    @property
    def keeps_input(self) -> bool:
        """``from_dense`` holds the tensors it is given (dense) rather than quantizing them into new ones."""
        return self.name == "dense"

    def __str__(self) -> str:
        opts = ", ".join(f"{k}={v}" for k, v in self.options)
        return f"{self.name} ({opts})" if opts else self.name


@dataclass(frozen=True)
class LoadOptions:
    """How to load a checkpoint.

    Attributes:
        device: where embeddings, attention, norms, routers, shared experts, dense MLPs and lm_head live.
        dtype: dtype of those weights and of the stored routed experts (the engine computes bf16 experts in
            fp32 tiles where the CPU lacks bf16 dot products).
        num_threads: CPU threads of the expert engine (None: the physical cores visible to the process);
            ``load_model`` sizes torch's process-wide intra-op pool to it once (``set_engine_threads``).
        activation_policy: ``retain`` (default: forward keeps what backward needs) or ``recompute`` (forward
            keeps only its inputs; backward recomputes the expert activations, trading time for memory).
        check_finite: make the engine raise ``NonFiniteError`` on NaN/Inf, naming tensor and expert (debug).
        progress: show tqdm bars while loading.
        adapter: a saved moetune/PEFT adapter directory to attach after loading (returns a ``PeftModel``).
        adapter_trainable: keep that adapter's LoRA trainable (to continue training it).
        expert_format: how routed experts are held in host RAM: ``auto`` (default: as the checkpoint stores
            them, i.e. ``fp8_block`` for FP8 checkpoints, else dense in ``dtype``), ``bf16``/``dense`` (dense in
            ``dtype``: bf16 for a bfloat16 load, fp32 for a float32 one; FP8 checkpoints are dequantized),
            ``int8``, ``int4`` (quantized at load time, layer by layer) or ``fp8``/``fp8_block`` (native for FP8
            checkpoints, quantized at load time otherwise). Stored as the ``FORMATS`` name, or ``auto``.
        int4_group_size: int4 only: 32, 64 or 128 inputs per scale (None: 64); must divide H and I.
        int4_symmetric: int4 only: no zero points (None: True).
        expert_path: a store written by ``moetune convert``: the routed experts come from its memory-mapped
            files instead of the checkpoint (checked against the model before any weight is read).
        expert_residency: with ``expert_path``: ``ram`` (every page resident) or ``disk`` (paged in layer by
            layer, the next one prefetched, at most ``expert_residency_budget`` bytes at once).
        expert_residency_budget: disk only: bytes, as an int or a size like ``"64GB"`` (None: the least that
            works, the two largest layer files).
    """

    device: torch.device
    dtype: torch.dtype
    num_threads: int | None = None
    activation_policy: ActivationPolicy = ActivationPolicy.RETAIN
    check_finite: bool = False
    progress: bool = True
    adapter: Path | None = None
    adapter_trainable: bool = False
    expert_format: str = AUTO
    int4_group_size: int | None = None
    int4_symmetric: bool | None = None
    expert_path: Path | None = None
    expert_residency: ExpertResidency = ExpertResidency.RAM
    expert_residency_budget: int | None = None

    @classmethod
    def create(
        cls, device: str | torch.device | None = None, dtype: str | torch.dtype = "bfloat16", **options: Any
    ) -> LoadOptions:
        """Parse ``load_model``'s keyword arguments; ``ConfigError`` names an unknown or invalid one."""
        known = {f.name for f in fields(cls)} - {"device", "dtype"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(
                f"unknown load_model option(s) {unknown}; known: device, dtype, {', '.join(sorted(known))}"
            )
        threads = options.get("num_threads")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"num_threads must be a positive int or None; got {threads!r}")
        policy = options.get("activation_policy", ActivationPolicy.RETAIN)
        allowed_policies = [p.value for p in ActivationPolicy]
        if policy not in allowed_policies:  # the enum's members equal their values (a str enum)
            raise ConfigError(f"activation_policy must be one of {allowed_policies}; got {policy!r}")
        check_finite = options.get("check_finite", False)
        if not isinstance(check_finite, bool):
            raise ConfigError(f"check_finite must be True or False; got {check_finite!r}")
        progress = options.get("progress", True)
        if not isinstance(progress, bool):
            raise ConfigError(f"progress must be True or False; got {progress!r}")
        adapter = options.get("adapter")
        if adapter is not None:
            adapter = Path(adapter)
            if not (adapter / "adapter_config.json").is_file():
                raise ConfigError(
                    f"adapter {str(adapter)!r} is not an adapter directory: no adapter_config.json in it "
                    "(pass the output_dir of `moetune train`, or a PEFT save_pretrained directory)"
                )
        trainable = options.get("adapter_trainable", False)
        if not isinstance(trainable, bool):
            raise ConfigError(f"adapter_trainable must be True or False; got {trainable!r}")
        expert_format = options.get("expert_format", AUTO)
        int4 = {name: options.get(name) for name in INT4_OPTIONS}
        store = {
            "expert_path": options.get("expert_path"),
            "expert_residency": options.get("expert_residency", ExpertResidency.RAM),
            "expert_residency_budget": options.get("expert_residency_budget"),
        }
        problems = expert_format_problems(expert_format, **int4) + residency_problems(**store)
        if problems:
            raise ConfigError("; ".join(f"{name} {message}" for name, message in problems))
        return cls(
            device=_device(device),
            dtype=_dtype(dtype),
            num_threads=threads,
            activation_policy=ActivationPolicy(policy),
            check_finite=check_finite,
            progress=progress,
            adapter=adapter,
            adapter_trainable=trainable,
            expert_format=FORMAT_ALIASES.get(expert_format, expert_format),
            **int4,
            expert_path=None if store["expert_path"] is None else Path(store["expert_path"]).expanduser(),
            expert_residency=ExpertResidency(store["expert_residency"]),
            expert_residency_budget=parse_bytes(store["expert_residency_budget"]),
        )

    @property
    def engine(self) -> EngineOptions:
        """The expert engine's settings. A float32/float64 load computes the experts in that dtype whatever
        their storage (quantized formats would otherwise compute in bf16 on CPUs with bf16 dot products)."""
        exact = self.dtype in (torch.float32, torch.float64)
        return EngineOptions(
            policy=self.activation_policy,
            compute_dtype=self.dtype if exact else None,
            check_finite=self.check_finite,
        )

    def layer_format(
        self, stored_fp8: bool, hidden: int, intermediate: int, where: str
    ) -> ExpertFormatChoice:
        """The format of one experts module (``where``, H = ``hidden``, I = ``intermediate``), given whether the
        checkpoint stores it in FP8: the one place that decides it. ``ConfigError`` if int4's group size does
        not divide H and I."""
        name = self.expert_format
        if name == AUTO:
            name = "fp8_block" if stored_fp8 else "dense"
        if name != "int4":
            return ExpertFormatChoice(name)
        g = INT4_DEFAULT_GROUP_SIZE if self.int4_group_size is None else self.int4_group_size
        if hidden % g or intermediate % g:
            fits = [s for s in GROUP_SIZES if hidden % s == 0 and intermediate % s == 0]
            hint = (
                f"int4_group_size {' or '.join(map(str, fits))} fits" if fits else "use int8 or fp8 instead"
            )
            raise ConfigError(
                f"int4_group_size {g}{' (the default)' if self.int4_group_size is None else ''} does not divide "
                f"the expert sizes of {where} (H = {hidden}, I = {intermediate}; groups run along each matrix's "
                f"input dimension); {hint}"
            )
        symmetric = True if self.int4_symmetric is None else self.int4_symmetric
        return ExpertFormatChoice("int4", (("group_size", g), ("symmetric", symmetric)))
