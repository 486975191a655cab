"""kill -9 checks shared by ``tests/integration/test_kill_saves.py`` (one kill of each kind, default suite) and
``tests/slow/test_kill_saves_many.py`` (more seeds).

Each check starts a child Python process that saves in a loop (an adapter save, a convert, a training run
with a checkpoint every step), SIGKILLs it after a delay drawn from ``random.Random(seed)`` once it has
started saving, so kills land at arbitrary points of the writes, then asserts that what is on disk loads
as one whole earlier state (never a mix) and that a rerun or resume completes.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

import moetune
from moetune.adapters.check import check_adapter_folder
from moetune.cli.main import main
from moetune.errors import CheckpointError, LoadError
from moetune.loading import hf
from moetune.loading.checkpoint import Checkpoint
from moetune.testing.child import child_env
from moetune.testing.tiny import save_tiny_model
from tests.integration import test_train

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = {"moe_intermediate_size": 32}


def tiny_model(path: Path) -> Path:
    return save_tiny_model("qwen3_moe", path, tokenizer=False, **OVERRIDES)


def _child(code: str, *args: str) -> subprocess.Popen:
    env = child_env(OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
        cwd=ROOT,
    )


def _kill_after(proc: subprocess.Popen, ready: str, delay: float) -> None:
    """Wait for the line ``ready`` from the child, then ``delay`` seconds, then SIGKILL it."""
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.decode().strip() == ready:
            break
    else:
        raise AssertionError(f"the child exited ({proc.wait()}) before printing {ready!r}")
    time.sleep(delay)
    proc.kill()
    proc.wait()


# ---- adapter saves: two adapters of different r and alpha saved in turn; a mix would load at the wrong scale

ADAPTER_CHILD = """
import sys
from moetune.adapters import save_adapter
from tests.integration.kill_checks import two_adapters
peft = two_adapters(sys.argv[1])
print("start", flush=True)
n = 0
while True:
    save_adapter(peft[n % 2], sys.argv[2])
    n += 1
"""


def two_adapters(model_dir: str | Path) -> list:
    """Two PEFT models of the tiny model: r = 4 and r = 8, alpha = 2 r^2, every LoRA value r / 100."""
    import torch

    from moetune.adapters import attach_lora
    from moetune.loading import load_model

    out = []
    for r in (4, 8):
        peft = attach_lora(
            load_model(model_dir, device="cpu", dtype="float32", progress=False), rank=r, alpha=2 * r * r
        )
        with torch.no_grad():
            for n, t in peft.named_parameters():
                if "lora_" in n:
                    t.fill_(r / 100)
        out.append(peft)
    return out


def _check_adapter(model_dir: Path, out: Path) -> None:
    """``out`` holds one whole adapter: its config's r and alpha go with its tensors (values r / 100)."""
    import torch

    from moetune.adapters.save import read_adapter

    adapter = check_adapter_folder(out, hf.load_config(Checkpoint.open(model_dir)))
    config, state = read_adapter(out)
    r = adapter.r
    assert config["lora_alpha"] == 2 * r * r, (r, config["lora_alpha"])
    assert all(torch.all(t == r / 100) for t in state.values())
    moetune.load_model(model_dir, device="cpu", dtype="float32", progress=False, adapter=out)


def adapter_save_kill(tmp: Path, model_dir: Path, seed: int) -> None:
    from moetune.adapters import save_adapter

    out = tmp / "out"
    first, second = two_adapters(model_dir)
    save_adapter(first, out)
    (out / "tokenizer.json").write_text("{}")  # beside the adapter, as in a moetune train output_dir
    delay = random.Random(seed).uniform(0, 0.5)
    _kill_after(_child(ADAPTER_CHILD, str(model_dir), str(out)), "start", delay)
    _check_adapter(model_dir, out)  # the previous state loads (recovering a save the kill interrupted)
    assert (out / "tokenizer.json").read_text() == "{}"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []
    save_adapter(second, out)  # a rerun completes
    _check_adapter(model_dir, out)
    assert check_adapter_folder(out).r == 8


# ---- converts: int8 and bf16 stores written in turn over one destination

