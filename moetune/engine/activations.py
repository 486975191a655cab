"""Gated activations of the expert MLP: ``h = act(gate_up) : [n, 2I] -> [n, I]`` and its vector-Jacobian product.

``gate_up`` holds gate columns first (``[:, :I]``) and up columns after (``[:, I:]``), the transformers v5
layout. Checkpoints that interleave them (gpt-oss) are re-laid out once at load, so every activation here
sees the same split. Besides ``act(gate) * up`` for the usual elementwise ``act``, the clamped SwiGLUs of
gpt-oss, DeepSeek-V4, GLM-5-Next, HY-V4, MiniMax-M3 and Step-3.7 (``ClampedSwiGlu``) and Inkling2's softcapped
one (``SoftcappedSwiGlu``), each with a closed-form backward checked against float64 autograd.
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

    def forward_saving(self, gate_up: torch.Tensor, out: torch.Tensor, memo: torch.Tensor) -> torch.Tensor:
        """h ``[n, I]`` into ``out``, as ``self(gate_up, out=out)``, leaving in ``memo`` ``[n, I]`` (same dtype)
        what ``vjp_into`` may reuse instead of recomputing it. The default keeps nothing there."""
        return self(gate_up, out=out)

    def vjp_into(
        self, gate_up: torch.Tensor, grad_h: torch.Tensor, memo: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        """``vjp`` written into out ``[n, 2I]``, after ``forward_saving`` filled ``memo`` from the same gate_up."""
        return out.copy_(self.vjp(gate_up, grad_h))


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

    def forward_saving(self, gate_up: torch.Tensor, out: torch.Tensor, memo: torch.Tensor) -> torch.Tensor:
        """Keeps ``silu(g)`` in memo: the backward's vjp needs it again (one pass over ``[n, I]`` fewer)."""
        g, u = _halves(gate_up)
        return torch.mul(torch.ops.aten.silu.out(g, out=memo), u, out=out)

    def vjp_into(
        self, gate_up: torch.Tensor, grad_h: torch.Tensor, memo: torch.Tensor, out: torch.Tensor
    ) -> torch.Tensor:
        g, u = _halves(gate_up)
        grad_g, grad_u = _halves(out)
        torch.mul(grad_h, memo, out=grad_u)  # d/du = silu(g), kept by forward_saving
        # d/dg = grad_h * u * silu'(g), aten's fused silu_backward written straight into its half
        torch.ops.aten.silu_backward.grad_input(torch.mul(grad_h, u, out=memo), g, grad_input=grad_g)
        return out


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
    """SwiGLU with clamps: ``(clamp(u, -L, L) + c) * swish_a(g)``, ``swish_a(x) = x * sigmoid(a * x)``.

    ``clamp_output=False``: the gate is clamped before the swish, ``swish_a(min(g, L))`` (gpt-oss with a = 1.702,
    c = 1; DeepSeek-V4, GLM-5-Next, HY-V4 with a = 1, c = 0). ``clamp_output=True``: the swish output is,
    ``min(swish_a(g), L)`` (Step-3.7). ``L = inf`` clamps nothing. Closed-form backward; where a clamp is active
    its input gets no gradient, the boundary itself included in the pass band (``torch.clamp``'s convention).
    """

    alpha: float = 1.0
    limit: float = float("inf")
    up_offset: float = 0.0
    clamp_output: bool = False
    name: str = "clamped_swiglu"

    def _swish(self, g: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """swish_a(g) and, with ``grad``, its derivative; a = 1 uses ``F.silu`` itself, as the models do."""
        s = torch.sigmoid(g * self.alpha)
        value = F.silu(g) if self.alpha == 1.0 else g * s
        return value, (s + self.alpha * g * s * (1 - s)) if grad else None

    def _gate(self, g: torch.Tensor, grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The gate factor ``[n, I]`` and, with ``grad``, its derivative w.r.t. g."""
        lim = self.limit
        if self.clamp_output:
            sw, dsw = self._swish(g, grad)
            return sw.clamp(max=lim), None if dsw is None else dsw * (sw <= lim)
        sw, dsw = self._swish(g.clamp(max=lim), grad)
        return sw, None if dsw is None else dsw * (g <= lim)

    def __call__(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        g, u = _halves(gate_up)
        gate, _ = self._gate(g, grad=False)
        up = u.clamp(min=-self.limit, max=self.limit) + self.up_offset
        return torch.mul(up, gate, out=out) if out is not None else up * gate

    def vjp(self, gate_up: torch.Tensor, grad_h: torch.Tensor) -> torch.Tensor:
        g, u = _halves(gate_up)
        gate, dgate = self._gate(g, grad=True)
        assert dgate is not None
        up = u.clamp(min=-self.limit, max=self.limit) + self.up_offset
        passed = (u >= -self.limit) & (u <= self.limit)
        return torch.cat((grad_h * up * dgate, grad_h * gate * passed), dim=-1)


@dataclass
class SoftcappedSwiGlu(GluActivation):
    """Inkling2: ``cg * tanh(g / cg) * sigmoid(g) * cu * tanh(u / cu)`` (the sigmoid sees the raw gate; the
    softcaps bound the linear gate factor and ``u``), computed in at least fp32 as the model does, with a
    closed-form backward."""

    gate_softcap: float = 4.0
    up_softcap: float = 25.0
    name: str = "softcapped_swiglu"

    def _parts(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, ...]:
        wide = torch.promote_types(gate_up.dtype, torch.float32)  # fp32 even for bf16 inputs
        g, u = (t.to(wide) for t in _halves(gate_up))
        tg, tu = torch.tanh(g / self.gate_softcap), torch.tanh(u / self.up_softcap)
        s = torch.sigmoid(g)
        gate = self.gate_softcap * tg * s
        dgate = (1 - tg * tg) * s + gate * (1 - s)
        return gate, dgate, self.up_softcap * tu, 1 - tu * tu

    def __call__(self, gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        gate, _, up, _ = self._parts(gate_up)
        h = (gate * up).to(gate_up.dtype)
        return out.copy_(h) if out is not None else h

    def vjp(self, gate_up: torch.Tensor, grad_h: torch.Tensor) -> torch.Tensor:
        gate, dgate, up, dup = self._parts(gate_up)
        grad = grad_h.to(gate.dtype)
        return torch.cat((grad * up * dgate, grad * gate * dup), dim=-1).to(gate_up.dtype)


ACTIVATIONS: Registry[Callable[..., GluActivation]] = Registry("expert activation")
ACTIVATIONS.register("silu")(SiluGlu)
ACTIVATIONS.register("swish")(SiluGlu)
ACTIVATIONS.register("gelu")(lambda: ActFnGlu(F.gelu, "gelu"))
ACTIVATIONS.register("gelu_pytorch_tanh")(
    lambda: ActFnGlu(lambda t: F.gelu(t, approximate="tanh"), "gelu_tanh")
)
ACTIVATIONS.register("relu")(lambda: ActFnGlu(F.relu, "relu"))
ACTIVATIONS.register("gpt_oss")(
    lambda alpha=1.702, limit=7.0: ClampedSwiGlu(alpha=alpha, limit=limit, up_offset=1.0, name="gpt_oss")
)
ACTIVATIONS.register("clamped_swiglu")(ClampedSwiGlu)
ACTIVATIONS.register("swiglu_clamped_output")(
    lambda limit=float("inf"): ClampedSwiGlu(limit=limit, clamp_output=True, name="swiglu_clamped_output")
)
ACTIVATIONS.register("softcapped_swiglu")(SoftcappedSwiGlu)


def get_activation(name: str, **kwargs: float) -> GluActivation:
    """The registered activation ``name`` (kwargs such as gpt-oss's ``alpha``/``limit`` go to its factory)."""
    return ACTIVATIONS.get(name)(**kwargs)
