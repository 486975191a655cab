"""Expert LoRA: per-expert low-rank updates of gate_up and down, in PEFT's ``target_parameters`` layout.

For expert ``e``: ``gate_up_e(x) = W1_e x + s * B1_e (A1_e drop(x))`` with A1 ``[E, r, H]``, B1 ``[E, 2I, r]``;
``down_e(h) = W2_e h + s * B2_e (A2_e drop(h))`` with A2 ``[E, r, I]``, B2 ``[E, H, r]``. ``s = alpha / r``
(rsLoRA: ``alpha / sqrt(r)``). The dense delta ``B @ A`` is never formed: the engine computes ``(x A^T) B^T``.
PEFT stores the same numbers as ``lora_A.weight = A.reshape(E * r, in)`` and
``lora_B.weight[o, j * E + e] = B[e, o, j]`` (see ``moetune.adapters.peft_layout``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moetune.errors import ConfigError, EngineError

LORA_NAMES = ("gate_up_A", "gate_up_B", "down_A", "down_B")


def lora_scaling(rank: int, alpha: float, use_rslora: bool = False) -> float:
    """PEFT's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    if rank <= 0:
        raise ConfigError(f"lora_rank must be a positive integer; got {rank}")
    return alpha / math.sqrt(rank) if use_rslora else alpha / rank


@dataclass
class ExpertLoRA:
    """The four LoRA tensors of one layer's experts (fp32 master weights; any float dtype is accepted).

    The tensors may be ``nn.Parameter`` objects owned by a module, or views of other parameters (PEFT's
    ``lora_A`` / ``lora_B``); the engine only reads them and returns gradients of the same shapes and layout.
    ``gate_up_rows`` (``[2I]`` int64) says which row of ``gate_up_B`` each of the engine's gate_up outputs
    (gate rows, then up rows) uses, for a module that orders its outputs otherwise (gpt-oss interleaves gate
    and up); None: the same order. It lets ``gate_up_B`` stay a view of such a module's parameter.
    """

    gate_up_A: torch.Tensor  # [E, r, H]
    gate_up_B: torch.Tensor  # [E, 2I, r]
    down_A: torch.Tensor  # [E, r, I]
    down_B: torch.Tensor  # [E, H, r]
    scaling: float
    dropout: float = 0.0
    gate_up_rows: torch.Tensor | None = None  # [2I] int64, a permutation

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"lora_dropout must be in [0, 1); got {self.dropout}")
        e, r, h = self.gate_up_A.shape
        two_i = self.gate_up_B.shape[1]
        rows = self.gate_up_rows
        if rows is not None and (rows.dtype != torch.int64 or tuple(rows.shape) != (two_i,)):
            raise EngineError(f"gate_up_rows must be [{two_i}] int64; got {tuple(rows.shape)} {rows.dtype}")
        want = {
            "gate_up_A": (e, r, h),
            "gate_up_B": (e, two_i, r),
            "down_A": (e, r, two_i // 2),
            "down_B": (e, h, r),
        }
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise EngineError(
                    f"expert LoRA {name} must be {shape} (from gate_up_A {(e, r, h)}); got {got}"
                )

    @property
    def rank(self) -> int:
        return self.gate_up_A.shape[1]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The four tensors in ``LORA_NAMES`` order."""
        return tuple(getattr(self, n) for n in LORA_NAMES)

    def astype(self, dtype: torch.dtype) -> ExpertLoRA:
        """A copy with the four tensors in ``dtype`` (same scaling and dropout)."""
        a1, b1, a2, b2 = (t.detach().to(dtype) for t in self.tensors())
        return ExpertLoRA(a1, b1, a2, b2, self.scaling, self.dropout, self.gate_up_rows)

    def check_shape(self, num_experts: int, hidden: int, intermediate: int) -> None:
        e, r, h = self.gate_up_A.shape
        i = self.down_A.shape[2]
        if (e, h, i) != (num_experts, hidden, intermediate):
            raise EngineError(
                f"expert LoRA is for E={e}, H={h}, I={i} but the expert weights are "
                f"E={num_experts}, H={hidden}, I={intermediate}"
            )

    @staticmethod
    def init(
        num_experts: int,
        hidden: int,
        intermediate: int,
        rank: int,
        alpha: float,
        *,
        dropout: float = 0.0,
        use_rslora: bool = False,
        dtype: torch.dtype = torch.float32,
        generator: torch.Generator | None = None,
    ) -> ExpertLoRA:
        """PEFT's default initialisation: A kaiming-uniform (a = sqrt(5), fan_in = in), B zero.

        A is drawn as PEFT draws its ``[E * r, in]`` ``lora_A`` weight (bound ``1 / sqrt(in)``), so seeded runs
        give the same numbers PEFT would.
        """
        scaling = lora_scaling(rank, alpha, use_rslora)

        def kaiming(rows: int, fan_in: int) -> torch.Tensor:
            # kaiming_uniform_(a=sqrt(5)) has bound gain * sqrt(3 / fan_in) with gain = sqrt(2 / 6): 1/sqrt(fan_in)
            bound = 1.0 / math.sqrt(fan_in)
            return torch.empty(rows, fan_in, dtype=dtype).uniform_(-bound, bound, generator=generator)

        return ExpertLoRA(
            gate_up_A=kaiming(num_experts * rank, hidden).view(num_experts, rank, hidden),
            gate_up_B=torch.zeros(num_experts, 2 * intermediate, rank, dtype=dtype),
            down_A=kaiming(num_experts * rank, intermediate).view(num_experts, rank, intermediate),
            down_B=torch.zeros(num_experts, hidden, rank, dtype=dtype),
            scaling=scaling,
            dropout=dropout,
        )


def dropout_mask(
    seed: int, expert: int, proj: int, shape: tuple[int, ...], p: float, dtype: torch.dtype
) -> torch.Tensor:
    """The scaled keep-mask (``bernoulli(1 - p) / (1 - p)``) for one expert's rows, reproducible from ``seed``.

    Drawn from a generator seeded by (forward seed, expert, projection), so backward and recompute regenerate
    exactly the mask forward used without storing it.
    """
    gen = torch.Generator().manual_seed((seed * 1_000_003 + expert * 2 + proj) % (2**63))
    mask = torch.empty(shape, dtype=dtype).bernoulli_(1.0 - p, generator=gen)
    return mask.div_(1.0 - p)
