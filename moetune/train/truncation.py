"""``cutoff_len`` for sft conversations, by LLaMA-Factory's rule: each assistant turn and the prompt before it share
what is left of the budget, so a long prompt is shortened before a short answer is.

A conversation is a sequence of pairs: the tokens since the previous assistant turn (system, user message and the
assistant header: the "source") and the assistant turn itself (its answer and end-of-turn: the "target"; tokens
after the last turn go with it). Pairs take the budget in order (with ``mask_history``, the latest first, so that
the trained last turn is kept and the oldest history goes), each split by :func:`split_budget`; a pair that finds
the budget spent is left out whole. Each part keeps its start. This is how LLaMA-Factory's supervised processor
(``infer_seqlen``) cuts, so a ``cutoff_len`` tuned there keeps the same tokens here. Examples without assistant
turns (plain text, ``pt``) keep their first ``cutoff_len`` tokens.
"""

from __future__ import annotations

from moetune.train.templates import Encoded


def split_budget(source: int, target: int, budget: int) -> tuple[int, int]:
    """``(source kept, target kept)`` for a prompt of ``source`` tokens and an answer of ``target`` within ``budget``:
    an answer shorter than half the budget is kept whole (the prompt gets the rest); else a prompt shorter than half
    is kept whole (the answer gets the rest); else each gets the budget in proportion to its length, the answer's
    share rounded down (as LLaMA-Factory computes it, in floating point)."""
    if 2 * target < budget:
        most = budget
    elif 2 * source < budget:
        most = budget - source
    else:
        most = int(budget * (target / (source + target)))
    kept = min(most, target)
    return min(max(budget - kept, 0), source), kept


def fit(encoded: Encoded, cutoff: int, latest_first: bool) -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of ``encoded`` in at most ``cutoff`` tokens (module docstring); ``latest_first``:
    ``mask_history``'s order. Labels are the example's own for every token kept."""
    ids, labels = encoded.input_ids, encoded.labels
    n = len(ids)
    if n <= cutoff:
        return ids, labels
    if not encoded.turns:
        return ids[:cutoff], labels[:cutoff]
    pairs: list[tuple[range, range]] = []
    done = 0  # tokens already in a pair
    for k, (start, end) in enumerate(encoded.turns):
        start = max(start, done)  # a token shared by two turns' characters goes with the first
        end = n if k == len(encoded.turns) - 1 else max(end, start)
        pairs.append((range(done, start), range(start, end)))
        done = end
    kept: dict[int, tuple[range, range]] = {}
    total = 0
    for k in reversed(range(len(pairs))) if latest_first else range(len(pairs)):
        if total >= cutoff:
            break
        source, target = pairs[k]
        s, t = split_budget(len(source), len(target), cutoff - total)
        kept[k] = (source[:s], target[:t])
        total += s + t
    index = [i for k in sorted(kept) for part in kept[k] for i in part]
    return [ids[i] for i in index], [labels[i] for i in index]


def first_label_kept(kept_at: int | None, before: int, cutoff: int) -> int:
    """An example's ``_first_label`` after truncation (``moetune.train.data.RowCodec``): where its first trained
    token sits (``kept_at``), or, when truncation kept none, at least ``cutoff`` (``before``: where it sat before),
    so that the row is dropped and the error can name the ``cutoff_len`` that keeps one."""
    return kept_at if kept_at is not None else max(before, cutoff)
