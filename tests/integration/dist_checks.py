"""Multi-process runs shared by ``tests/integration/test_dist_*.py`` and ``tests/slow/test_dist_*.py``.

Each check starts ``torchrun --nproc-per-node 2`` (gloo on the CPU) as a child process running this file's
``__main__`` (or ``moetune train``), and the single-process reference as a plain child process, so the tests'
own process never joins a process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
# --standalone: a rendezvous on a free local port, so tests running side by side do not collide
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` in its own session; on timeout the whole session (launcher and ranks) is killed."""
    with subprocess.Popen(
        cmd,
        env=env(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(
                f"{cmd} did not end within {timeout} s:\n{out[-3000:]}\n{err[-6000:]}"
            ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """``torchrun --nproc-per-node 2 ARGS`` (``-m moetune.cli.main train CFG`` or this module's checks)."""
    return _run([*TORCHRUN, *args], timeout)


def single(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """One process: ``python ARGS``."""
    return _run([sys.executable, *args], timeout)


def config(tmp: Path, model: Path, name: str, **over: Any) -> Path:
    """A LoRA sft config on the demo data (every target, experts included) writing to ``tmp/name``."""
    cfg = {
        "model_name_or_path": str(model),
        "lora_rank": 4,
        "lora_alpha": 8,
        "lora_target": "all",
        "dataset": "demo_train",
        "dataset_dir": str(ROOT / "examples/data"),
        "max_samples": 64,
        "cutoff_len": 32,
        "output_dir": str(tmp / name),
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-2,
        "max_steps": 3,
        "logging_steps": 1,
        "save_steps": 2,
        "seed": 0,
        "gradient_checkpointing": False,
        "report_to": "none",
        "ddp_timeout": 120,
        "moetune": {"device": "cpu", "num_threads": 1},
        **over,
    }
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def losses(out: Path) -> list[tuple[int, float]]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [(h["step"], h["loss"]) for h in state["log_history"] if "loss" in h]


def check(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def _fail_on_rank_1(config_path: str) -> None:
    """``moetune train``'s recipe with a forward hook that raises on rank 1 at its third forward (mid-training,
    while rank 0 waits in DDP's all-reduce)."""
    from moetune.config import load_config
    from moetune.dist import failures_end_every_rank
    from moetune.train import recipe

    cfg = load_config(config_path)
    ranks = recipe._start_ranks(cfg)
    calls = []

    def hook(module: Any, args: Any, output: Any) -> None:
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure on rank 1")

    with failures_end_every_rank(ranks):
        model, tokenizer, data = recipe.setup(cfg, progress=False)
        if ranks.rank == 1:
            model.register_forward_hook(hook)
        recipe.train(cfg, model, tokenizer, data)


def _adapter_saves_on_every_rank(folder: str) -> None:
    """Both ranks save an adapter pair into ``folder`` 20 times (the main process alone writes; the other logs
    and returns), then rank 1 meets an interrupted save and must refuse to recover it itself."""
    from pathlib import Path

    import torch.distributed as dist

    from moetune.adapters.swap import PARTIAL, recover_adapter, save_pair
    from moetune.dist import barrier, failures_end_every_rank, start
    from moetune.errors import AdapterError

    ranks = start(cpu=True, timeout_s=60)
    out = Path(folder)
    with failures_end_every_rank(ranks):
        for i in range(20):
            save_pair(
                out, f'{{"i": {i}}}', lambda path, i=i: path.write_text(f"weights {i} of rank {ranks.rank}")
            )
        barrier(ranks)
        assert (out / "adapter_model.safetensors").read_text() == "weights 19 of rank 0"
        if ranks.is_main:
            (out / PARTIAL).mkdir()
        barrier(ranks)
        if ranks.rank == 1:
            try:
                recover_adapter(out)
            except AdapterError as err:
                print(f"rank 1 refused: {err}", flush=True)
        barrier(ranks)
        assert (out / PARTIAL).is_dir()  # nobody touched it
    dist.destroy_process_group()


if __name__ == "__main__":
    checks = {"fail_on_rank_1": _fail_on_rank_1, "adapter_saves_on_every_rank": _adapter_saves_on_every_rank}
    checks[sys.argv[1]](*sys.argv[2:])
