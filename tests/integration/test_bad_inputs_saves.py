"""Catalogue of bad inputs on the save side: broken adapters, convert misuse, NaN/Inf weights.

One case per bad input. Each asserts the error class and words naming the file, field or tensor; that it came
before the model load (the loader and the expert streaming are replaced by functions that fail the test),
except where the bad values are only found by reading them (NaN weights: the scan runs as they stream, so
there the test asserts what the stream had done); and that nothing on disk changed (the folder hashed before
and after).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from moetune.cli.main import main
from moetune.errors import AdapterError, ConfigError, MoetuneError, NonFiniteWeightError
from moetune.testing.tiny import save_tiny_model

OVERRIDES = {"moe_intermediate_size": 32}  # int4 group 32 and mxfp4 blocks of 32 divide I
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"
EXPERTS2 = "base_model.model.model.layers.2.mlp.experts"  # layers 0 and 2 are MoE, 1 dense (mlp_only_layers)
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


def tree_hash(root: Path) -> str:
    """Every path under ``root`` (hidden ones included) with its bytes; "absent" when it does not exist."""
    if not root.exists():
        return "absent"
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("model"), tokenizer=False, **OVERRIDES)


@pytest.fixture(scope="module")
def adapter(model_dir, tmp_path_factory) -> Path:
    """A good adapter (rank 4, LoRA on every linear and on the routed experts), random non-zero values."""
    from moetune.adapters import attach_lora, save_adapter
    from moetune.loading import load_model

    peft = attach_lora(load_model(model_dir, device="cpu", dtype="float32", progress=False), rank=4, alpha=8)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return save_adapter(peft, tmp_path_factory.mktemp("adapter") / "adapter")


@pytest.fixture
def no_model_load(monkeypatch, no_heavy_work):
    """Fail the test if a model load starts (the checkpoint loader itself, weights or experts)."""

    def forbidden(*args, **kwargs):
        raise AssertionError("the model load started before the error was raised")

    monkeypatch.setattr("moetune.loading.load_model", forbidden)


# ---- broken adapters: moetune.load_model(adapter=...) refuses them before the model loads


def _weights(fn: Callable[[dict[str, torch.Tensor]], None], name: str = WEIGHTS) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        state = load_file(str(folder / name))
        fn(state)
        save_file(state, str(folder / name), metadata={"format": "pt"})

    return edit


def _config(fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        config = json.loads((folder / CONFIG).read_text())
        fn(config)
        (folder / CONFIG).write_text(json.dumps(config))

    return edit


def _header(fn: Callable[[bytes], bytes]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        data = (folder / WEIGHTS).read_bytes()
        (size,) = struct.unpack("<Q", data[:8])
        header = fn(data[8 : 8 + size])
        assert len(header) == size
        (folder / WEIGHTS).write_bytes(data[:8] + header + data[8 + size :])

    return edit


def _both(*edits: Callable[[Path], None]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        for fn in edits:
            fn(folder)

    return edit


def _drop(prefix: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(state: dict[str, torch.Tensor]) -> None:
        for k in [k for k in state if k.startswith(prefix)]:
            del state[k]

    return fn


def _set(
    key: str, value: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(state: dict[str, torch.Tensor]) -> None:
        state[key] = value(state[key])

    return fn


def _poison(key: str, value: float) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(state: dict[str, torch.Tensor]) -> None:
        state[key] = state[key].clone()
        state[key][1, 2] = value

    return fn


def _wider_experts(state: dict[str, torch.Tensor]) -> None:
    """Layer 2's gate_up expert LoRA saved for E = 9 experts instead of 8: a consistent pair of another model."""
    a, b = f"{EXPERTS2}.base_layer.lora_A.weight", f"{EXPERTS2}.base_layer.lora_B.weight"
    state[a] = torch.cat([state[a], state[a][:4]])
    state[b] = torch.cat([state[b], state[b][:, :4]], dim=1)


