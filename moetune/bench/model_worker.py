"""One model-benchmark variant in its own process: load a checkpoint, then time training steps on request.

``python -m moetune.bench.model_worker VARIANT CHECKPOINT --threads N --batch B --seq S --seed X
[--lora-rank R --accumulation A]`` is started by ``moetune.bench.model``. It imports what loading needs and
answers ``{"ready": true}`` (so the workers' imports can overlap), then on ``load`` loads the checkpoint the
way the variant says (``VARIANTS``) and answers the load's measurements; then it reads commands from stdin:
``step`` runs one step (``Stepper``: A micro-batches of ``[B, S]`` fixed random token ids) and answers its
times and loss; ``quit`` answers the process's peak resident size and exits. Its own process, so each
variant's peak RSS is its own (``ru_maxrss`` is a per-process high-water mark). Anything libraries print goes
to stderr: stdout carries the protocol alone.

What a step trains, the same in every variant. With ``--lora-rank 0`` (the model benchmark): the routed
experts are frozen (moetune's engine holds them outside torch; transformers' expert parameters get
``requires_grad=False``), every other parameter (embeddings, attention, norms, routers, lm_head) gets its
gradient; so both sides compute the input gradient through every experts module and the same parameter
gradients; no optimizer runs. With ``--lora-rank R`` (the training-step benchmark): LoRA of rank R on the
attention projections and the routed experts, everything else frozen, as a LoRA fine-tune runs (moetune:
``moetune.attach_lora``, expert LoRA in the engine; transformers: stock PEFT, expert LoRA through
``target_parameters`` on its ``grouped_mm`` experts); a step is ``--accumulation`` micro-batches (forward and
backward of loss / A each) and one AdamW step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from moetune.bench.report import dtype_name
from moetune.registry import Registry
from moetune.testing.rss import peak_rss_bytes, rss_bytes

Loader = Callable[[str, torch.dtype, int], Any]
"""(checkpoint dir, dtype, threads) -> a model in train mode whose routed experts do not train."""

LOADERS: Registry[Loader] = Registry("model benchmark implementation")


@LOADERS.register("moetune")
def _load_moetune(path: str, dtype: torch.dtype, threads: int) -> Any:
    import moetune

    return moetune.load_model(path, device="cpu", dtype=dtype, progress=False, num_threads=threads)


@LOADERS.register("transformers")
def _load_transformers(path: str, dtype: torch.dtype, threads: int) -> Any:
    from transformers import AutoConfig

    from moetune.arch import find_experts, resolve_arch
    from moetune.testing.tiny import auto_class

    config = AutoConfig.from_pretrained(path)
    model = auto_class(config).from_pretrained(
        path, dtype=dtype, use_kernels=False, experts_implementation="grouped_mm"
    )  # grouped_mm is transformers' default where it can run; named, so a machine without it fails loudly
    for site in find_experts(model, resolve_arch(config.model_type), config.model_type):
        model.get_submodule(site.path).requires_grad_(False)  # frozen, as in the engine
    return model


LoraAttach = Callable[[Any, int], Any]
"""(a model from ``LOADERS``, LoRA rank) -> the model to train: LoRA on attention and routed experts, rest frozen."""

LORA: Registry[LoraAttach] = Registry("model benchmark LoRA attachment")
LORA_DROPOUT = 0.0  # PEFT's target_parameters (transformers' fused experts) refuses dropout


@LORA.register("moetune")
def _lora_moetune(model: Any, rank: int) -> Any:
    import moetune

    return moetune.attach_lora(model, rank=rank, alpha=2.0 * rank, dropout=LORA_DROPOUT)


@LORA.register("transformers")
def _lora_transformers(model: Any, rank: int) -> Any:
    """Stock PEFT with the targets moetune's ``lora_target: all`` resolves to: every ``nn.Linear`` but lm_head
    and the routers (``moetune.adapters.apply``'s rule), and the experts' fused parameters."""
    from peft import LoraConfig, get_peft_model
    from torch import nn

    from moetune.adapters.apply import EXCLUDED_LINEARS, ROUTER_NAMES
    from moetune.arch import find_experts, resolve_arch

    model_type = model.config.model_type
    sites = find_experts(model, resolve_arch(model_type), model_type)
    experts = [site.path for site in sites]
    linear = sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, nn.Linear)
            and name.rsplit(".", 1)[-1] not in EXCLUDED_LINEARS + ROUTER_NAMES
            and not any(name.startswith(p + ".") for p in experts)
        }
    )
    params = sorted(
        {
            ".".join([*site.path.split(".")[-2:], name])
            for site in sites
            for name, _ in model.get_submodule(site.path).named_parameters(recurse=False)
        }
    )  # e.g. "mlp.experts.gate_up_proj"
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=LORA_DROPOUT,
        target_modules=linear,
        target_parameters=params,
    )
    return get_peft_model(model, config)


@dataclass(frozen=True)
class Variant:
    """How one column of the benchmark loads the checkpoint: an implementation in ``LOADERS`` and a dtype."""

    impl: str
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return f"{self.impl}-{dtype_name(self.dtype)}"


VARIANTS = {
    v.name: v
    for v in (
        Variant("moetune", torch.bfloat16),
        Variant("transformers", torch.bfloat16),
        Variant("moetune", torch.float32),
        Variant("transformers", torch.float32),
    )
}
"""Every variant by name (``moetune-bf16``, ...), in the order the table lists them."""


def experts_implementation(model: Any) -> str:
    """What computes the routed experts: moetune's engine (with its compute dtype) or transformers' kernel."""
    from moetune.layer import CpuExperts

    engines = [m.engine for m in model.modules() if isinstance(m, CpuExperts)]
    if engines:
        return f"moetune engine ({dtype_name(engines[0].compute_dtype)} GEMMs)"
    text = model.config.get_text_config()
    return f"transformers {getattr(text, '_experts_implementation', None) or 'eager'}"


class Stepper:
    """One timed step on fixed batches ``ids [A, B, S]``: ``A`` micro-batches, each a forward and a backward of
    the causal-LM loss / A (gradients accumulate), then the optimizer's step when there is one; gradients are
    dropped afterwards. Answers the summed forward and backward seconds, the optimizer's, the process's CPU
    seconds over the step, and the mean loss."""

    def __init__(self, model: Any, ids: torch.Tensor, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.ids, self.optimizer = model, ids, optimizer

    def step(self) -> dict[str, float]:
        fwd = bwd = loss_sum = 0.0
        micro = self.ids.shape[0]
        cpu0 = time.process_time()
        for ids in self.ids:
            t0 = time.perf_counter()
            loss = self.model(input_ids=ids, labels=ids).loss
            t1 = time.perf_counter()
            (loss / micro).backward()
            t2 = time.perf_counter()
            fwd, bwd, loss_sum = fwd + t1 - t0, bwd + t2 - t1, loss_sum + loss.item()
        t3 = time.perf_counter()
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        opt = time.perf_counter() - t3 if self.optimizer is not None else 0.0
        self.model.zero_grad(set_to_none=True)  # without an optimizer: the gradients are dropped, untimed
        cpu = time.process_time() - cpu0  # every thread's; steadier than wall time when cores are shared
        return {"fwd_s": fwd, "bwd_s": bwd, "opt_s": opt, "cpu_s": cpu, "loss": loss_sum / micro}


def _import_modeling(path: str) -> None:
    """Import what loading ``path`` imports lazily (transformers' auto classes, the model's modeling module)."""
    from transformers import AutoConfig

    import moetune.loading  # noqa: F401
    from moetune.loading.hf import model_class

    model_class(AutoConfig.from_pretrained(path))


@dataclass(frozen=True)
class StepShape:
    """What one step runs: ``accumulation`` micro-batches of ``batch x seq`` tokens; LoRA of ``lora_rank``
    and an AdamW step, or (rank 0) frozen experts, everything else getting gradients, and no optimizer."""

    batch: int
    seq: int
    lora_rank: int = 0
    accumulation: int = 1
    seed: int = 0

    def args(self) -> list[str]:
        """The worker's command-line options for this shape."""
        return [
            "--batch", str(self.batch), "--seq", str(self.seq), "--lora-rank", str(self.lora_rank),
            "--accumulation", str(self.accumulation), "--seed", str(self.seed),
        ]  # fmt: skip


LEARNING_RATE = 1e-4  # any small rate: the benchmark times the step, the values it reaches do not matter


def _stepper(model: Any, variant: Variant, shape: StepShape) -> Stepper:
    """The model ready to step (LoRA attached when the shape asks for it) on its fixed batches."""
    optimizer = None
    if shape.lora_rank:
        torch.manual_seed(shape.seed)  # LoRA A is drawn from the global RNG: every variant starts alike
        model = LORA.get(variant.impl)(model, shape.lora_rank)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LEARNING_RATE)
    model.train()
    vocab = model.config.get_text_config().vocab_size
    size = (shape.accumulation, shape.batch, shape.seq)
    ids = torch.randint(0, vocab, size, generator=torch.Generator().manual_seed(shape.seed))
    return Stepper(model, ids, optimizer)


