"""``moetune convert`` -> ``load_model(..., expert_path=DST)`` on tiny real checkpoints.

The reference for a store is online quantization of the same checkpoint (``expert_format=...``, itself
tested against the dense engine on the dequantized weights): same quantizer, same input, so the engines
must hold bit-identical weights and the model the same logits, exactly. Then the ways a store can be
wrong for the model, each a ``LoadError`` (or ``ConfigError`` for bad options) naming the file or option.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import moetune
from moetune.cli.main import main
from moetune.engine.formats import dense
from moetune.errors import ConfigError, LoadError
from moetune.layer import CpuExperts
from moetune.store.files import StoreWriter
from moetune.store.manifest import MANIFEST
from moetune.testing.tiny import save_tiny_model

# I = 32 so that int4's group size 32 (and mxfp4's block of 32) divides H = 64 and I
OVERRIDES = {"moe_intermediate_size": 32}
FORMATS = {
    "int8": ([], {"expert_format": "int8"}),
    "int4-asym-g32": (
        ["--group-size", "32", "--asymmetric"],
        {"expert_format": "int4", "int4_group_size": 32, "int4_symmetric": False},
    ),
    "fp8": ([], {"expert_format": "fp8"}),
    "mxfp4": ([], {"expert_format": "mxfp4"}),
}


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("src"), tokenizer=False, **OVERRIDES)


def _load(path: Path, **options):
    return moetune.load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1, **options)


def _convert(src: Path, dst: Path, fmt: str, *extra: str) -> int:
    return main(["convert", str(src), str(dst), "--format", fmt, "--quiet", "--threads", "1", *extra])


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 96, (2, 12), generator=torch.Generator().manual_seed(seed))


def _experts(model) -> dict[str, CpuExperts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, CpuExperts)}


@pytest.mark.parametrize("label", FORMATS)
def test_convert_then_load_equals_online_quantization(src, tmp_path, label, capsys):
    cli_args, load_args = FORMATS[label]
    fmt = load_args["expert_format"]
    assert _convert(src, tmp_path / "store", fmt, *cli_args) == 0
    assert (
        f"wrote 2 experts modules of qwen3_moe as {fmt if fmt != 'fp8' else 'fp8_block'}"
        in capsys.readouterr().out
    )
    stored, online = _load(src, expert_path=tmp_path / "store"), _load(src, **load_args)
    a, b = _experts(stored), _experts(online)
    assert list(a) == list(b) and len(a) == 2
    for name in a:
        wa, wb = a[name].engine.weights, b[name].engine.weights
        assert type(wa) is type(wb) and wa.params() == wb.params()
        for x, y in zip(wa.dequantize(), wb.dequantize()):
            assert torch.equal(x, y), name
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(stored(ids).logits, online(ids).logits)


@pytest.mark.parametrize("padded", [False, True], ids=["contiguous", "padded"])
def test_bf16_store_equals_a_bf16_load(src, tmp_path, monkeypatch, padded):
    """``padded``: rows padded as the engine pads 4 KiB rows (forced onto the tiny H = 64 and I = 32: bf16 rows of
    a multiple of 64 bytes): the store holds them padded and the engine uses its mapping as it is."""
    if padded:
        monkeypatch.setattr(dense, "ALIAS_BYTES", 64)
    assert _convert(src, tmp_path / "store", "bf16") == 0
    kw = {"device": "cpu", "dtype": "bfloat16", "progress": False, "num_threads": 1}
    stored = moetune.load_model(src, expert_path=tmp_path / "store", **kw)
    plain = moetune.load_model(src, **kw)
    pad = 32 if padded else 0
    for name, experts in _experts(stored).items():
        w, other = experts.engine.weights, _experts(plain)[name].engine.weights
        assert (w.gate_up.stride(1), w.down.stride(1)) == (64 + pad, 32 + pad), name
        assert other.gate_up.stride() == w.gate_up.stride() and other.down.stride() == w.down.stride()
        assert torch.equal(w.gate_up, other.gate_up) and torch.equal(w.down, other.down)
    with torch.no_grad():
        assert torch.equal(stored(_ids()).logits, plain(_ids()).logits)


def test_interrupted_conversion_leaves_no_store_and_a_rerun_succeeds(src, tmp_path, monkeypatch):
    calls = {"n": 0}
    add = StoreWriter.add

    def failing_add(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # as if the user stopped it after the first layer
        return add(self, *args, **kwargs)

    monkeypatch.setattr(StoreWriter, "add", failing_add)
    with pytest.raises(KeyboardInterrupt):
        _convert(src, tmp_path / "store", "int8")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing half-written, nothing left over
    with pytest.raises(LoadError, match="does not exist"):
        _load(src, expert_path=tmp_path / "store")
    assert _convert(src, tmp_path / "store", "int8") == 0  # no --overwrite needed
    _load(src, expert_path=tmp_path / "store")


def test_a_finished_store_needs_overwrite(src, tmp_path, capsys):
    assert _convert(src, tmp_path / "store", "int8") == 0
    assert _convert(src, tmp_path / "store", "fp8") == 2
    assert "already holds a converted store (manifest.json); pass --overwrite" in capsys.readouterr().err
    assert _convert(src, tmp_path / "store", "fp8", "--overwrite") == 0
    assert json.loads((tmp_path / "store" / MANIFEST).read_text())["format"] == "fp8_block"


def test_the_cli_format_names_are_the_stores():
    from moetune.cli.convert import FORMAT_CHOICES
    from moetune.store.manifest import CONVERT_FORMATS

    assert tuple(CONVERT_FORMATS) == FORMAT_CHOICES


def test_bad_convert_options_exit_2_before_writing(src, tmp_path, capsys):
    assert _convert(src, tmp_path / "s1", "int4", "--group-size", "48") == 2
    assert "--group-size got 48; allowed: 32, 64, 128" in capsys.readouterr().err  # the flag, not the option
    assert _convert(src, tmp_path / "s2", "int4", "--group-size", "128") == 2  # does not divide I = 32
    assert "--group-size 128 does not divide" in capsys.readouterr().err
    assert _convert(src, tmp_path / "s4", "int8", "--asymmetric") == 2
    err = capsys.readouterr().err
    assert "--symmetric/--asymmetric is set (False)" in err and "int4_symmetric" not in err
    assert _convert(tmp_path / "nowhere", tmp_path / "s3", "int8") == 2
    assert "checkpoint directory" in capsys.readouterr().err
    assert not any(p.exists() for p in (tmp_path / "s1", tmp_path / "s2", tmp_path / "s3", tmp_path / "s4"))


# ---- a store that does not fit the model: LoadError naming the file, before any weight is read


@pytest.fixture(scope="module")
def store(src, tmp_path_factory) -> Path:
    dst = tmp_path_factory.mktemp("store") / "int8"
    assert _convert(src, dst, "int8") == 0
    return dst


def test_store_of_another_model_type(store, tmp_path):
    other = save_tiny_model("mixtral", tmp_path / "mixtral", tokenizer=False)
    with pytest.raises(LoadError, match=r"model_type is 'qwen3_moe', the checkpoint's is 'mixtral'"):
        _load(other, expert_path=store)


def test_store_of_another_checkpoint_of_the_same_architecture(store, tmp_path):
    other = save_tiny_model("qwen3_moe", tmp_path / "other", seed=1, tokenizer=False, **OVERRIDES)
    with pytest.raises(LoadError, match=r"(?s)does not fit the model.*hold other bytes.*moetune convert"):
        _load(other, expert_path=store)


def test_store_with_other_expert_shapes(store, tmp_path):
    other = save_tiny_model("qwen3_moe", tmp_path / "other", tokenizer=False, num_experts=4, **OVERRIDES)
    with pytest.raises(
        LoadError, match=r"\(E, H, I, bias\) = \(8, 64, 32, False\), the model's .* \(4, 64, 32, False\)"
    ):
        _load(other, expert_path=store)


def test_a_model_folder_given_as_the_store(src):
    """``expert_path`` naming a model folder: said so, with a convert into a new folder (the message offered a
    convert onto that very folder, which convert refuses)."""
    with pytest.raises(LoadError, match=r"is a model folder \(config.json, no manifest.json\)") as err:
        _load(src, expert_path=src)
    assert f"moetune convert {src} STORE_DIR --format" in str(err.value)


def test_store_of_another_format_than_asked(src, store):
    with pytest.raises(
        LoadError, match=r"format is 'int8', but expert_format 'fp8_block' was asked for"
    ) as err:
        _load(src, expert_path=store, expert_format="fp8")
    # the command it offers writes the format asked for, not the store's again
    assert f"moetune convert {src} {store} --format fp8 --overwrite" in str(err.value)


def _alter_one_byte(store: Path) -> Path:
    path = next(store.glob("*.safetensors"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    return path


def test_altered_store_file_fails_the_load(src, tmp_path):
    assert _convert(src, tmp_path / "store", "int8") == 0
    path = _alter_one_byte(tmp_path / "store")
    with pytest.raises(LoadError, match=rf"{path} was altered after conversion") as info:
        _load(src, expert_path=tmp_path / "store")
    # the command to write it again, whole: --format was missing from it
    assert str(info.value).endswith(
        f"Convert the checkpoint again: moetune convert {src} {tmp_path / 'store'} --format int8 --overwrite"
    )


def test_altered_store_file_fails_the_first_step_on_disk(src, tmp_path):
    """Disk residency hashes each file the first time it is read: the first forward, before its weights
    are used."""
    assert _convert(src, tmp_path / "store", "int8") == 0
    path = _alter_one_byte(tmp_path / "store")
    model = _load(src, expert_path=tmp_path / "store", expert_residency="disk")
    for _ in range(2):  # and again: a failed check never lets the layer through
        with pytest.raises(LoadError, match=rf"{path} was altered after conversion"), torch.no_grad():
            model(_ids())


def test_truncated_store_file_fails_the_load(src, tmp_path):
    assert _convert(src, tmp_path / "store", "int8") == 0
    path = next((tmp_path / "store").glob("*.safetensors"))
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(LoadError, match=rf"{path} is truncated"):
        _load(src, expert_path=tmp_path / "store", expert_residency="disk")


@pytest.mark.parametrize(
    "options,match",
    [
        ({"expert_residency": "disk"}, r"expert_residency 'disk' pages experts from a converted store"),
        ({"expert_residency": "ssd", "expert_path": "x"}, r"expert_residency got 'ssd'; allowed: ram, disk"),
        ({"expert_residency_budget": "1GB", "expert_path": "x"}, r"applies to expert_residency disk only"),
        (
            {"expert_residency": "disk", "expert_residency_budget": "lots", "expert_path": "x"},
            r"expert_residency_budget got 'lots'; allowed: a positive number of bytes, or a size such as '64GB'",
        ),
    ],
)
def test_bad_store_options(src, options, match):
    with pytest.raises(ConfigError, match=match):
        _load(src, **options)


def test_budget_below_two_layers(src, store):
    with pytest.raises(
        ConfigError, match=r"expert_residency_budget 1000 bytes cannot hold the two largest layers"
    ):
        _load(src, expert_path=store, expert_residency="disk", expert_residency_budget=1000)
