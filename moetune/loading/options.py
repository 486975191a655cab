"""``LoadOptions``: everything ``moetune.load_model`` accepts, parsed and validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from moetune.config.experts import AUTO, ExpertOptions
from moetune.engine import EngineOptions
from moetune.engine.formats import FORMATS, ExpertFormat
from moetune.engine.formats.int4 import GROUP_SIZES
from moetune.engine.formats.mxfp4 import BLOCK as MXFP4_BLOCK
from moetune.errors import ConfigError

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


INT4_DEFAULT_GROUP_SIZE = 64  # 0.53 bytes/parameter at ~10% weight error (docs/formats.md)


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
        progress: show tqdm bars while loading.
        experts: the routed experts' options (format, store, residency, activation policy, threads, checks):
            :class:`moetune.config.experts.ExpertOptions`.
        trust_remote_code: the YAML's ``model.trust_remote_code`` (LLaMA-Factory's key), passed on as the
            config loader's. It changes no model: moetune always builds transformers' own classes, whose
            experts it swaps, and never runs a checkpoint's ``auto_map`` code (``kimi_k2`` loads as
            transformers' DeepSeek-V3 either way, ``hf.load_config``); with it set, the log names the class
            that runs instead. It matters to the tokenizer, which ``moetune train`` loads with it.
    """

    device: torch.device
    dtype: torch.dtype
    progress: bool = True
    experts: ExpertOptions = field(default_factory=ExpertOptions)
    trust_remote_code: bool = False

    @classmethod
    def create(
        cls,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype = "bfloat16",
        experts: ExpertOptions | None = None,
        **options: Any,
    ) -> LoadOptions:
        """Parse ``load_model``'s keyword arguments: the load options above, and either ``experts`` (validated
        options, e.g. a training config's) or the expert options one by one. ``ConfigError`` names every
        unknown or invalid one."""
        own = {"progress", "trust_remote_code"}
        expert_names = set(ExpertOptions.names())
        unknown = sorted(set(options) - own - expert_names)
        if unknown:
            known = ", ".join(sorted(own | expert_names | {"experts"}))
            raise ConfigError(f"unknown load_model option(s) {unknown}; known: device, dtype, {known}")
        given = {k: v for k, v in options.items() if k in expert_names}
        if experts is not None and given:
            raise ConfigError(
                f"load_model got experts= and the expert option(s) {sorted(given)}; pass one or the other"
            )
        progress = options.get("progress", True)
        if not isinstance(progress, bool):
            raise ConfigError(f"progress must be True or False; got {progress!r}")
        remote = options.get("trust_remote_code", False)
        if not isinstance(remote, bool):
            raise ConfigError(f"trust_remote_code must be True or False; got {remote!r}")
        return cls(
            device=_device(device),
            dtype=_dtype(dtype),
            progress=progress,
            experts=experts if experts is not None else ExpertOptions.create(**given),
            trust_remote_code=remote,
        )

    @property
    def engine(self) -> EngineOptions:
        """The expert engine's settings: the one place expert options become them. A float32/float64 load
        computes the experts in that dtype whatever their storage (quantized formats would otherwise compute
        in bf16 on CPUs with bf16 dot products)."""
        exact = self.dtype in (torch.float32, torch.float64)
        return EngineOptions(
            policy=self.experts.activation_policy,
            compute_dtype=self.dtype if exact else None,
            check_finite=self.experts.check_finite,
            expert_workers=self.experts.expert_workers,
            int8_activations=bool(self.experts.int8_activations),
        )

    def layer_format(
        self, stored: ExpertFormatChoice | None, hidden: int, intermediate: int, where: str
    ) -> ExpertFormatChoice:
        """The format of one experts module (``where``, H = ``hidden``, I = ``intermediate``), given the format
        a quantized checkpoint stores it in (``stored``: its method's ``native``; None for float experts):
        the one place that decides it. ``ConfigError`` if int4's group size does not divide H and I.

        A quantized layer stays as stored under ``auto`` and under its own format name; int4 options the
        checkpoint's INT4 does not have (a group size, zero points) ask for it quantized again, and any other
        format dequantizes it (and quantizes it again for int8/int4).
        """
        experts = self.experts
        name = experts.expert_format
        if name == AUTO:
            return stored if stored is not None else ExpertFormatChoice("dense")
        if name == "mxfp4" and (hidden % MXFP4_BLOCK or intermediate % MXFP4_BLOCK):
            raise ConfigError(
                f"expert_format mxfp4 needs H and I that are multiples of {MXFP4_BLOCK} (one scale per "
                f"{MXFP4_BLOCK} inputs); {where} has H = {hidden}, I = {intermediate}. Use int8, int4 or fp8"
            )
        if name != "int4":
            return stored if stored is not None and stored.name == name else ExpertFormatChoice(name)
        own = dict(stored.options) if stored is not None and stored.name == "int4" else {}
        g = (
            own.get("group_size", INT4_DEFAULT_GROUP_SIZE)
            if experts.int4_group_size is None
            else experts.int4_group_size
        )
        if hidden % g or intermediate % g:
            fits = [s for s in GROUP_SIZES if hidden % s == 0 and intermediate % s == 0]
            hint = (
                f"int4_group_size {' or '.join(map(str, fits))} fits" if fits else "use int8 or fp8 instead"
            )
            raise ConfigError(
                f"int4_group_size {g}{' (the default)' if experts.int4_group_size is None else ''} does not divide "
                f"the expert sizes of {where} (H = {hidden}, I = {intermediate}; groups run along each matrix's "
                f"input dimension); {hint}"
            )
        symmetric = own.get("symmetric", True) if experts.int4_symmetric is None else experts.int4_symmetric
        return ExpertFormatChoice("int4", (("group_size", g), ("symmetric", symmetric)))


def check_int8_activations(opts: LoadOptions, formats: list[ExpertFormatChoice]) -> None:
    """``int8_activations`` where this machine's kernels cannot take it (the format of a layer, the CPU, the
    compute dtype, ``MOETUNE_KERNELS``): the ``ConfigError`` now, before any weight is read, that the engines
    would raise (``EngineError``) once the first layer was loaded."""
    if not opts.experts.int8_activations:
        return
    from moetune.engine.gemm import int8_rows_problem
    from moetune.engine.plan import resolve_compute_dtype
    from moetune.sysinfo import cpu_info

    # int8 and int4 store 1-byte codes: their compute dtype is that of any 1-byte format
    compute = resolve_compute_dtype(torch.int8, opts.engine.compute_dtype)
    for name in dict.fromkeys(f.name for f in formats):
        why = int8_rows_problem(name, compute, cpu_info().isa)
        if why:
            raise ConfigError(why)
