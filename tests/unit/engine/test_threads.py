"""Who sizes torch's (process-wide) thread pool the engine computes on: the caller, once, never an engine.

``set_engine_threads`` against ``default_num_threads``; engines built and run leave the pool alone;
``load_model(num_threads=N)`` and ``moetune convert --threads N`` end with N threads, set by one call.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

import moetune
from moetune.cli.main import main
from moetune.engine import ExpertEngine
from moetune.engine.threads import expert_pool, set_engine_threads, split_threads
from moetune.errors import ConfigError, EngineError
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
    """Every ``torch.set_num_threads`` call from here on made by this (the main) thread, by its argument (the
    calls still happen). The engine's pool workers size their own intra-op pools; those calls are per thread."""
    calls: list[int] = []
    original = torch.set_num_threads
    main = threading.main_thread()

    def counting(n: int) -> None:
        if threading.current_thread() is main:
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
    # a pool started here puts back the count its workers' first call set for threads started later
    assert set(set_calls) <= {other} and torch.get_num_threads() == other


@pytest.mark.parametrize(
    "threads,tasks,workers,expected",
    [
        (16, 128, None, (4, 4)),  # DEFAULT_MAX_WORKERS workers sharing the threads
        (8, 128, None, (4, 2)),
        (2, 128, None, (2, 1)),  # up to DEFAULT_MAX_WORKERS threads: one worker per thread
        (6, 128, None, (4, 1)),  # the remainder stays idle
        (16, 3, None, (2, 8)),  # fewer experts than workers: a power of two of them, the threads shared
        (16, 128, 1, (1, 16)),  # the sequential path
        (16, 128, 4, (4, 4)),
        (3, 128, None, (3, 1)),  # not a power of two: every thread still gets a worker
        (12, 6, None, (4, 3)),
        (16, 128, 16, (16, 1)),  # asked for: one worker per thread
        (2, 1, None, (1, 2)),
        (1, 0, None, (1, 1)),
    ],
)
def test_split_threads(threads, tasks, workers, expected):
    assert split_threads(threads, tasks, workers) == expected


def test_pool_workers_run_on_their_own_thread_counts_and_modes():
    torch.set_num_threads(4)
    pool = expert_pool(2, 2)
    seen: list[tuple[str, int, bool, bool]] = []
    lock = threading.Lock()

    def task(_: int) -> None:
        with lock:
            t = threading.current_thread().name
            seen.append(
                (t, torch.get_num_threads(), torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            )

    with torch.inference_mode():
        pool.run(task, range(6))
    assert len(seen) == 6 and all(n == 2 and not g and inf for _, n, g, inf in seen)
    assert all(name.startswith("moetune-experts-2x2") for name, *_ in seen)
    assert torch.get_num_threads() == 4


def test_pool_raises_a_task_error_after_every_task_finished():
    pool = expert_pool(2, 1)
    done: list[int] = []

    def task(i: int) -> None:
        if i == 0:
            raise ValueError("expert 0 failed")
        done.append(i)

    with pytest.raises(ValueError, match="expert 0 failed"):
        pool.run(task, range(5))
    assert sorted(done) == [1, 2, 3, 4]


def test_engine_rejects_bad_expert_workers():
    with pytest.raises(EngineError, match="expert_workers must be >= 1 or None; got 0"):
        build_module(make_layer(), expert_workers=0)


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


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork only")
def test_forked_child_starts_its_own_pool():
    expert_pool(2, 1).run(lambda _: None, range(2))  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # child: the parent's workers do not exist here; a new pool must run the tasks
        ok = False
        signal.alarm(20)  # the parent's pool would take the tasks and never run them: die instead of hanging
        try:
            out: list[int] = []
            expert_pool(2, 1).run(out.append, range(4))
            ok = sorted(out) == [0, 1, 2, 3]
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