ADAPTER_CASES = {
    "missing config": (lambda f: (f / CONFIG).unlink(), "lacks adapter_config.json"),
    "missing weights": (lambda f: (f / WEIGHTS).unlink(), "lacks adapter_model.safetensors"),
    "config not JSON": (
        lambda f: (f / CONFIG).write_text('{"r": 4,'),
        "adapter_config.json is not valid JSON",
    ),
    "config a JSON list": (lambda f: (f / CONFIG).write_text("[4]"), "holds a JSON list; .* a JSON object"),
    "peft_type not LORA": (
        _config(lambda c: c.update(peft_type="IA3")),
        "peft_type 'IA3'; moetune loads LORA",
    ),
    "r does not match the tensors": (_config(lambda c: c.update(r=8)), "not a rank-8 pair .* r=8"),
    "r multiple of the tensors' rank": (_config(lambda c: c.update(r=2)), r"\[32, 64\] .* do not fit .* r=2"),
    "r zero": (_config(lambda c: c.update(r=0)), "r is 0; it must be a whole number >= 1"),
    "r a string": (_config(lambda c: c.update(r="4")), "r is '4'; it must be a whole number"),
    "lora_alpha missing": (_config(lambda c: c.pop("lora_alpha")), "has no lora_alpha"),
    "lora_alpha a string": (
        _config(lambda c: c.update(lora_alpha="16")),
        "lora_alpha is '16'; .* finite number",
    ),
    "use_rslora not a bool": (_config(lambda c: c.update(use_rslora="yes")), "use_rslora is 'yes'"),
    "DoRA": (_config(lambda c: c.update(use_dora=True)), "uses DoRA, which moetune does not load"),
    "rank_pattern": (_config(lambda c: c.update(rank_pattern={"q_proj": 8})), "per-module ranks"),
    "targets nothing": (
        _config(lambda c: c.update(target_modules=[], target_parameters=None)),
        "targets nothing",
    ),
    "target_modules a number": (_config(lambda c: c.update(target_modules=3)), "target_modules is 3"),
    "a layer's expert LoRA missing": (
        _weights(_drop(EXPERTS2 + ".")),
        r"incomplete: adapter_config.json targets model.layers.2.mlp.experts, model.layers.2.mlp.experts.base_layer",
    ),
    "a lora_B missing": (_weights(_drop(f"{Q0}.lora_B")), r"incomplete: it lacks .*q_proj.lora_B.weight"),
    "a non-LoRA tensor": (
        _weights(lambda s: s.update({"base_model.model.lm_head.weight": torch.zeros(96, 64)})),
        "neither LoRA A/B weights nor whole weights of the modules in modules_to_save .*lm_head.weight",
    ),
    "a modules_to_save weight of another shape": (
        _both(
            _config(lambda c: c.update(modules_to_save=["gate"])),
            _weights(
                lambda s: s.update({"base_model.model.model.layers.0.mlp.gate.weight": torch.zeros(9, 64)})
            ),
        ),
        r"model.layers.0.mlp.gate.weight \[9, 64\] \(a whole weight saved with the adapter\) does not fit .* has "
        r"it as \[8, 64\]",
    ),
    "LoRA for a module the model lacks": (
        _weights(
            lambda s: s.update(
                {k.replace("layers.0.", "layers.7."): v.clone() for k, v in s.items() if Q0 in k}
            )
        ),
        "holds LoRA for model.layers.7.self_attn.q_proj, which .* does not have",
    ),
    "expert LoRA for another number of experts": (
        _weights(_wider_experts),
        r"layers.2.mlp.experts.base_layer's lora_A \[36, 64\] .* routed-experts projection \(E=8\)",
    ),
    "linear LoRA of another width": (
        _weights(_set(f"{Q0}.lora_A.weight", lambda t: torch.zeros(4, 65))),
        r"q_proj's lora_A \[4, 65\] .* expected \[4, 64\]",
    ),
    "integer tensor": (
        _weights(_set(f"{Q0}.lora_A.weight", lambda t: t.to(torch.int32))),
        "q_proj.lora_A.weight has dtype I32",
    ),
    "header not JSON (flipped byte)": (
        _header(lambda h: b"[" + h[1:]),
        "is damaged: cannot read the safetensors header",
    ),
    "header shape altered (flipped digit)": (
        _header(lambda h: h.replace(b'"shape":[4,64]', b'"shape":[5,64]', 1)),
        r"is damaged: tensor .* spans 1024 bytes, its shape \[5, 64\]",
    ),
    "header length beyond the file": (
        lambda f: (f / WEIGHTS).write_bytes(struct.pack("<Q", 1 << 40) + (f / WEIGHTS).read_bytes()[8:]),
        "header length 1099511627776 exceeds the file",
    ),
    "truncated weights": (
        lambda f: (f / WEIGHTS).write_bytes((f / WEIGHTS).read_bytes()[:-100]),
        "is damaged: .* is truncated",
    ),
    "NaN in a layer's expert LoRA": (
        _weights(_poison(f"{EXPERTS2}.lora_A.weight", float("nan"))),
        r"tensor base_model.model.model.layers.2.mlp.experts.lora_A.weight holds 1 NaN and 0 Inf",
    ),
    "Inf in a linear LoRA": (
        _weights(_poison(f"{Q0}.lora_B.weight", float("-inf"))),
        r"q_proj.lora_B.weight holds 0 NaN and 1 Inf",
    ),
}