CONVERT_CHILD = """
import sys
from moetune.loading.convert import convert_checkpoint
src, dst = sys.argv[1], sys.argv[2]
print("start", flush=True)
n = 0
while True:
    convert_checkpoint(src, dst, ("int8", "bf16")[n % 2], overwrite=True, num_threads=1, progress=False)
    n += 1
"""


def _convert(src: Path, dst: Path, fmt: str) -> None:
    assert (
        main(["convert", str(src), str(dst), "--format", fmt, "--quiet", "--threads", "1", "--overwrite"])
        == 0
    )


def _load_store(src: Path, dst: Path) -> str:
    moetune.load_model(src, device="cpu", dtype="float32", progress=False, num_threads=1, expert_path=dst)
    return json.loads((dst / "manifest.json").read_text())["format"]


def convert_kill(tmp: Path, model_dir: Path, seed: int) -> None:
    dst = tmp / "store"
    _convert(model_dir, dst, "int8")
    _kill_after(_child(CONVERT_CHILD, str(model_dir), str(dst)), "start", random.Random(seed).uniform(0, 1.5))
    try:  # the previous store, or the new one: whole either way
        assert _load_store(model_dir, dst) in ("int8", "dense")
    except LoadError as e:  # killed between the two renames: refused clearly, naming the store moved aside
        assert "A conversion replacing it was interrupted" in str(e), e
    _convert(model_dir, dst, "fp8")  # a rerun completes (restoring and replacing what was there)
    assert _load_store(model_dir, dst) == "fp8_block"
    assert sorted(p.name for p in tmp.iterdir()) == ["store"]  # no staging or replaced folder left


# ---- training: a checkpoint every step, killed at any point; each checkpoint-N is whole and resume completes

STEPS = (
    16  # about 0.15 s each with a checkpoint every step: the kill, at most 0.6 s after the first, is mid-run
)
TRAIN_CHILD = """
import sys
from moetune.cli.main import main
print("start", flush=True)
main(["train", sys.argv[1]])
"""


def train_config(tmp: Path, model: Path, **over) -> Path:
    """``test_train``'s tiny run, longer, with a checkpoint every step and rotation."""
    return test_train._config(tmp, model, max_steps=STEPS, save_steps=1, save_total_limit=2, **over)


def train_save_kill(tmp: Path, demo_model: Path, seed: int) -> None:
    from moetune.config import load_config
    from moetune.train.recipe import run

    tmp.mkdir(exist_ok=True)
    out = tmp / "out"
    proc = _child(TRAIN_CHILD, str(train_config(tmp, demo_model)))
    assert proc.stdout is not None
    proc.stdout.readline()
    deadline = time.monotonic() + 300
    while not (out / "checkpoint-1").is_dir():  # at least one whole checkpoint, then kill at any point
        assert proc.poll() is None and time.monotonic() < deadline, "the training child died or hung"
        time.sleep(0.05)
    time.sleep(random.Random(seed).uniform(0, 0.6))
    proc.kill()
    proc.wait()
    model_config = hf.load_config(Checkpoint.open(demo_model))
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    assert checkpoints
    for ckpt in checkpoints:  # every visible checkpoint is whole
        check_adapter_folder(ckpt, model_config)
        state = json.loads((ckpt / "trainer_state.json").read_text())
        assert state["global_step"] == int(ckpt.name.split("-")[1])
        assert (ckpt / "optimizer.pt").is_file() and (ckpt / "scheduler.pt").is_file()
    resume = load_config(train_config(tmp, demo_model, resume_from_checkpoint=True))
    run_dir = out
    if checkpoints[-1].name == f"checkpoint-{STEPS}":  # the kill landed after the last checkpoint
        with pytest.raises(CheckpointError, match=f"--adapter {checkpoints[-1]}"):
            run(resume, progress=False)  # nothing left to train: the error points at the final weights
        out = checkpoints[-1]
    else:
        run(resume, progress=False)
        final = json.loads((out / "trainer_state.json").read_text())
        assert final["global_step"] == STEPS, (final["global_step"], [p.name for p in checkpoints])
    assert not list(run_dir.glob("tmp-*")), "the start of the rerun removes what the killed save left"
    moetune.load_model(demo_model, device="cpu", dtype="float32", progress=False, adapter=out)
