"""Fixtures shared by the integration tests."""

import pytest

from moetune.testing.inputs import text_inputs


@pytest.fixture
def make_inputs():
    """``(seed, batch=2, seq=14) -> keyword inputs`` for the ``load_checks`` battery: token ids, labels = ids.

    ``test_load_vision`` overrides it with image+text batches as well.
    """

    def make(seed: int, batch: int = 2, seq: int = 14) -> dict:
        out = text_inputs(seed, batch, seq)
        return {**out, "labels": out["input_ids"]}

    return make
