"""``moetune.tensorfile.write_streamed``: a safetensors file written tensor by tensor, placeholders fetched when
their turn comes, is the file ``safetensors.torch.save_file`` writes (the same bytes, so the same tensors and
metadata for every reader), holds at most one fetched tensor at a time, and written through
``write_atomically`` a kill mid-write leaves the previous file whole. The adapter writer built on it writes what
``PeftModel.save_pretrained`` writes, and stock PEFT loads it."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import weakref

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moetune.atomic import temp_path, write_atomically
from moetune.errors import MoetuneError
from moetune.tensorfile import read_header, write_streamed
from moetune.testing.child import child_env


def _tensors() -> dict[str, torch.Tensor]:
    """Every dtype safetensors holds, names out of order, a 0-dim and an empty tensor among them."""
    gen = torch.Generator().manual_seed(0)
    out = {
        "model.layers.1.mlp.experts.lora_A.weight": torch.randn(16, 8, generator=gen),
        "model.layers.0.mlp.experts.lora_B.weight": torch.randn(8, 16, generator=gen),
        "b.half": torch.randn(3, 5, generator=gen).half(),
        "a.bf16": torch.randn(7, generator=gen).bfloat16(),
        "f64": torch.randn(2, 2, generator=gen, dtype=torch.float64),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "i64": torch.arange(5),
        "i32": torch.arange(3, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16),
        "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8),
        "flag": torch.tensor([True, False, True]),
        "fp8": torch.randn(4, generator=gen).to(torch.float8_e4m3fn),
        "fp8b": torch.randn(4, generator=gen).to(torch.float8_e5m2),
    }
    return out


@pytest.mark.parametrize("behind", [False, True])
def test_the_streamed_file_is_save_files_file(tmp_path, monkeypatch, behind) -> None:
    """The same bytes as ``save_file``; at most one fetched tensor alive at a fetch when written in turn, two when
    written behind (the one being written), whose bytes are then written by one other thread."""
    import moetune.tensorfile as tensorfile

    writers: set[int] = set()
    write_bytes = tensorfile._write_bytes

    def recorded(f, t):
        writers.add(threading.get_ident())
        write_bytes(f, t)

    monkeypatch.setattr(tensorfile, "_write_bytes", recorded)
    tensors = _tensors()
    want = tmp_path / "want.safetensors"
    save_file(tensors, str(want), metadata={"format": "pt"})
    # the expert-LoRA weights and one more stand in as placeholders, produced when the writer reaches them
    pending = ["model.layers.1.mlp.experts.lora_A.weight", "model.layers.0.mlp.experts.lora_B.weight", "i64"]
    placeholders = {k: torch.empty_like(tensors[k], device="meta") for k in pending}
    by_id = {id(p): k for k, p in placeholders.items()}
    fetched: list[str] = []
    alive: list[weakref.ref] = []

    def fetch(placeholder: torch.Tensor) -> torch.Tensor:
        gc.collect()
        assert sum(ref() is not None for ref in alive) <= behind, "a fetched tensor outlived its write"
        assert threading.get_ident() == threading.main_thread().ident
        key = by_id[id(placeholder)]
        fetched.append(key)
        made = tensors[key].clone()  # a fresh tensor, as a gather makes
        alive.append(weakref.ref(made))
        return made

    got = tmp_path / "got.safetensors"
    write_streamed(got, {**tensors, **placeholders}, {"format": "pt"}, fetch, behind=behind)
    assert got.read_bytes() == want.read_bytes()
    assert len(writers) == 1 and (threading.get_ident() in writers) is not behind
    # in the file's data order, each once
    order = sorted(read_header(got).values(), key=lambda info: info.offset)
    assert fetched == [info.key for info in order if info.key in pending]
    with safe_open(str(got), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert sorted(f.keys()) == sorted(tensors)
    loaded = load_file(str(got))
    for k, t in tensors.items():
        assert loaded[k].dtype == t.dtype and torch.equal(
            loaded[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)
        ), k


def test_errors_written_behind_reach_the_caller(tmp_path, monkeypatch) -> None:
    """With ``behind``, an error producing a tensor, or writing one, is raised by ``write_streamed`` itself (after
    the write in flight has ended: the file is closed, no thread is left writing)."""
    placeholders = {f"w{i}": torch.empty(4, device="meta") for i in range(3)}

    def fails_at_w1(key: str) -> torch.Tensor:
        if key == "w1":
            raise ValueError("made w1 wrong")
        return torch.ones(4)

    with pytest.raises(ValueError, match="made w1 wrong"):
        write_streamed(tmp_path / "a", placeholders, produce=fails_at_w1, behind=True)
    bad = torch.ones(4, dtype=torch.float32)
    with pytest.raises(AssertionError, match="w2"):  # a tensor of the wrong shape, refused before its write
        write_streamed(
            tmp_path / "b", placeholders, produce=lambda k: bad if k != "w2" else torch.ones(5), behind=True
        )
    import moetune.tensorfile as tensorfile

    calls = []

    def disk_full(f, t):
        calls.append(threading.get_ident())
        if len(calls) == 2:
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(tensorfile, "_write_bytes", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_streamed(tmp_path / "c", placeholders, produce=lambda k: bad, behind=True)
    assert len(calls) == 2 and threading.get_ident() not in calls
    assert not [t for t in threading.enumerate() if t.name.startswith("moetune-write")]


def test_without_metadata_and_without_placeholders(tmp_path) -> None:
    tensors = {"x": torch.ones(3), "y": torch.zeros(2, dtype=torch.bfloat16)}
    save_file(tensors, str(tmp_path / "want"))
    write_streamed(tmp_path / "got", tensors)
    assert (tmp_path / "got").read_bytes() == (tmp_path / "want").read_bytes()


_KILLED_WRITER = """
import sys, time
from pathlib import Path
import torch
from moetune.atomic import write_atomically
from moetune.tensorfile import write_streamed

