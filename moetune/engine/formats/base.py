"""The one contract every expert weight format offers to the engine.

A format holds one layer's routed experts in host memory: gate_up ``[E, 2I, H]`` (gate rows first) and
down ``[E, H, I]``, stored however the format likes. The engine only asks for one expert's matrix at a
time, in the dtype it computes in, written into a buffer it owns (``tile``); tests and exports ask for
everything at once (``dequantize``). Optional biases are part of the layer, not the format.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch

from moetune.registry import Registry

Projection = Literal["gate_up", "down"]


class ExpertFormat(ABC):
    """One layer's routed expert weights. Subclasses register in ``FORMATS`` under their format name."""

    name: str
    num_experts: int  # E
    hidden_size: int  # H
    intermediate_size: int  # I

    def shape(self, proj: Projection) -> tuple[int, int]:
        """The per-expert matrix shape as the engine multiplies it: ``[2I, H]`` or ``[H, I]``."""
        if proj == "gate_up":
            return (2 * self.intermediate_size, self.hidden_size)
        return (self.hidden_size, self.intermediate_size)

    @abstractmethod
    def tile(
        self, proj: Projection, expert: int, dtype: torch.dtype, buf: torch.Tensor | None
    ) -> torch.Tensor:
        """Expert ``expert``'s ``proj`` matrix in ``dtype``.

        Returns a view of the stored weight when no conversion is needed (no copy), otherwise writes into
        ``buf`` (shape ``self.shape(proj)``, dtype ``dtype``, owned by the caller and reused across calls)
        and returns it.
        """

    @abstractmethod
    def needs_buffer(self, dtype: torch.dtype) -> bool:
        """Whether ``tile(..., dtype, ...)`` writes into a caller buffer (False: it returns views)."""

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """All experts as dense tensors: gate_up ``[E, 2I, H]`` and down ``[E, H, I]`` in ``dtype``."""
        out = []
        for proj in ("gate_up", "down"):
            full = torch.empty((self.num_experts, *self.shape(proj)), dtype=dtype)
            for e in range(self.num_experts):
                full[e].copy_(self.tile(proj, e, dtype, full[e]))
            out.append(full)
        return out[0], out[1]

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of host memory the stored expert weights occupy."""

    @property
    @abstractmethod
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the stored values (for dense formats, the dtype GEMMs may use directly)."""


FORMATS: Registry[type[ExpertFormat]] = Registry("expert weight format")
