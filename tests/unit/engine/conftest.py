"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def four_threads():
    """Four intra-op threads, so the engine's expert pool has workers to run (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)
