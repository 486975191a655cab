"""Shared pytest setup: deterministic seeds, one-thread runs, and a guard that loading fails before heavy work."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Run on one torch thread, restoring the count after. For tiny GEMMs a second thread only adds
    synchronisation (on a shared 2-core machine, waits for a descheduled thread: 30 ms per [16, 256] x
    [256, 256] product, measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def no_heavy_work(monkeypatch):
    """Fail the test if ``load_model`` got past validation (reading weights or streaming experts)."""
    from moetune.loading import load as load_module

    def forbidden(*args, **kwargs):
        raise AssertionError("heavy work started before the error was raised")

    monkeypatch.setattr(load_module.hf, "load_weights", forbidden)
    monkeypatch.setattr(load_module, "stream_experts", forbidden)