@pytest.mark.parametrize("case", ADAPTER_CASES)
def test_broken_adapter_is_refused_before_the_model_loads(case, model_dir, adapter, tmp_path, no_model_load):
    mutate, match = ADAPTER_CASES[case]
    bad = tmp_path / "adapter"
    shutil.copytree(adapter, bad)
    mutate(bad)
    before = tree_hash(tmp_path)
    with pytest.raises(AdapterError, match=match):
        moetune.load_model(model_dir, device="cpu", dtype="float32", progress=False, adapter=bad)
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("where", ["nowhere", "a file"])
def test_adapter_path_that_is_no_folder(where, model_dir, tmp_path, no_model_load):
    path = tmp_path / "adapter"
    if where == "a file":
        path.write_text("not a folder")
    before = tree_hash(tmp_path)
    with pytest.raises(AdapterError, match=r"adapter '.*adapter' is not a folder"):
        moetune.load_model(model_dir, device="cpu", adapter=path)
    assert tree_hash(tmp_path) == before


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_cli_adapter_checked_before_the_tokenizer_and_model(
    command, model_dir, adapter, tmp_path, monkeypatch, capsys
):
    def forbidden(*args, **kwargs):
        raise AssertionError("the tokenizer or model load started before the error was raised")

    monkeypatch.setattr("moetune.train.generation.load_for_inference", forbidden)
    shutil.copytree(adapter, tmp_path / "adapter")
    (tmp_path / "adapter" / CONFIG).write_text("{not json")
    argv = [command, "--model", str(model_dir), "--adapter", str(tmp_path / "adapter")]
    assert main(argv + (["--prompt", "hi"] if command == "generate" else [])) == 2
    assert "adapter_config.json is not valid JSON" in capsys.readouterr().err


# ---- convert misuse: refused before any weight is read, nothing removed


def _convert(src: Path, dst: Path, *extra: str) -> int:
    return main(["convert", str(src), str(dst), "--quiet", "--threads", "1", *extra])


def _finished_store(model_dir: Path, dst: Path) -> None:
    assert _convert(model_dir, dst, "--format", "int8") == 0


