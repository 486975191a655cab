"""Gated activations of the expert MLP: ``h = act(gate_up) : [n, 2I] -> [n, I]`` and its vector-Jacobian product.

``gate_up`` holds gate columns first (``[:, :I]``) and up columns after (``[:, I:]``), the transformers v5
layout. Checkpoints that interleave them (gpt-oss) are re-laid out once at load, so every activation here
sees the same split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetune.registry import Registry


class GluActivation:
    """``h = act(gate) * up``. Subclasses may override ``vjp`` with a closed form; the default uses autograd."""

    name = "glu"

    def __call__(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """gate_up ``[n, 2I]`` -> h ``[n, I]`` (written into ``out`` when given)."""
        raise NotImplementedError

    def vjp(self, gate_up: torch.Tensor, grad_h: torch.Tensor) -> torch.Tensor:
        """grad_h ``[n, I]`` -> grad_gate_up ``[n, 2I]``, same dtype as gate_up."""
        with torch.enable_grad():
            leaf = gate_up.detach().requires_grad_(True)
            (grad,) = torch.autograd.grad(self(leaf), leaf, grad_h)
        return grad


def _halves(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    i = gate_up.shape[-1] // 2
    return gate_up[..., :i], gate_up[..., i:]


class SiluGlu(GluActivation):
    """SwiGLU, ``silu(g) * u`` (Qwen, DeepSeek, Mixtral, GLM ...), with a closed-form backward."""

    name = "silu"

    def __call__(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        g, u = _halves(gate_up)
        return torch.mul(F.silu(g), u, out=out) if out is not None else F.silu(g) * u

    def vjp(self, gate_up: torch.Tensor, grad_h: torch.Tensor) -> torch.Tensor:
        g, u = _halves(gate_up)
        grad = torch.empty_like(gate_up)
        grad_g, grad_u = _halves(grad)
        torch.mul(grad_h, F.silu(g), out=grad_u)  # d/du = silu(g)
        # d/dg = grad_h * u * silu'(g); aten's fused silu_backward computes x * silu'(g) in one pass
        grad_g.copy_(torch.ops.aten.silu_backward(grad_h * u, g))
        return grad


@dataclass
class ActFnGlu(GluActivation):
    """``act(g) * u`` for any elementwise ``act`` (GELU variants, ReLU); backward by autograd."""

    fn: Callable[[torch.Tensor], torch.Tensor]
    name: str = "act_glu"

    def __call__(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        g, u = _halves(gate_up)
        return torch.mul(self.fn(g), u, out=out) if out is not None else self.fn(g) * u


@dataclass
class ClampedSwiGlu(GluActivation):
    """gpt-oss: ``(clamp(u, -L, L) + 1) * g' * sigmoid(alpha * g')`` with ``g' = min(g, L)``."""

    alpha: float = 1.702
    limit: float = 7.0
    name: str = "gpt_oss"

    def __call__(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        g, u = _halves(gate_up)
        g = g.clamp(max=self.limit)
        u = u.clamp(min=-self.limit, max=self.limit)
        glu = g * torch.sigmoid(g * self.alpha)
        return torch.mul(u + 1, glu, out=out) if out is not None else (u + 1) * glu


ACTIVATIONS: Registry[Callable[..., GluActivation]] = Registry("expert activation")
ACTIVATIONS.register("silu")(SiluGlu)
ACTIVATIONS.register("swish")(SiluGlu)
ACTIVATIONS.register("gelu")(lambda: ActFnGlu(F.gelu, "gelu"))
ACTIVATIONS.register("gelu_pytorch_tanh")(
    lambda: ActFnGlu(lambda t: F.gelu(t, approximate="tanh"), "gelu_tanh")
)
ACTIVATIONS.register("relu")(lambda: ActFnGlu(F.relu, "relu"))
ACTIVATIONS.register("gpt_oss")(ClampedSwiGlu)


def get_activation(name: str, **kwargs: float) -> GluActivation:
    """The registered activation ``name`` (kwargs such as gpt-oss's ``alpha``/``limit`` go to its factory)."""
    return ACTIVATIONS.get(name)(**kwargs)
