"""The one contract every expert weight format offers to the engine.

A format holds one layer's routed experts in host memory: gate_up ``[E, 2I, H]`` (gate rows first) and
down ``[E, H, I]``, stored however the format likes. The engine only asks for one expert's matrix at a
time, in the dtype it computes in, written into a buffer it owns (``tile``); tests and exports ask for
everything at once (``dequantize``). Optional biases are part of the layer, not the format.

Serialization (pre-quantized stores) is one implementation for every format: ``state_tensors()`` gives the
tensors the stored-tensor constructor takes, by argument name (``STATE_FIELDS``), and ``params()`` the
``from_dense`` options that reproduce the quantization (int4's group size and symmetry);
``from_state_tensors(tensors, **params)`` calls that constructor, which checks every tensor.
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar, Literal

import torch

from moetune.engine.kernels.loader import a8_kernel
from moetune.errors import EngineError
from moetune.registry import Registry

Projection = Literal["gate_up", "down"]


class ExpertFormat(ABC):
    """One layer's routed expert weights. Subclasses register in ``FORMATS`` under their format name."""

    name: str
    num_experts: int  # E
    hidden_size: int  # H
    intermediate_size: int  # I
    # The stored-tensor constructor's tensor arguments, each also an attribute of the same name; optional
    # ones (int4's zero points) may be None.
    STATE_FIELDS: ClassVar[tuple[str, ...]]

    @classmethod
    @abstractmethod
    def from_dense(cls, gate_up: torch.Tensor, down: torch.Tensor) -> ExpertFormat:
        """Build from dense float weights: gate_up ``[E, 2I, H]``, down ``[E, H, I]`` (bf16, fp16, fp32 or fp64).

        Formats may add keyword-only options with defaults (int4's ``group_size``); the weights are not kept.
        """

    def shape(self, proj: Projection) -> tuple[int, int]:
        """The per-expert matrix shape as the engine multiplies it: ``[2I, H]`` or ``[H, I]``."""
        if proj == "gate_up":
            return (2 * self.intermediate_size, self.hidden_size)
        return (self.hidden_size, self.intermediate_size)

    @abstractmethod
    def tile(
        self,
        proj: Projection,
        expert: int,
        dtype: torch.dtype,
        buf: torch.Tensor | None,
        rows: slice | None = None,
    ) -> torch.Tensor:
        """Rows ``rows`` (default: all) of expert ``expert``'s ``proj`` matrix, ``[R, D_in]`` in ``dtype``.

        Returns a view of the stored weight when no conversion is needed (no copy), otherwise writes into
        ``buf`` (shape ``[R, D_in]``, dtype ``dtype``, owned by the caller and reused across calls) and returns
        it. The engine asks for row blocks small enough to stay in cache while their GEMM runs, so a
        conversion costs one read of the stored bytes, not a write and a re-read of a full-size tile.
        """

    # compute dtypes in which ``scaled_tile`` is offered (none by default); an instance attribute where a wrapper
    # (PagedExperts) takes its format's
    SCALED_TILE_DTYPES: tuple[torch.dtype, ...] = ()

    def scaled_tile(
        self, proj: Projection, expert: int, dtype: torch.dtype, buf: torch.Tensor, rows: slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``rows`` of expert ``expert``'s ``proj`` matrix factored as ``diag(row_scale) @ codes``, for
        ``dtype`` in ``SCALED_TILE_DTYPES``.

        ``codes`` ``[R, D_in]`` in ``dtype`` holds numbers that ``dtype`` represents exactly (written into
        ``buf``), ``row_scale`` ``[R]`` fp32. The GEMMs then convert the codes in one exact pass and apply the
        scale on the GEMM's ``[n, D_out]`` side (forward: its output; backward: its input gradient) instead of
        forming the dequantized weight (``gemm.BlockedGemm``).
        """
        raise NotImplementedError(f"{self.name} offers no scaled tiles")

    # per kernel variant (``kernels.loader.VARIANTS``' names), the rows per expert up to which ``fused_gemm`` is
    # used with the compute dtype that variant computes in (``KernelVariant.compute``; a variant not listed, or an
    # empty mapping: no fused kernel for this format); an instance attribute where a wrapper takes its format's
    FUSED_MAX_ROWS: Mapping[str, int] = MappingProxyType({})
    # the same for the products with 8-bit activation rows (``int8_activations``), where a variant's differ from
    # ``FUSED_MAX_ROWS`` (a variant not listed: ``FUSED_MAX_ROWS``' rows)
    INT8_ROWS_MAX_ROWS: Mapping[str, int] = MappingProxyType({})

    def fused_operands(self, proj: Projection, expert: int) -> tuple[str, tuple[Any, ...]]:
        """The compiled kernel for expert ``expert``'s ``proj`` matrix (its name in ``kernels.load_fused()``'s
        module) and the weight arguments it takes after ``forward, a, out`` (for formats with
        an entry in ``FUSED_MAX_ROWS``)."""
        raise NotImplementedError(f"{self.name} has no fused kernel")

    def fused_run_operands(self, proj: Projection) -> tuple[str, tuple[Any, ...]]:
        """:meth:`fused_operands` for every expert at once: the kernel's run form (``<kernel>_run``, over a run of
        experts, ``entry.h``) and the weight arguments with their leading ``[E]`` dimension."""
        raise NotImplementedError(f"{self.name} has no fused kernel")

    def fused_gemm(
        self,
        kernels: Any,
        forward: bool,
        proj: Projection,
        expert: int,
        a: torch.Tensor,
        out: torch.Tensor,
        accumulate: bool,
        int8_rows: bool = False,
    ) -> None:
        """One product with expert ``expert``'s ``proj`` matrix W ``[D_out, D_in]`` on the compiled kernels
        (``kernels``: a built variant, ``kernels.load_fused()`` or ``load_variant(name)``), the codes dequantized
        in registers; a and out in the variant's compute dtype (bf16, or fp32 for AVX2).

        forward: out ``[n, D_out]`` = a ``[n, D_in]`` @ W^T; backward: out ``[n, D_in]`` = a ``[n, D_out]`` @ W
        (``accumulate``: out +=). fp32 sums, rounded once into out; W's values are those of ``tile(.., dtype)``
        (int8: the codes times the fp32 row scale applied to the fp32 sums, as ``scaled_tile``'s path does), except
        where a variant's backward takes a weight's group-scaled form (``kernels/decoders.h``: W = S * V, int4 with
        groups of >= 32, fp8_block, mxfp4; the AVX512-BF16 variant with few rows of a): a times S rounded once to
        the compute dtype, times V, one rounding as many as the weight's own (mxfp4: the same products).
        ``int8_rows``: its form with a's rows rounded to 8-bit integers (``kernels.a8_kernel``; ``int8_activations``).
        """
        kernel, weights = self.fused_operands(proj, expert)
        getattr(kernels, a8_kernel(kernel) if int8_rows else kernel)(forward, a, out, *weights, accumulate)

    def row_align(self, proj: Projection) -> int:
        """Row blocks asked of ``tile`` start at multiples of this (block-scaled formats: their block height)."""
        return 1

    @abstractmethod
    def needs_buffer(self, dtype: torch.dtype) -> bool:
        """Whether ``tile(..., dtype, ...)`` writes into a caller buffer (False: it returns views)."""

    def stored_in(self, proj: Projection, dtype: torch.dtype) -> torch.Tensor | None:
        """Every expert's ``proj`` matrix ``[E, D_out, D_in]`` as stored, where it is stored in ``dtype`` in host
        memory (``tile`` would return its views); else None (the default)."""
        return None

    def dequantize(
        self, dtype: torch.dtype = torch.float32, out: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts as dense tensors: gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` in ``dtype``, new ones or
        ``out`` filled (those shapes and dtype, any strides: ``DenseExperts.empty``'s rows) and returned."""
        if out is None:
            e = self.num_experts
            out = (
                torch.empty((e, *self.shape("gate_up")), dtype=dtype),
                torch.empty((e, *self.shape("down")), dtype=dtype),
            )
        projs: tuple[Projection, Projection] = ("gate_up", "down")
        for proj, full in zip(projs, out):
            want = (self.num_experts, *self.shape(proj))
            if tuple(full.shape) != want or full.dtype != dtype:
                raise EngineError(
                    f"{self.name}.dequantize: out's {proj} is {full.dtype} {tuple(full.shape)}; {dtype} {want} "
                    "was asked for"
                )
            # formats decode into a buffer with contiguous rows: padded rows take each expert through one
            contiguous = full.is_contiguous()
            buf = None if contiguous else torch.empty(self.shape(proj), dtype=dtype)
            for e in range(self.num_experts):
                full[e].copy_(self.tile(proj, e, dtype, full[e] if contiguous else buf))
        return out[0], out[1]

    def params(self) -> dict[str, Any]:
        """The keyword options of ``from_dense`` that reproduce this quantization, as JSON values (none here)."""
        return {}

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by ``STATE_FIELDS`` name, absent optional ones left out; the tensors themselves,
        not copies. ``from_state_tensors(fmt.state_tensors(), **fmt.params())`` rebuilds an equal format."""
        return {f: t for f in self.STATE_FIELDS if (t := getattr(self, f)) is not None}

    @classmethod
    def from_state_tensors(cls, tensors: Mapping[str, torch.Tensor], **params: Any) -> ExpertFormat:
        """Rebuild from ``state_tensors()`` and ``params()`` without copying (the constructor checks dtypes and
        shapes). ``EngineError`` for unknown or missing tensor names, unknown parameters, or parameters the
        tensors contradict (int4 ``symmetric=False`` without zero points)."""
        options = [
            p.name for p in inspect.signature(cls.from_dense).parameters.values() if p.kind is p.KEYWORD_ONLY
        ]
        init = inspect.signature(cls.__init__).parameters
        required = {n for n, p in init.items() if n != "self" and p.default is p.empty}
        problems = []
        if unknown := sorted(set(params) - set(options)):
            problems.append(f"unknown parameter(s) {unknown} (allowed: {options})")
        if unknown := sorted(set(tensors) - set(cls.STATE_FIELDS)):
            problems.append(f"unknown tensor(s) {unknown} (allowed: {list(cls.STATE_FIELDS)})")
        if missing := sorted(required & set(cls.STATE_FIELDS) - set(tensors)):
            problems.append(f"missing tensor(s) {missing}")
        if missing := sorted(required - set(cls.STATE_FIELDS) - set(params)):
            problems.append(f"missing parameter(s) {missing}")
        if problems:
            raise EngineError(f"{cls.name}.from_state_tensors: {'; '.join(problems)}")
        build: Any = cls  # the stored-tensor constructor of the subclass
        fmt: ExpertFormat = build(**tensors, **{k: v for k, v in params.items() if k in init})
        held = fmt.params()
        if wrong := {k: v for k, v in params.items() if held.get(k) != v}:
            actual = {k: held.get(k) for k in wrong}
            raise EngineError(
                f"{cls.name}.from_state_tensors: parameters {wrong} disagree with the tensors, which hold {actual}"
            )
        return fmt

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of host memory the stored expert weights occupy."""

    @property
    def bytes_per_param(self) -> float:
        """Resident bytes per expert parameter, scales included: ``nbytes / (E * 3 * H * I)``."""
        return self.nbytes / (3 * self.num_experts * self.hidden_size * self.intermediate_size)

    @property
    @abstractmethod
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the stored values (for dense formats, the dtype GEMMs may use directly)."""


FORMATS: Registry[type[ExpertFormat]] = Registry("expert weight format")
