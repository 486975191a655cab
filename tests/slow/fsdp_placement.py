"""Run by ``tests/slow/test_dist_fsdp.py`` under torchrun: ``moetune train``'s setup and training on a config with
``fsdp``, then, on every rank, where each parameter ended up: the routed experts' trained tensors (expert LoRA, or
their own weights in full mode) plain host tensors outside FSDP, the LoRA experts plain tensors outside FSDP too,
every other trainable tensor an FSDP2 shard. Prints ``placement ok`` per rank."""

from __future__ import annotations

import sys


def main(config_path: str) -> None:
    from torch.distributed.tensor import DTensor

    from moetune.config import load_config
    from moetune.dist import failures_end_every_rank
    from moetune.train import recipe
    from moetune.train.fsdp import unsharded_modules
    from moetune.train.host_grads import host_trained

    cfg = load_config(config_path)
    ranks = recipe._start_ranks(cfg)
    with failures_end_every_rank(ranks):
        model, tokenizer, data = recipe.setup(cfg, progress=False)
        trainer = recipe.train(cfg, model, tokenizer, data)
        host = {name for name, _ in host_trained(trainer.model)}
        whole = {id(p) for m in unsharded_modules(trainer.model) for p in m.parameters()}
        trained = [(n, p) for n, p in trainer.model.named_parameters() if p.requires_grad]
        assert host and len(host) < len(trained)
        wrong = [n for n, p in trained if isinstance(p, DTensor) == (id(p) in whole)]
        assert not wrong, (
            f"rank {ranks.rank}: misplaced (expert or LoRA expert sharded, or dense not): {wrong[:4]}"
        )
        assert all(p.device.type == "cpu" for n, p in trained if n in host)
    # one write per line (print under python -u writes the newline apart: the ranks' lines interleaved)
    sys.stdout.write(f"rank {ranks.rank}: placement ok ({len(host)} host tensors whole)\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
