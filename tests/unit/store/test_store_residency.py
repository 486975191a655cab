"""Disk residency: the window's prefetch order, budget and error propagation (with recording fake pages), and
engines over paged store files equal to engines over the same files in RAM, bit for bit, within the budget.

The model-level test (a forward + backward of a tiny model whose experts are 4x the budget, watching the
process's anonymous memory) is tests/integration/test_convert_residency.py.
"""

from __future__ import annotations

import pytest
import torch

from moetune.engine import EngineOptions, ExpertEngine, ExpertLoRA
from moetune.engine.residency import PagedExperts, ResidencyWindow
from moetune.errors import EngineError, LoadError
from moetune.store.files import ExpertStore, StorePages
from moetune.testing.memory import mapped_usage
from tests.unit.engine.test_formats import CASES, E, H, I
from tests.unit.engine_cases import make_routing
from tests.unit.store.test_store import MODULES, _write


class FakePages:
    """Records warm/release; ``fail`` makes the next warms raise."""

    def __init__(self, index: int, log: list[tuple[str, int]], nbytes: int = 100) -> None:
        self.index, self.log, self.nbytes = index, log, nbytes
        self.resident = False
        self.fail = 0

    def warm(self) -> None:
        self.log.append(("warm", self.index))
        if self.fail:
            self.fail -= 1
            raise LoadError(f"layer {self.index} is corrupt")
        self.resident = True

    def release(self) -> None:
        self.log.append(("release", self.index))
        self.resident = False


def _window(n: int, budget: int = 200) -> tuple[ResidencyWindow, list[FakePages], list[tuple[str, int]]]:
    log: list[tuple[str, int]] = []
    window = ResidencyWindow(budget)
    pages = [FakePages(i, log) for i in range(n)]
    for p in pages:
        window.add(p)
    return window, pages, log


def _run(window: ResidencyWindow, pages: list[FakePages], order: list[int]) -> None:
    for index in order:
        if window.current != index:  # as PagedExperts calls it: only when the layer changes
            window.enter(index)
        assert pages[index].resident
        held = sum(p.nbytes for p in pages if p.resident)
        assert held <= window.budget, (index, held)
    window.close()  # waits for the last prefetch, so the log is complete


def test_training_order_is_prefetched_after_the_first_read():
    """Forward 0..5, backward 5..0, twice: only the very first layer is read synchronously."""
    window, pages, _ = _window(6)
    step = [*range(6), *range(5, -1, -1)]
    _run(window, pages, step + step)
    # 21 layer changes (the turns repeat no layer: 5 stays current from forward into backward)
    assert window.stats.misses == 1 and window.stats.hits == 20
    assert window.stats.peak_bytes <= 200


def test_a_repeated_forward_order_is_learned():
    """Inference reads 0..5 again and again: the first wrap-around is a wrong guess (5 -> 4), then learned."""
    window, pages, _ = _window(6)
    _run(window, pages, [*range(6)] * 3)
    assert window.stats.misses == 2  # layer 0 at the start and at the first wrap-around


def test_budget_holds_more_layers_when_it_can():
    window, pages, log = _window(6, budget=400)
    _run(window, pages, [*range(6), *range(5, -1, -1)])
    released_before_backward = [i for kind, i in log[: log.index(("warm", 5)) + 1] if kind == "release"]
    assert released_before_backward == [0, 1]  # four layers fit: the window keeps the most recent ones


def test_budget_must_hold_two_layers():
    with pytest.raises(EngineError, match="budget 150 bytes cannot hold two layers of 100 bytes"):
        ResidencyWindow(150).add(FakePages(0, []))


def test_prefetch_errors_surface_when_the_layer_is_read():
    window, pages, _ = _window(3)
    pages[1].fail = 1
    window.enter(0)  # prefetches 1 in the background, which fails
    with pytest.raises(LoadError, match="layer 1 is corrupt"):
        window.enter(1)
    assert window.current is None  # so PagedExperts enters (and checks) again on its next read
    window.enter(1)  # the next read tries again (synchronously) and succeeds
    assert pages[1].resident and window.stats.misses == 2
    window.close()