target, marker = Path(sys.argv[1]), Path(sys.argv[2])
tensors = {f"w{i}": torch.empty(1 << 20, 8, dtype=torch.float32, device="meta") for i in range(4)}

def fetch(placeholder):
    if marker.exists():  # the second tensor: the first one's bytes are in the temporary file
        time.sleep(600)
    marker.write_text("writing")
    return torch.full(placeholder.shape, 2.0)

write_atomically(target, lambda tmp: write_streamed(tmp, tensors, {"format": "pt"}, fetch))
"""


def test_a_kill_mid_write_leaves_the_old_file(tmp_path) -> None:
    target, marker = tmp_path / "adapter_model.safetensors", tmp_path / "marker"
    old = {"w0": torch.ones(2, 2)}
    save_file(old, str(target), metadata={"format": "pt"})
    before = target.read_bytes()
    env = child_env()
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, str(target), str(marker)], env=env)
    try:
        for _ in range(1200):  # the child is in its second fetch: the temporary file holds a header and 32 MB
            if marker.exists() and temp_path(target).exists() and temp_path(target).stat().st_size > 32 << 20:
                break
            assert proc.poll() is None, "the writer ended before it was killed"
            subprocess.run(["sleep", "0.05"], check=True)
        else:
            pytest.fail("the writer never reached its second tensor")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert target.read_bytes() == before
    assert torch.equal(load_file(str(target))["w0"], old["w0"])
    # the rerun overwrites the leftover and replaces the file
    new = {"w0": torch.zeros(3)}
    write_atomically(target, lambda tmp: write_streamed(tmp, new, {"format": "pt"}))
    assert torch.equal(load_file(str(target))["w0"], new["w0"]) and not temp_path(target).exists()


def test_the_adapter_writer_writes_what_peft_writes_and_peft_loads_it(tmp_path) -> None:
    from peft import LoraConfig, PeftModel, get_peft_model

    from moetune.adapters.save import write_adapter_weights

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj = torch.nn.Linear(6, 6)
            self.v_proj = torch.nn.Linear(6, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.v_proj(self.q_proj(x))

    torch.manual_seed(0)
    model = get_peft_model(
        Tiny(), LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    model.save_pretrained(tmp_path / "peft")
    state = model.state_dict()
    name = next(k for k in state if "v_proj.lora_B" in k)
    placeholder = torch.empty_like(state[name], device="meta")
    write_adapter_weights(
        model, tmp_path / "ours.safetensors", {**state, name: placeholder}, lambda p: state[name].clone()
    )
    assert (tmp_path / "ours.safetensors").read_bytes() == (
        tmp_path / "peft/adapter_model.safetensors"
    ).read_bytes()
    os.replace(tmp_path / "ours.safetensors", tmp_path / "peft/adapter_model.safetensors")
    torch.manual_seed(0)  # the same base weights; the LoRA comes from the file
    loaded = PeftModel.from_pretrained(Tiny(), str(tmp_path / "peft"))
    x = torch.randn(3, 6)
    assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("align", [64, 4096])
def test_aligned_data_section_reads_back_in_stock_safetensors(tmp_path, align) -> None:
    """``align`` pads the JSON with spaces so the data starts at a multiple of ``align``; safetensors' own
    readers take the file and give the same tensors, and only the header differs from save_file's."""
    tensors = {"b": torch.arange(6, dtype=torch.float32).view(2, 3), "a": torch.arange(5, dtype=torch.int8)}
    got, want = tmp_path / "got", tmp_path / "want"
    write_streamed(got, tensors, {"format": "pt"}, align=align)
    save_file(tensors, str(want), metadata={"format": "pt"})
    infos = read_header(got)
    data_start = min(info.offset for info in infos.values())
    assert data_start % align == 0 and data_start >= align
    assert (
        got.read_bytes()[data_start:]
        == want.read_bytes()[min(i.offset for i in read_header(want).values()) :]
    )
    with safe_open(str(got), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    loaded = load_file(str(got))
    assert all(torch.equal(loaded[k], t) for k, t in tensors.items())


def test_largest_first_reads_back_in_stock_safetensors(tmp_path) -> None:
    """Data by size, largest first (then by name), not by dtype: stock readers find each tensor all the same."""
    tensors = {
        "scale": torch.rand(3),  # F32: first in save_file's order
        "codes": torch.randint(-128, 127, (4, 64), dtype=torch.int8),
        "b": torch.randn(2, 8).bfloat16(),
        "a": torch.randn(4, 4).bfloat16(),
    }
    path = tmp_path / "x"
    write_streamed(path, tensors, align=4096, largest_first=True)
    order = [i.key for i in sorted(read_header(path).values(), key=lambda info: info.offset)]
    assert order == ["codes", "a", "b", "scale"]  # 256, 32, 32 (a before b), 12 bytes
    assert min(i.offset for i in read_header(path).values()) == 4096
    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], t) for k, t in tensors.items())
    with safe_open(str(path), "pt") as f:
        assert torch.equal(f.get_tensor("scale"), tensors["scale"])


@pytest.mark.parametrize("align", [0, 12, -8])
def test_alignment_that_is_not_a_multiple_of_8_is_refused(tmp_path, align) -> None:
    with pytest.raises(MoetuneError, match=rf"multiple of 8 bytes; got {align}"):
        write_streamed(tmp_path / "x", {"a": torch.ones(2)}, align=align)
    assert not (tmp_path / "x").exists()
