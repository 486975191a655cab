"""One model-benchmark variant in its own process: load a checkpoint, then time training steps on request.

``python -m moetune.bench.model_worker VARIANT CHECKPOINT --threads N --batch B --seq S --seed X`` is started
by ``moetune.bench.model``. It imports what loading needs and answers ``{"ready": true}`` (so the workers'
imports can overlap), then on ``load`` loads the checkpoint the way the variant says (``VARIANTS``) and
answers the load's measurements; then it reads commands from stdin: ``step`` runs one forward + backward of the causal-LM loss on a fixed
batch of ``[B, S]`` random token ids and answers its times and loss; ``quit`` answers the process's peak
resident size and exits. Its own process, so each variant's peak RSS is its own (``ru_maxrss`` is a
per-process high-water mark). Anything libraries print goes to stderr: stdout carries the protocol alone.

What a step trains, the same in every variant: the routed experts are frozen (moetune's engine holds them
outside torch; transformers' expert parameters get ``requires_grad=False``), every other parameter
(embeddings, attention, norms, routers, lm_head) gets its gradient; so both sides compute the input gradient
through every experts module and the same parameter gradients.
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
    model = auto_class(config).from_pretrained(path, dtype=dtype, use_kernels=False)
    for site in find_experts(model, resolve_arch(config.model_type), config.model_type):
        model.get_submodule(site.path).requires_grad_(False)  # frozen, as in the engine
    return model


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


def _step(model: Any, ids: torch.Tensor) -> dict[str, float]:
    """One forward + backward of the loss on ``ids [B, S]``; gradients are dropped afterwards."""
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    model.zero_grad(set_to_none=True)
    return {"fwd_s": t1 - t0, "bwd_s": t2 - t1, "loss": loss.item()}


def _import_modeling(path: str) -> None:
    """Import what loading ``path`` imports lazily (transformers' auto classes, the model's modeling module)."""
    from transformers import AutoConfig

    import moetune.loading  # noqa: F401
    from moetune.loading.hf import model_class

    model_class(AutoConfig.from_pretrained(path))


def serve(variant: Variant, path: str, threads: int, batch: int, seq: int, seed: int, out: TextIO) -> None:
    """Import, answer ready; on ``load`` load and answer ``{load_s, rss_after_load, load_peak_rss, experts}``;
    then serve ``step`` / ``quit``."""

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
    model.train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    send(
        {
            "load_s": load_s,
            "rss_after_load": rss_bytes(),
            "load_peak_rss": peak_rss_bytes(),
            "experts": experts_implementation(model),
        }
    )
    for line in sys.stdin:
        if line.strip() != "step":
            break
        send(_step(model, ids))
    send({"peak_rss": peak_rss_bytes()})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m moetune.bench.model_worker")
    parser.add_argument("variant", choices=list(VARIANTS))
    parser.add_argument("checkpoint")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever libraries print lands on stderr, not in the protocol
    serve(VARIANTS[args.variant], args.checkpoint, args.threads, args.batch, args.seq, args.seed, protocol)


if __name__ == "__main__":
    main()
