"""``moetune.train.truncation``: ``cutoff_len`` by LLaMA-Factory's rule, against that rule written as LLaMA-Factory's
processor builds an example (lists of source and target ids concatenated, in reverse for ``mask_history``) on
random conversations, and its boundary cases."""

from __future__ import annotations

import random

import pytest

from moetune.train.templates import IGNORE_INDEX, Encoded
from moetune.train.truncation import fit, split_budget


def _reference(pairs: list[tuple[list[int], list[int]]], cutoff: int, reverse: bool) -> list[int]:
    """The example's ids the way LLaMA-Factory's supervised processor assembles them."""
    ids: list[int] = []
    total = 0
    for source, target in pairs[::-1] if reverse else pairs:
        if total >= cutoff:
            break
        s, t = split_budget(len(source), len(target), cutoff - total)
        total += s + t
        ids = source[:s] + target[:t] + ids if reverse else ids + source[:s] + target[:t]
    return ids


@pytest.mark.parametrize("reverse", [False, True])
def test_fit_is_the_processor_s_assembly(reverse) -> None:
    rng = random.Random(0)
    for _ in range(2000):
        pairs, ids, turns = [], [], []
        for _ in range(rng.randint(1, 4)):
            source = [rng.randrange(1000) for _ in range(rng.randint(0, 30))]
            target = [rng.randrange(1000) for _ in range(rng.randint(1, 30))]
            pairs.append((source, target))
            turns.append((len(ids) + len(source), len(ids) + len(source) + len(target)))
            ids += source + target
        labels = [IGNORE_INDEX] * len(ids)
        cutoff = rng.randint(1, len(ids) + 5)
        got_ids, got_labels = fit(Encoded(ids, labels, tuple(turns)), cutoff, latest_first=reverse)
        assert got_ids == _reference(pairs, cutoff, reverse)
        assert len(got_ids) <= cutoff and len(got_labels) == len(got_ids)


def test_split_budget_cases() -> None:
    assert split_budget(25, 2, 10) == (8, 2)  # a short answer whole
    assert split_budget(3, 20, 10) == (3, 7)  # a short prompt whole
    assert split_budget(6, 5, 10) == (6, 4)  # both long: int(10 * 5 / 11) = 4 to the answer
    assert split_budget(6, 5, 11) == (6, 5)  # what fits is kept
    assert split_budget(100, 2, 4) == (4, 0)


def test_labels_follow_their_tokens_and_text_keeps_its_start() -> None:
    ids = list(range(10))
    labels = [IGNORE_INDEX] * 6 + ids[6:]
    # source 6, target 4 (the token after the turn goes with it): int(6 * 4 / 10) = 2 to the answer
    got_ids, got_labels = fit(Encoded(ids, labels, ((6, 9),)), 6, latest_first=False)
    assert got_ids == [0, 1, 2, 3, 6, 7] and got_labels == [IGNORE_INDEX] * 4 + [6, 7]
    assert fit(Encoded(ids, labels), 4, latest_first=False) == (ids[:4], labels[:4])  # no turns: the start
    assert fit(Encoded(ids, labels, ((6, 9),)), 10, latest_first=True) == (ids, labels)  # fits: unchanged
