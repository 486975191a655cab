"""Shared pytest setup: deterministic seeds, and a guard that loading fails before heavy work."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Fail the test if ``load_model`` got past validation (reading weights or streaming experts)."""
    from moetune.loading import load as load_module

    def forbidden(*args, **kwargs):
        raise AssertionError("heavy work started before the error was raised")

    monkeypatch.setattr(load_module.hf, "load_weights", forbidden)
    monkeypatch.setattr(load_module, "stream_experts", forbidden)
