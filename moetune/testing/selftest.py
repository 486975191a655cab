"""The engine self-test: a tiny LoRA expert layer forward and backward, against a float64 per-expert loop.

Run by ``moetune doctor`` on the user's machine, so that a wrong result from this CPU's kernels (or from the
GPU <-> CPU path of the autograd op) shows up before training does. The layer goes through ``CpuExperts``,
the module training uses; the reference is ``moetune.testing.reference.expert_loop`` on the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moetune.engine import LORA_NAMES, DenseExperts, ExpertEngine, ExpertLoRA
from moetune.layer import CpuExperts
from moetune.testing.reference import expert_loop

# A tiny layer: hidden != 2I so a transposed projection cannot pass; every expert receives tokens.
_E, _H, _I, _R, _T, _K = 8, 48, 32, 4, 32, 2
_SCALING = 2.0

# Tolerance on max|got - want| / max|want| per storage dtype. fp32: summation order alone gives ~1e-6,
# a wrong or missing term gives > 1e-2. bf16: outputs and gradients are rounded to bf16 (2^-8 relative)
# and native bf16 GEMMs round their inputs too, so a few 1e-3 is expected.
SELFTEST_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class SelftestResult:
    """One self-test case: errors of y, grad_x, grad_w and each LoRA gradient against float64."""

    storage: torch.dtype
    device: str
    compute: torch.dtype
    errors: dict[str, float]

    @property
    def worst(self) -> tuple[str, float]:
        """The name and error of the least accurate output or gradient."""
        return max(self.errors.items(), key=lambda kv: kv[1])


def _rel_err(got: torch.Tensor | None, want: torch.Tensor | None) -> float:
    """max |got - want| / max |want| in float64; inf when either gradient was never produced."""
    if got is None or want is None:
        return math.inf
    got, want = got.detach().cpu().to(torch.float64), want.detach().to(torch.float64)
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def engine_selftest_case(
    storage: torch.dtype, device: str = "cpu", reference: Callable[..., torch.Tensor] = expert_loop
) -> SelftestResult:
    """Forward and backward of a tiny LoRA expert layer through ``CpuExperts``, inputs on ``device``."""
    gen = torch.Generator().manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, dtype: torch.dtype = storage) -> torch.Tensor:
        # rounded to the dtype the engine gets, then widened: engine and reference see the same numbers
        return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype).to(torch.float64)

    gate_up, down = rand(_E, 2 * _I, _H, scale=_H**-0.5), rand(_E, _H, _I, scale=_I**-0.5)
    lora_shapes = {
        "gate_up_A": ((_E, _R, _H), _H**-0.5),
        "gate_up_B": ((_E, 2 * _I, _R), 0.1),
        "down_A": ((_E, _R, _I), _I**-0.5),
        "down_B": ((_E, _H, _R), 0.1),
    }
    # B != 0 (unlike a fresh init), so every LoRA path contributes and has a gradient to check
    lora = {n: rand(*shape, scale=s, dtype=torch.float32) for n, (shape, s) in lora_shapes.items()}
    x, grad_y = rand(_T, _H), rand(_T, _H)
    w = rand(_T, _K).abs()
    # [T, k]: distinct experts per row, every expert used
    ids = (torch.arange(_T).unsqueeze(1) + 3 * torch.arange(_K)) % _E

    # runs on the process's thread pool as it is: a diagnostic leaves the thread count alone
    engine = ExpertEngine(
        DenseExperts(gate_up.to(storage), down.to(storage)),
        lora=ExpertLoRA(
            gate_up_A=lora["gate_up_A"].float(),
            gate_up_B=lora["gate_up_B"].float(),
            down_A=lora["down_A"].float(),
            down_B=lora["down_B"].float(),
            scaling=_SCALING,
        ),
    )
    module = CpuExperts(engine)
    x_in = x.to(device=device, dtype=storage).requires_grad_(True)
    w_in = w.to(device=device, dtype=storage).requires_grad_(True)
    y = module(x_in, ids.to(device), w_in)
    y.backward(grad_y.to(device=device, dtype=storage))
    got = {"y": y, "grad_x": x_in.grad, "grad_w": w_in.grad}
    got |= {f"grad_{n}": getattr(module, f"lora_{n}").grad for n in LORA_NAMES}

    leaves = {n: t.clone().requires_grad_(True) for n, t in {"x": x, "w": w, **lora}.items()}
    y_ref = reference(
        leaves["x"],
        ids,
        leaves["w"],
        gate_up,
        down,
        lora={n: leaves[n] for n in LORA_NAMES},
        scaling=_SCALING,
    )
    y_ref.backward(grad_y)
    want = {"y": y_ref, "grad_x": leaves["x"].grad, "grad_w": leaves["w"].grad}
    want |= {f"grad_{n}": leaves[n].grad for n in LORA_NAMES}
    errors = {n: _rel_err(got[n], want[n]) for n in want}
    return SelftestResult(storage, device, engine.compute_dtype, errors)