def test_synchronous_errors_surface_too():
    window, pages, _ = _window(3)
    pages[0].fail = 1
    with pytest.raises(LoadError, match="layer 0 is corrupt"):
        window.enter(0)
    window.close()


def _lora(seed: int) -> ExpertLoRA:
    gen = torch.Generator().manual_seed(seed)
    lora = ExpertLoRA.init(E, H, I, 4, alpha=8.0, generator=gen)
    lora.gate_up_B.normal_(generator=gen)
    lora.down_B.normal_(generator=gen)
    for t in lora.tensors():
        t.requires_grad_(True)
    return lora


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "case", [c for c in CASES if c.id in ("int8", "fp8_block", "dense-bf16")], ids=lambda c: c.id
)
def test_paged_engines_equal_engines_in_ram_and_stay_in_budget(case, compute, tmp_path, one_thread):
    """Three layers forward then backward, as a model runs them: outputs and every gradient equal the
    in-RAM engines' exactly, and the store's resident pages never exceed the budget (two layers). In the
    compute dtype the kernel variant of this CPU takes (bf16 on AMX / AVX512-BF16, fp32 on AVX2), the in-RAM
    engines' few-row experts run on the fused kernels: the paged ones do too (they once took the torch path,
    which computes other roundings)."""
    root = _write(tmp_path / "s", case)
    store = ExpertStore.open(root)
    budget = 2 * max(store.layer_resident_bytes(m) for m in MODULES)
    window = ResidencyWindow(budget)
    opts = EngineOptions(compute_dtype=compute)
    engines = {}
    for mode in ("ram", "disk"):
        engines[mode] = []
        for n, module in enumerate(MODULES):
            mapped = store.map_layer(module)
            fmt, gate_up_bias, down_bias = store.build(module, mapped)
            if mode == "disk":
                fmt = PagedExperts(fmt, window, StorePages(store, mapped))
            mapped.release()  # what building read (fp8's NaN scan): the disk run is measured first
            engines[mode].append(
                ExpertEngine(fmt, gate_up_bias=gate_up_bias, down_bias=down_bias, lora=_lora(n), options=opts)
            )
    usage = {"peak": 0}

    def run(mode: str) -> list[torch.Tensor]:
        x, ids, w = make_routing(T=16, E=E, k=2, H=H, dtype=compute)
        saved = []
        for engine in engines[mode]:
            x, s = engine.forward(x, ids, w)
            saved.append(s)
            usage["peak"] = max(usage["peak"], mapped_usage(root).rss)
        out, grad = [x], torch.ones_like(x)
        for engine, s in zip(reversed(engines[mode]), reversed(saved)):
            grads = engine.backward(s, grad)
            grad = grads.x
            out += [grads.x, grads.topk_weights, *grads.lora.values()]
            usage["peak"] = max(usage["peak"], mapped_usage(root).rss)
        return out

    disk = run("disk")
    assert 0 < usage["peak"] <= budget
    # layer 0 read synchronously; 1 and 2 prefetched; 1 kept and 0 prefetched again for backward
    assert window.stats.misses == 1 and window.stats.hits == 4
    ram = run("ram")
    assert len(ram) == len(disk) and all(torch.equal(a, b) for a, b in zip(ram, disk))
    window.close()


def test_threads_reading_one_layer_at_once_enter_it_once():
    """The engine's expert pool reads a layer's tiles from several threads at once: one warms it, none twice."""
    import threading
    import time

    window, pages, log = _window(3, budget=300)

    class SlowPages(FakePages):
        def warm(self) -> None:
            time.sleep(0.05)  # long enough for every thread to arrive while the first is still warming
            super().warm()

    slow = SlowPages(0, log)
    window._pages[0] = slow
    start = threading.Barrier(4)
    early: list[str] = []  # threads that went on to read before the layer was warm

    def read() -> None:
        start.wait()
        window.ensure(0)
        if not slow.resident:
            early.append(threading.current_thread().name)

    threads = [threading.Thread(target=read) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    window.close()
    assert early == []
    assert log.count(("warm", 0)) == 1 and window.stats.misses == 1
    assert pages[1].resident or ("warm", 1) in log  # the next layer was prefetched as usual
