"""Full mode's training step: dense gradients + torch's AdamW against the sparse expert optimizer, with and
without its update overlapped with the backward of the layers below.

    python bench/expert_step.py [--layers 4 --experts 64 --active 16 --tokens 256 --hidden 256 --inter 128
                                 --top-k 4 --threads 2 --reps 5 --device-ms 0]

A stack of ``--layers`` full-mode experts modules (fp32 weights, as a bf16 run's fp32 master weights), each
routing ``--tokens`` tokens to ``--top-k`` of ``--active`` of its ``--experts`` experts, is run forward +
backward + optimizer step. ``--device-ms D`` puts between the layers an op whose backward waits D ms without
using the CPU: a stand-in for the device's share of each decoder layer's backward (attention, norms, router,
shared experts on the GPU), during which the host's cores are idle in a real run. Variants, interleaved round by round so machine noise falls on all alike:

- ``dense+torch``: what full mode did before: dense ``[E, ...]`` gradients (zeros for experts without tokens) and
  ``torch.optim.AdamW`` (``fused``, the Trainer's default ``adamw_torch_fused``);
- ``exact``: ``ExpertAdamW`` (fused, as the Trainer builds it), sparse fp32 gradients, every expert updated
  (torch's AdamW semantics);
- ``exact+overlap``: the same, each layer updated on a worker thread while the backward of the layers below runs;
- ``lazy`` / ``lazy+overlap``: only experts with tokens updated.

Printed per variant: the median wall-clock ms of forward + backward + step, its ratio to ``dense+torch``, the
median of backward + step alone, and the gradient + optimizer-state bytes the experts hold.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from moetune.config.schema import ExpertUpdate
from moetune.engine import DenseExperts, ExpertEngine
from moetune.layer import CpuExperts
from moetune.sysinfo import cpu_info
from moetune.train.expert_optim import ExpertAdamW, ExpertOptimSpec, expert_layers


def _stack(args: argparse.Namespace) -> nn.ModuleList:
    gen = torch.Generator().manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    mods = []
    for _ in range(args.layers):
        gate_up = torch.randn(e, 2 * i, h, generator=gen) / h**0.5
        down = torch.randn(e, h, i, generator=gen) / i**0.5
        mods.append(CpuExperts(ExpertEngine(DenseExperts(gate_up, down), train_base=True)))
    return nn.ModuleList(mods)


def _routing(args: argparse.Namespace, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(10 + layer)
    active = torch.randperm(args.experts, generator=gen)[: args.active]
    pick = torch.stack([torch.randperm(args.active, generator=gen)[: args.top_k] for _ in range(args.tokens)])
    return active[pick], torch.rand(args.tokens, args.top_k, generator=gen)


class DeviceWait(torch.autograd.Function):
    """Identity; its backward sleeps (the GPU computing the rest of the decoder layer while the CPU idles)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class Variant:
    def __init__(self, args: argparse.Namespace, name: str) -> None:
        self.name, self.model, self.wait_s = name, _stack(args), args.device_ms / 1e3
        self.overlap = name.endswith("+overlap")
        params = list(self.model.parameters())
        self.opt: torch.optim.Optimizer
        if name == "dense+torch":
            self.opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
        else:
            update = ExpertUpdate.LAZY if name.startswith("lazy") else ExpertUpdate.EXACT
            self.opt = ExpertAdamW(
                [{"params": params}],
                expert_layers(self.model),
                ExpertOptimSpec(update=update),
                lr=1e-4,
                weight_decay=0.01,
                fused=True,  # as the Trainer builds it for adamw_torch_fused
            )
        self.routes = [_routing(args, n) for n in range(args.layers)]
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(args.tokens, args.hidden, generator=gen)
        self.gy = torch.randn(args.tokens, args.hidden, generator=gen)

    def step(self) -> tuple[float, float]:
        t0 = time.perf_counter()
        h = self.x.requires_grad_(True)
        for m, (ids, w) in zip(self.model, self.routes, strict=True):
            h = m(h, ids, w)
            if self.wait_s:
                h = DeviceWait.apply(h, self.wait_s)
        t1 = time.perf_counter()
        if self.overlap:
            assert isinstance(self.opt, ExpertAdamW)
            self.opt.arm()
        (h * self.gy).sum().backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        return t2 - t0, t2 - t1

    def held_bytes(self) -> int:
        if isinstance(self.opt, ExpertAdamW):
            b = self.opt.host_bytes()
            return b["state"] + b["grads_peak"]
        state = sum(
            t.nbytes for s in self.opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        )
        return state + sum(p.nbytes for p in self.model.parameters())  # + the dense grad of every weight


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (
        ("--layers", 4),
        ("--experts", 64),
        ("--active", 16),
        ("--tokens", 256),
        ("--hidden", 256),
        ("--inter", 128),
        ("--top-k", 4),
        ("--threads", 2),
        ("--reps", 5),
        ("--device-ms", 0),
    ):
        p.add_argument(flag, type=int, default=default)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    cpu = cpu_info()
    print(
        f"{cpu.model} ({', '.join(cpu.isa)}), {cpu.logical_cpus} logical CPUs; load {os.getloadavg()[0]:.1f}"
    )
    print(
        f"L={args.layers} E={args.experts} (active {args.active}) T={args.tokens} H={args.hidden} I={args.inter} "
        f"k={args.top_k}, fp32 weights, {args.threads} threads, device stand-in {args.device_ms} ms per layer; "
        f"{args.reps} interleaved rounds"
    )
    names = ["dense+torch", "exact", "exact+overlap", "lazy", "lazy+overlap"]
    variants = [Variant(args, n) for n in names]
    samples: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for rnd in range(args.reps + 1):  # round 0 warms up (and allocates the optimizer state)
        for v in variants:
            s = v.step()
            if rnd:
                samples[v.name].append(s)
    median: Callable[[str, int], float] = lambda n, j: statistics.median(s[j] for s in samples[n]) * 1e3  # noqa: E731
    base = median("dense+torch", 0)
    print(f"{'variant':>14}{'ms/step':>10}{'ratio':>8}{'bwd+step ms':>13}{'grads+state MiB':>17}")
    for v in variants:
        total = median(v.name, 0)
        mib = v.held_bytes() / 2**20
        print(f"{v.name:>14}{total:>10.1f}{total / base:>8.2f}{median(v.name, 1):>13.1f}{mib:>17.1f}")


if __name__ == "__main__":
    main()
