"""Wide random MoE checkpoints with gigabytes of routed experts, written tensor by tensor (low memory).

The load-memory test and the model benchmark need checkpoints far larger than the tiny test models: a few
layers of a real config class (Qwen3-MoE) with many wide experts. ``write_wide_checkpoint`` writes one like
users' checkpoints look (``config.json``, shards of at most ``shard_bytes`` with
``model.safetensors.index.json``, per-expert keys ``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``)
without ever holding more than one tensor: each safetensors file's header is computed from the shapes first,
then every tensor is generated and appended to the file, so a 2 GB checkpoint costs a few MB of RAM to write.
Files appear atomically (temp file, then ``os.replace``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetune.atomic import write_atomically, write_text_atomically

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
CODES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}  # safetensors dtype codes


@dataclass(frozen=True)
class WideShape:
    """A Qwen3-MoE shape with only MoE layers. Defaults: 4 layers x 64 experts x 3 x 1024 x 1024 bf16 = 1.61 GB
    of routed experts, 35 MB of the rest (attention, norms, router, a 2048-word embedding and head)."""

    layers: int = 4
    experts: int = 64  # E
    top_k: int = 8  # k
    hidden: int = 1024  # H
    intermediate: int = 1024  # I, per expert
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 2048

    def config(self) -> Any:
        """The ``Qwen3MoeConfig`` of this shape."""
        from transformers import Qwen3MoeConfig

        fields: dict[str, Any] = {
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": 4 * self.hidden,  # unused: every layer is an MoE layer
            "moe_intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "norm_topk_prob": True,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
            "architectures": ["Qwen3MoeForCausalLM"],
        }
        return Qwen3MoeConfig(**fields)

    @property
    def expert_bytes(self) -> int:
        """Bytes of all routed experts in bf16."""
        return self.layers * self.experts * 3 * self.hidden * self.intermediate * 2


def _tensors(shape: WideShape) -> list[tuple[str, tuple[int, ...]]]:
    """Every checkpoint key with its shape, in layer order (non-expert tensors of a layer, then its experts)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.config())
    dense = [(k, tuple(v.shape)) for k, v in model.state_dict().items() if ".experts." not in k]
    h, i = shape.hidden, shape.intermediate
    out = []
    for key, size in dense:
        out.append((key, size))
        if key.endswith(".mlp.gate.weight"):  # the layer's router: its experts follow
            stem = key.removesuffix("gate.weight") + "experts"
            for e in range(shape.experts):
                for proj in PROJECTIONS:
                    out.append((f"{stem}.{e}.{proj}.weight", (h, i) if proj == "down_proj" else (i, h)))
    return out


def _value(key: str, size: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Norm scales near 1, everything else N(0, 0.02) (a trained model's scale: logits stay O(1))."""
    if "norm" in key:
        return 1 + 0.02 * torch.randn(size, generator=gen)
    return 0.02 * torch.randn(size, generator=gen)


def _nbytes(size: tuple[int, ...], itemsize: int) -> int:
    n = itemsize
    for d in size:
        n *= d
    return n


def _shards(entries: list[tuple[str, tuple[int, ...]]], itemsize: int, shard_bytes: int) -> Iterator[list]:
    """``entries`` cut in file order into shards of at most ``shard_bytes`` (or one tensor)."""
    shard: list[tuple[str, tuple[int, ...]]] = []
    used = 0
    for key, size in entries:
        n = _nbytes(size, itemsize)
        if shard and used + n > shard_bytes:
            yield shard
            shard, used = [], 0
        shard.append((key, size))
        used += n
    if shard:
        yield shard


def write_safetensors(
    path: Path, entries: list[tuple[str, tuple[int, ...]]], dtype: torch.dtype, make: Any
) -> None:
    """Write ``entries`` (key, shape) as one safetensors file, tensor ``make(key, shape)`` at a time."""
    code, itemsize = CODES[dtype], torch.empty(0, dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, size in entries:
        n = _nbytes(size, itemsize)
        header[key] = {"dtype": code, "shape": list(size), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned

    def write(tmp: Path) -> None:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for key, size in entries:
                f.write(make(key, size).to(dtype).contiguous().view(torch.uint8).numpy())

    write_atomically(path, write, durable=False)


def write_wide_checkpoint(
    path: str | Path,
    shape: WideShape | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    shard_bytes: int = 512 << 20,
    seed: int = 0,
) -> Path:
    """Write a random ``shape`` (default ``WideShape()``) checkpoint in ``dtype`` to directory ``path``."""
    shape = shape or WideShape()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shards = list(_shards(_tensors(shape), itemsize, shard_bytes))
    weight_map: dict[str, str] = {}
    total = 0
    for n, entries in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(path / name, entries, dtype, lambda key, size: _value(key, size, gen))
        weight_map.update(dict.fromkeys((key for key, _ in entries), name))
        total += sum(_nbytes(size, itemsize) for _, size in entries)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    config = shape.config()
    config.dtype = dtype
    write_text_atomically(path / "model.safetensors.index.json", json.dumps(index, indent=2))
    write_text_atomically(path / "config.json", config.to_json_string())
    return path
