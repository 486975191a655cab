"""Builders for engine tests: random expert layers and routings, and the float64 reference run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetune.engine import LORA_NAMES, DenseExperts, EngineOptions, ExpertEngine, ExpertLoRA
from moetune.layer import CpuExperts
from moetune.testing.reference import expert_loop


@dataclass
class Layer:
    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    lora: dict[str, torch.Tensor] | None
    scaling: float
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None


def make_layer(E=8, H=24, I=16, r=4, *, lora=True, bias=False, dtype=torch.float64, alpha=8.0) -> Layer:
    gen = torch.Generator().manual_seed(1234)
    gate_up = torch.randn(E, 2 * I, H, generator=gen, dtype=dtype) / H**0.5
    down = torch.randn(E, H, I, generator=gen, dtype=dtype) / I**0.5
    lo = None
    if lora:
        init = ExpertLoRA.init(E, H, I, r, alpha, dtype=dtype, generator=gen)
        lo = {n: t.clone() for n, t in zip(LORA_NAMES, init.tensors())}
        lo["gate_up_B"].normal_(generator=gen).mul_(0.1)  # B = 0 would hide every LoRA path
        lo["down_B"].normal_(generator=gen).mul_(0.1)
    gb = torch.randn(E, 2 * I, generator=gen, dtype=dtype) * 0.1 if bias else None
    db = torch.randn(E, H, generator=gen, dtype=dtype) * 0.1 if bias else None
    return Layer(gate_up, down, lo, alpha / r, gb, db)


def make_routing(T, E, k, H, dtype=torch.float64, seed=7):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen, dtype=dtype)
    ids = (
        torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
        if T
        else torch.empty(0, k, dtype=torch.long)
    )
    w = torch.rand(T, k, generator=gen, dtype=dtype)
    return x, ids, w


def padded_rows(t: torch.Tensor, pad: int) -> torch.Tensor:
    """``t`` ``[..., K]`` copied into rows ``K + pad`` apart (``DenseExperts.empty``'s layout), the pad NaN."""
    k = t.shape[-1]
    rows = torch.full((*t.shape[:-1], k + pad), float("nan"), dtype=t.dtype)
    rows[..., :k] = t
    return rows[..., :k]


def build_module(
    layer: Layer, *, dtype=None, full=False, activation="silu", dropout=0.0, pad=0, **opts
) -> CpuExperts:
    """``pad``: the expert weights' rows that many elements further apart than their width (NaN between)."""
    dtype = dtype or layer.gate_up.dtype
    cast = lambda t: t.to(dtype).clone()  # noqa: E731
    lora = None
    if layer.lora is not None:  # master LoRA weights are fp32 (fp64 for the fp64 engine)
        lora_dtype = torch.promote_types(dtype, torch.float32)
        tensors = {n: layer.lora[n].to(lora_dtype).clone() for n in LORA_NAMES}
        lora = ExpertLoRA(**tensors, scaling=layer.scaling, dropout=dropout)
    engine = ExpertEngine(
        DenseExperts(*(padded_rows(cast(t), pad) if pad else cast(t) for t in (layer.gate_up, layer.down))),
        activation=activation,
        gate_up_bias=None if layer.gate_up_bias is None else cast(layer.gate_up_bias),
        down_bias=None if layer.down_bias is None else cast(layer.down_bias),
        lora=lora,
        train_base=full,
        options=EngineOptions(**opts),
    )
    return CpuExperts(engine)


def run_module(mod: CpuExperts, x, ids, w, gy):
    """Forward + backward of the engine module; returns y and every grad by name."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    y = mod(x, ids, w)
    (y * gy.to(y.dtype)).sum().backward()
    grads = {"x": x.grad, "w": w.grad}
    for name, p in mod.named_parameters():
        grads[name] = p.grad
    return y.detach(), grads


def run_reference(layer: Layer, x, ids, w, gy, *, act=None, masks=None, full=False):
    """The float64 per-expert autograd loop on the same weights; returns y and grads named like run_module's."""
    f64 = lambda t: t.detach().to(torch.float64).clone().requires_grad_(True)  # noqa: E731
    xs, ws = f64(x), f64(w)
    gu, dn = f64(layer.gate_up), f64(layer.down)
    lora = {n: f64(t) for n, t in layer.lora.items()} if layer.lora is not None else None
    gb = f64(layer.gate_up_bias) if layer.gate_up_bias is not None else None
    db = f64(layer.down_bias) if layer.down_bias is not None else None
    kw = {"act": act} if act is not None else {}
    y = expert_loop(
        xs,
        ids,
        ws,
        gu,
        dn,
        gate_up_bias=gb,
        down_bias=db,
        lora=lora,
        scaling=layer.scaling,
        masks=masks,
        **kw,
    )
    (y * gy.to(torch.float64)).sum().backward()
    grads = {"x": xs.grad, "w": ws.grad}
    if lora is not None:
        grads.update({f"lora_{n}": t.grad for n, t in lora.items()})
    if full:
        grads.update({"gate_up_proj": gu.grad, "down_proj": dn.grad})
        if gb is not None:
            grads.update({"gate_up_proj_bias": gb.grad, "down_proj_bias": db.grad})
    return y.detach(), grads


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (b the reference)."""
    a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def run_errors(got: tuple, want: tuple) -> dict[str, float]:
    """``rel_err`` of y and of every gradient between two ``run_module`` results (``want`` the reference)."""
    (y, grads), (y_ref, grads_ref) = got, want
    return {"y": rel_err(y, y_ref), **{n: rel_err(grads[n], grads_ref[n]) for n in grads_ref}}
