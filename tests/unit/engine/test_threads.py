"""Who sizes torch's (process-wide) thread pool the engine computes on: the caller, once, never an engine.

``set_engine_threads`` against ``default_num_threads``; engines built and run leave the pool alone;
``load_model(num_threads=N)`` and ``moetune convert --threads N`` end with N threads, set by one call.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import moetune
from moetune.cli.main import main
from moetune.engine import ExpertEngine
from moetune.engine.threads import set_engine_threads
from moetune.errors import ConfigError
from moetune.sysinfo import default_num_threads
from moetune.testing.tiny import save_tiny_model
from tests.unit.engine_cases import build_module, make_layer, make_routing, run_module


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def set_calls(monkeypatch) -> list[int]:
    """Every ``torch.set_num_threads`` call from here on, by its argument (the calls still happen)."""
    calls: list[int] = []
    original = torch.set_num_threads

    def counting(n: int) -> None:
        calls.append(n)
        original(n)

    monkeypatch.setattr(torch, "set_num_threads", counting)
    return calls


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("tiny"), tokenizer=False)


def test_set_engine_threads_default_and_requested():
    torch.set_num_threads(default_num_threads() + 1)
    assert set_engine_threads() == default_num_threads() == torch.get_num_threads()
    assert set_engine_threads(1) == 1 == torch.get_num_threads()


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_set_engine_threads_rejects_non_positive_ints(bad):
    torch.set_num_threads(1)
    with pytest.raises(ConfigError, match=rf"num_threads must be a positive int or None; got {bad!r}"):
        set_engine_threads(bad)
    assert torch.get_num_threads() == 1


def test_engines_leave_the_thread_pool_alone(set_calls):
    other = default_num_threads() + 1  # what a constructor sizing the pool by default would change
    torch.set_num_threads(other)
    set_calls.clear()
    layer = make_layer()
    x, ids, w = make_routing(T=8, E=8, k=2, H=24)
    mod = build_module(layer)
    run_module(mod, x, ids, w, torch.ones_like(x))
    ExpertEngine(mod.engine.weights).forward(x, ids, w, lora=mod.engine.lora)  # a call's own LoRA
    assert set_calls == [] and torch.get_num_threads() == other


def test_load_model_sets_its_threads_once(tiny, set_calls):
    torch.set_num_threads(2)
    set_calls.clear()
    moetune.load_model(tiny, device="cpu", dtype="float32", progress=False, num_threads=1)
    assert set_calls == [1] and torch.get_num_threads() == 1
    torch.set_num_threads(default_num_threads() + 1)
    set_calls.clear()
    moetune.load_model(tiny, device="cpu", dtype="float32", progress=False)  # None: the physical cores
    assert set_calls == [default_num_threads()] == [torch.get_num_threads()]


def test_convert_sets_its_threads_once(tiny, tmp_path, set_calls):
    torch.set_num_threads(2)
    set_calls.clear()
    args = ["convert", str(tiny), str(tmp_path / "store"), "--format", "int8", "--quiet", "--threads", "1"]
    assert main(args) == 0
    assert set_calls == [1] and torch.get_num_threads() == 1