def serve(variant: Variant, path: str, threads: int, shape: StepShape, out: TextIO) -> None:
    """Import, answer ready; on ``load`` load (and attach LoRA) and answer ``{load_s, rss_after_load,
    load_peak_rss, experts, trainable}``; then serve ``step`` / ``quit``."""

    def send(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    _import_modeling(path)  # before the clock starts: load_s is the load alone
    torch.set_num_threads(threads)
    send({"ready": True})
    if sys.stdin.readline().strip() != "load":
        return
    start = time.perf_counter()
    model = LOADERS.get(variant.impl)(path, variant.dtype, threads)
    load_s = time.perf_counter() - start
    stepper = _stepper(model, variant, shape)
    send(
        {
            "load_s": load_s,
            "rss_after_load": rss_bytes(),
            "load_peak_rss": peak_rss_bytes(),
            "experts": experts_implementation(model),
            "trainable": sum(p.numel() for p in stepper.model.parameters() if p.requires_grad),
        }
    )
    for line in sys.stdin:
        if line.strip() != "step":
            break
        send(stepper.step())
    send({"peak_rss": peak_rss_bytes()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moetune.bench.model_worker")
    parser.add_argument("variant", choices=list(VARIANTS))
    parser.add_argument("checkpoint")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--accumulation", type=int, default=1)
    args = parser.parse_args(argv)
    shape = StepShape(args.batch, args.seq, args.lora_rank, args.accumulation, args.seed)
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever libraries print lands on stderr, not in the protocol
    serve(VARIANTS[args.variant], args.checkpoint, args.threads, shape, protocol)


if __name__ == "__main__":
    main()
