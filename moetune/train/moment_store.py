"""How the expert optimizer holds AdamW's two moments of one ``[E, ...]`` expert tensor: fp32, bf16 or 8-bit.

Every store offers one contract (``init``, ``read``, ``write``, ``bytes_per_element``): ``read(state, key, sl)``
returns the moment of the experts in slice ``sl`` as fp32 ``[n, ...]`` (a view of the state when it is fp32, so the
update runs in place there and matches torch's AdamW bit for bit), ``write`` stores an fp32 value back (rounded to
the store's precision).
State entries are plain tensors (safetensors stores them: ``moetune.train.layered``).

8-bit (``Blockwise8``): each expert's moment is flattened and cut into blocks of ``BLOCK`` values; a block keeps
its largest magnitude (fp32) and one byte per value on a square-root scale, ``value = absmax * (code / M)^2``
(``M`` = 127, signed, for ``exp_avg``; ``exp_avg_sq`` stores its square root the same way, unsigned, ``M`` =
255). Why the square-root scale: Adam's moments span orders of magnitude inside a block, and a linear code would
round every value below absmax / 254 to zero (no update at all for the small-gradient weights of a block); the
square-root scale resolves down to absmax / 16129 (and the second moment, stored as its root, to
absmax / 255^4). Rounding is to the nearest code.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from moetune.registry import Registry

BLOCK = 256  # values per scale: 4 bytes of absmax per 256 bytes of codes (1.6 %)
MOMENTS = ("exp_avg", "exp_avg_sq")


class MomentStore(Protocol):
    """One way to hold a moment of an ``[E, ...]`` tensor."""

    name: str
    bytes_per_element: float  # per moment, per weight (scales included)

    def init(self, key: str, shape: torch.Size) -> dict[str, torch.Tensor]: ...

    def read(self, state: dict[str, torch.Tensor], key: str, sl: slice) -> torch.Tensor: ...

    def write(self, state: dict[str, torch.Tensor], key: str, sl: slice, value: torch.Tensor) -> None: ...


class PlainStore:
    """The moment as an ``[E, ...]`` tensor of one float dtype (fp32: exact torch AdamW arithmetic)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
        self.bytes_per_element = float(torch.finfo(dtype).bits // 8)

    def init(self, key: str, shape: torch.Size) -> dict[str, torch.Tensor]:
        return {key: torch.zeros(shape, dtype=self.dtype)}

    def read(self, state: dict[str, torch.Tensor], key: str, sl: slice) -> torch.Tensor:
        t = state[key][sl]
        return t if t.dtype == torch.float32 else t.float()

    def write(self, state: dict[str, torch.Tensor], key: str, sl: slice, value: torch.Tensor) -> None:
        t = state[key][sl]
        if value.data_ptr() != t.data_ptr() or value.dtype != t.dtype:  # fp32: read() gave the state itself
            t.copy_(value)  # round to nearest (bf16)


class Blockwise8:
    """The moment in 8-bit codes with an fp32 scale per ``BLOCK`` values (module docstring)."""

    name = "8bit"
    bytes_per_element = 1.0 + 4.0 / BLOCK

    @staticmethod
    def _levels(key: str) -> int:
        return 127 if key == "exp_avg" else 255  # exp_avg is signed; exp_avg_sq's root is not

    def init(self, key: str, shape: torch.Size) -> dict[str, torch.Tensor]:
        e, n = shape[0], math.prod(shape[1:])
        blocks = -(-n // BLOCK)
        codes = torch.int8 if key == "exp_avg" else torch.uint8
        return {
            f"{key}_q": torch.zeros(e, blocks * BLOCK, dtype=codes),
            f"{key}_absmax": torch.zeros(e, blocks, dtype=torch.float32),
            # the shape of one expert's moment, to give read() its shape back
            f"{key}_shape": torch.tensor(shape[1:], dtype=torch.int64),
        }

    def read(self, state: dict[str, torch.Tensor], key: str, sl: slice) -> torch.Tensor:
        q, absmax = state[f"{key}_q"][sl], state[f"{key}_absmax"][sl]  # [n, blocks * BLOCK], [n, blocks]
        shape = tuple(int(s) for s in state[f"{key}_shape"])
        n, m = q.shape[0], self._levels(key)
        code = q.float().view(n, -1, BLOCK)  # [n, blocks, BLOCK]
        value = code.abs().div_(m).square_().mul_(code.sign()).mul_(absmax.unsqueeze(2))
        if key == "exp_avg_sq":
            value.square_()  # stored as its square root
        return value.view(n, -1)[:, : math.prod(shape)].reshape(n, *shape)

    def write(self, state: dict[str, torch.Tensor], key: str, sl: slice, value: torch.Tensor) -> None:
        q, absmax = state[f"{key}_q"][sl], state[f"{key}_absmax"][sl]
        n, m = q.shape[0], self._levels(key)
        flat = torch.zeros(n, q.shape[1], dtype=torch.float32)
        rows = value.reshape(n, -1)
        flat[:, : rows.shape[1]] = rows if key == "exp_avg" else rows.clamp_min(0).sqrt()
        blocks = flat.view(n, -1, BLOCK)
        amax = blocks.abs().amax(dim=2)  # [n, blocks]
        scale = torch.where(amax > 0, amax, torch.ones_like(amax))
        code = blocks.abs().div_(scale.unsqueeze(2)).sqrt_().mul_(m).round_().mul_(blocks.sign())
        q.copy_(code.view(n, -1).to(q.dtype))
        absmax.copy_(amax)


STORES: Registry[MomentStore] = Registry("optimizer state")
STORES.register("fp32")(PlainStore(torch.float32))
STORES.register("bf16")(PlainStore(torch.bfloat16))
STORES.register("8bit")(Blockwise8())
