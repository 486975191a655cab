"""Disk residency on a tiny model whose experts are 4x the budget: a forward + backward with expert LoRA stays
within the budget and equals the same store loaded in RAM, exactly.

Model: Qwen3-MoE, 8 MoE layers of E = 16 experts, H = 256, I = 640, saved in bf16; converted to int8, each
layer's file is 7.9 MB (63 MB in all). The budget is two layers (15.7 MB), the least disk residency allows.

Measured from ``/proc/self`` by a thread sampling every millisecond during the step:

* the store's resident pages (``Rss`` of its mappings) <= the budget: layers are paged in and released;
* the growth of the process's anonymous memory (``RssAnon``) over its value before the step <= SLACK
  (16 MiB: activations, LoRA grads, the engines' workspaces and allocator caches; measured 2 MiB). A copy of
  the experts into anonymous memory, as a non-mapped load would make, adds 63 MB and fails it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import moetune
from moetune.adapters.apply import attach_lora, expert_modules
from moetune.cli.main import main
from moetune.testing.memory import mapped_usage, rss_anon
from moetune.testing.tiny import save_tiny_model

SLACK = 16 << 20
SIZES = {
    "num_hidden_layers": 8,
    "mlp_only_layers": [],
    "hidden_size": 256,
    "moe_intermediate_size": 640,
    "num_experts": 16,
}


class Peaks:
    """Samples RssAnon growth and the store's resident pages in a background thread."""

    def __init__(self, store) -> None:
        self.store, self.base = store, rss_anon()
        self.anon = self.mapped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self.anon = max(self.anon, rss_anon() - self.base)
        self.mapped = max(self.mapped, mapped_usage(self.store).rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(0.001)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def _step(model, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.slow
def test_disk_residency_within_budget_equals_ram(tmp_path):
    src = save_tiny_model("qwen3_moe", tmp_path / "src", dtype=torch.bfloat16, tokenizer=False, **SIZES)
    store = tmp_path / "store"
    assert main(["convert", str(src), str(store), "--format", "int8", "--quiet"]) == 0
    files = sorted(store.glob("*.safetensors"))
    total, largest = sum(f.stat().st_size for f in files), max(f.stat().st_size for f in files)
    budget = 2 * (-(-largest // 4096) * 4096)
    assert len(files) == 8 and total >= 4 * budget - 8 * 4096

    ids = torch.randint(3, 96, (2, 16), generator=torch.Generator().manual_seed(0))
    models = {}
    for mode in ("disk", "ram"):
        options = {"expert_residency": "disk", "expert_residency_budget": budget} if mode == "disk" else {}
        model = moetune.load_model(
            src, device="cpu", dtype="float32", progress=False, num_threads=1, expert_path=store, **options
        )
        torch.manual_seed(0)  # the same LoRA initialisation for both
        models[mode] = attach_lora(model, rank=4, alpha=8, targets=("q_proj", "experts"))
        if mode == "disk":
            _step(models[mode], ids)  # warm-up: hashes every file once, allocates the engines' workspaces
            window = next(iter(expert_modules(models[mode]).values())).experts.engine.weights.window
            read_before = window.stats.bytes_read
            with Peaks(store) as disk:
                loss_disk, grads_disk = _step(models[mode], ids)
            read_in_step = window.stats.bytes_read - read_before
    loss_ram, grads_ram = _step(models["ram"], ids)

    assert disk.mapped <= budget, (disk.mapped, budget)
    assert disk.anon <= SLACK, (disk.anon, SLACK)
    # the RAM model holds every page of the store (the disk model at most the budget of them)
    assert mapped_usage(store).rss >= total - 4096
    assert read_in_step >= total  # the step read its experts from the store (each layer at least once)
    assert torch.equal(loss_disk, loss_ram)
    assert set(grads_disk) == set(grads_ram) and any("experts" in n for n in grads_ram)
    for name, g in grads_ram.items():
        assert torch.equal(grads_disk[name], g), name
