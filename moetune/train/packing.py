"""Packing examples into rows of ``cutoff_len`` tokens, and the padding collator of sft and pt batches.

Packing concatenates examples into rows of at most ``cutoff_len`` tokens with ``position_ids`` that
restart at 0 for each example and no ``attention_mask``: transformers then builds a block-diagonal causal
mask from the position_ids, so packed examples do not attend to each other. That holds only while the
model runs without a KV cache (``model.config.use_cache = False`` in training); the first label of each
packed example is -100 so no example is trained to predict the start of the next.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from moetune.train.templates import IGNORE_INDEX

PACKED_COLUMNS = ("input_ids", "labels", "position_ids")  # what a packed row holds


def pack(ds: Any, cutoff_len: int, batch_size: int = 1000) -> Any:
    """Pack examples into rows of at most ``cutoff_len`` tokens (best fit, longest first, within each batch
    of ``batch_size`` examples), with ``position_ids`` restarting per example and no ``attention_mask``."""

    def pack_batch(batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        ids, labels = batch["input_ids"], batch["labels"]
        bins: list[list[int]] = []
        free: list[tuple[int, int]] = []  # (space left, bin), sorted: bisect finds the tightest fit
        for i in sorted(range(len(ids)), key=lambda i: -len(ids[i])):
            n = len(ids[i])
            k = bisect.bisect_left(free, (n, -1))
            if k == len(free):
                bins.append([i])
                bisect.insort(free, (cutoff_len - n, len(bins) - 1))
            else:
                space, b = free.pop(k)
                bins[b].append(i)
                bisect.insort(free, (space - n, b))
        out: dict[str, list[Any]] = {k: [] for k in PACKED_COLUMNS}
        for members in bins:
            row_ids: list[int] = []
            row_labels: list[int] = []
            row_pos: list[int] = []
            for i in members:
                row_ids += ids[i]
                row_labels += [IGNORE_INDEX] + labels[i][1:]  # never predict an example from the one before
                row_pos += range(len(ids[i]))
            out["input_ids"].append(row_ids)
            out["labels"].append(row_labels)
            out["position_ids"].append(row_pos)
        return out

    return ds.map(
        pack_batch, batched=True, batch_size=batch_size, remove_columns=ds.column_names, desc="packing"
    )


@dataclass(frozen=True)
class PadCollator:
    """Pads examples to the longest in the batch (rounded up to ``pad_to_multiple_of``).

    ``input_ids`` get ``pad_token_id``, ``labels`` -100, ``attention_mask`` 0; ``position_ids`` (packed
    rows) continue as a fresh sequence 0, 1, ..., which the block-diagonal mask keeps to itself.
    Returns ``[B, L]`` int64 tensors.
    """

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, features: Sequence[Mapping[str, Sequence[int]]]) -> dict[str, Any]:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        if self.pad_to_multiple_of:
            longest = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        fill = {"input_ids": self.pad_token_id, "labels": IGNORE_INDEX, "attention_mask": 0}
        batch = {}
        for key in features[0]:
            rows = []
            for f in features:
                n = longest - len(f[key])
                rows.append([*f[key], *(range(n) if key == "position_ids" else [fill[key]] * n)])
            batch[key] = torch.tensor(rows, dtype=torch.long)
        return batch