CONVERT_CASES: dict[str, tuple[Callable[[Path, Path], None], list[str], str]] = {
    "destination holds a weights backup": (
        lambda m, d: (d.mkdir(), shutil.copy(m / "model.safetensors", d / "model.safetensors")),
        ["--format", "int8"],
        r"holds entries moetune convert did not write \(model.safetensors\)",
    ),
    "destination holds a backup, with --overwrite": (
        lambda m, d: (d.mkdir(), shutil.copy(m / "model.safetensors", d / "model.safetensors")),
        ["--format", "int8", "--overwrite"],
        r"holds entries moetune convert did not write \(model.safetensors\); convert never deletes them",
    ),
    "destination is the source checkpoint": (
        lambda m, d: shutil.copytree(m, d),
        ["--format", "int8", "--overwrite"],
        r"holds entries moetune convert did not write \(config.json, generation_config.json, model.safetensors\)",
    ),
    "destination is a file": (
        lambda m, d: d.write_text("x"),
        ["--format", "int8"],
        "exists and is not a directory",
    ),
    "finished store without --overwrite": (_finished_store, ["--format", "int4"], "pass --overwrite"),
    "store plus a user file, --overwrite": (
        lambda m, d: (_finished_store(m, d), (d / "notes.txt").write_text("mine")),
        ["--format", "int8", "--overwrite"],
        r"is a moetune store but also holds .*\(notes.txt\)",
    ),
    "a manifest.json moetune did not write": (
        lambda m, d: (d.mkdir(), (d / "manifest.json").write_text('{"name": "mine"}')),
        ["--format", "int8", "--overwrite"],
        "holds a manifest.json that is not a moetune store manifest",
    ),
    "int4 group size not allowed": (
        lambda m, d: None,
        ["--format", "int4", "--group-size", "48"],
        "allowed: 32, 64",
    ),
}


@pytest.mark.parametrize("case", CONVERT_CASES)
def test_convert_misuse_is_refused_before_reading_and_changes_nothing(
    case, model_dir, tmp_path, monkeypatch, capsys
):
    prepare, args, match = CONVERT_CASES[case]
    dst = tmp_path / "dst"
    prepare(model_dir, dst)
    capsys.readouterr()
    before = tree_hash(tmp_path)

    def forbidden(*a, **k):
        raise AssertionError("expert weights were read before the error was raised")

    monkeypatch.setattr("moetune.loading.convert.stream_experts", forbidden)
    assert _convert(model_dir, dst, *args) == 2
    assert re.search(match, capsys.readouterr().err)
    assert tree_hash(tmp_path) == before


def test_convert_to_auto_format_is_refused(model_dir, tmp_path):
    from moetune.loading.convert import convert_checkpoint

    with pytest.raises(ConfigError, match="a store needs an explicit expert format"):
        convert_checkpoint(model_dir, tmp_path / "dst", "auto")
    assert not any(tmp_path.iterdir())


# ---- NaN/Inf expert weights: refused by file, tensor, layer and expert, in every format, nothing written

BAD_KEY = "model.layers.2.mlp.experts.5.up_proj.weight"


@pytest.fixture(scope="module", params=[float("nan"), float("inf")], ids=["nan", "inf"])
def poisoned(request, model_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("poisoned") / "model"
    shutil.copytree(model_dir, path)
    _weights(_poison(BAD_KEY, request.param), "model.safetensors")(path)  # one value of one expert's tensor
    return path


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8", "mxfp4", "bf16"])
def test_convert_refuses_non_finite_source_weights_in_every_format(fmt, poisoned, tmp_path, capsys):
    before = tree_hash(tmp_path)
    extra = ["--group-size", "32"] if fmt == "int4" else []
    assert _convert(poisoned, tmp_path / "dst", "--format", fmt, *extra) == 2
    err = capsys.readouterr().err
    assert f"{BAD_KEY} in model.safetensors" in err and "model.layers.2.mlp.experts (expert 5)" in err
    assert tree_hash(tmp_path) == before  # no store, no staging folder left


def test_load_refuses_non_finite_expert_weights_by_name(poisoned):
    with pytest.raises(NonFiniteWeightError, match=rf"model.layers.2.mlp.experts \(expert 5\) .*{BAD_KEY}"):
        moetune.load_model(poisoned, device="cpu", dtype="float32", progress=False)
    assert issubclass(NonFiniteWeightError, MoetuneError)
