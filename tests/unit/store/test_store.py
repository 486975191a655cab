"""Format serialization (``state_tensors`` / ``from_state_tensors``) and expert stores: writing, memory-mapped
reading without copies, atomic conversion, and every manifest failure as a ``LoadError`` naming the file.

Stores here are written from formats built directly (the shared battery's Gaussian layers); the convert ->
load round trip through a real checkpoint is in tests/integration/test_convert.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moetune.arch import ExpertsSite
from moetune.arch.detect import ExpertsLayout
from moetune.bench.runners import as_loaded
from moetune.config import parse_config
from moetune.engine.formats import FORMATS, DenseExperts, ExpertFormat, dense
from moetune.errors import ConfigError, EngineError, LoadError
from moetune.store import files
from moetune.store.destination import staging_paths
from moetune.store.files import ExpertStore, StoreWriter
from moetune.store.manifest import MANIFEST, SourceIdentity
from moetune.tensorfile import read_header
from moetune.testing.memory import mapped_usage, rss_anon
from tests.unit.config.test_config import minimal, problems_of, workdir  # noqa: F401  (workdir: a fixture)
from tests.unit.engine.test_formats import CASES, E, H, I, case_params, gaussian

SOURCE = SourceIdentity("/ckpt", "c0nf1g", (("model.safetensors", 1234),), "f1ngerpr1nt")
MODULES = [f"model.layers.{n}.mlp.experts" for n in range(3)]


def _site(path: str, e: int = E, h: int = H, i: int = I, bias: bool = True) -> ExpertsSite:
    return ExpertsSite(path, ExpertsLayout(e, h, i, False, False, bias, "silu"), None)


def _write(
    root: Path,
    case=CASES[1],
    layers=MODULES,
    bias: bool = True,
    fail_after: int | None = None,
    build: Callable[[int], ExpertFormat] | None = None,
) -> Path:
    """A store of ``case``'s format, one Gaussian layer per module (seed = its index), biases included; ``build``:
    the layer of each index instead (``_dense_layer``)."""
    writer = StoreWriter.prepare(root)
    writer.begin()
    for n, module in enumerate(layers):
        if n == fail_after:
            raise RuntimeError("injected failure mid-conversion")
        gen = torch.Generator().manual_seed(100 + n)
        biases = (
            (torch.randn(E, 2 * I, generator=gen), torch.randn(E, H, generator=gen)) if bias else (None, None)
        )
        writer.add(module, case.build(*gaussian(seed=n)) if build is None else build(n), *biases)
    writer.finish("qwen3_moe", SOURCE)
    return root


def _build(store: ExpertStore, module: str):
    return store.build(module, store.map_layer(module))


# ---- serialization: one implementation for every format


@case_params
def test_state_tensors_round_trip_without_copies(case):
    fmt = case.build(*gaussian())
    tensors = fmt.state_tensors()
    assert set(tensors) <= set(type(fmt).STATE_FIELDS) and {"gate_up", "down"} <= set(tensors)
    again = FORMATS.get(case.format).from_state_tensors(tensors, **fmt.params())
    assert type(again) is type(fmt) and again.params() == fmt.params() == json.loads(json.dumps(fmt.params()))
    for name, t in again.state_tensors().items():
        assert t.data_ptr() == tensors[name].data_ptr(), name  # the very tensors, not copies
    for a, b in zip(again.dequantize(), fmt.dequantize()):
        assert torch.equal(a, b)


@case_params
def test_store_round_trip_is_bit_exact(case, tmp_path):
    store = ExpertStore.open(_write(tmp_path / "s", case))
    for n, module in enumerate(MODULES):
        fmt, gate_up_bias, down_bias = _build(store, module)
        want = case.build(*gaussian(seed=n))
        assert type(fmt) is type(want) and store.manifest.params == want.params()
        full = want.dequantize()
        for got, ref in zip(fmt.dequantize(), full):
            assert torch.equal(got, ref)
        for proj, ref in zip(("gate_up", "down"), full):
            buf = torch.empty(fmt.shape(proj)) if fmt.needs_buffer(torch.float32) else None
            assert torch.equal(fmt.tile(proj, E - 1, torch.float32, buf), ref[E - 1])
        gen = torch.Generator().manual_seed(100 + n)
        assert torch.equal(gate_up_bias, torch.randn(E, 2 * I, generator=gen))
        assert torch.equal(down_bias, torch.randn(E, H, generator=gen))


def test_from_state_tensors_names_what_is_wrong():
    fmt = FORMATS.get("int4").from_dense(*gaussian(), group_size=64)
    tensors = fmt.state_tensors()
    with pytest.raises(
        EngineError, match=r"unknown parameter\(s\) \['bits'\] \(allowed: \['group_size', 'symmetric'\]"
    ):
        type(fmt).from_state_tensors(tensors, bits=4, **fmt.params())
    with pytest.raises(EngineError, match=r"unknown tensor\(s\) \['extra'\]"):
        type(fmt).from_state_tensors({**tensors, "extra": tensors["down"]}, **fmt.params())
    with pytest.raises(
        EngineError, match=r"missing tensor\(s\) \['down_scale'\]; missing parameter\(s\) \['group_size'\]"
    ):
        type(fmt).from_state_tensors({k: v for k, v in tensors.items() if k != "down_scale"})
    with pytest.raises(
        EngineError, match=r"parameters \{'symmetric': False\} disagree with the tensors.*'symmetric': True"
    ):
        type(fmt).from_state_tensors(tensors, group_size=64, symmetric=False)
    with pytest.raises(EngineError, match=r"gate_up_scale must be torch.bfloat16"):
        type(fmt).from_state_tensors(
            {**tensors, "gate_up_scale": tensors["gate_up_scale"].float()}, group_size=64
        )


# ---- memory mapping


def test_reading_maps_the_file_and_copies_nothing(tmp_path):
    """The format's tensors point into the file's mapping; reading every byte makes the mapping resident as
    file pages, with no anonymous (copied) pages and no growth of the process's anonymous memory."""
    gate_up, down = gaussian(e=8, h=512, i=512)  # fp32: a 25 MB file, far above the allocator's noise
    root = tmp_path / "s"
    writer = StoreWriter.prepare(root)
    writer.begin()
    writer.add(MODULES[0], DenseExperts(gate_up, down), torch.randn(8, 1024), torch.randn(8, 512))
    writer.finish("qwen3_moe", SOURCE)
    store = ExpertStore.open(root)
    size = store.layer_nbytes(MODULES[0])
    before = rss_anon()
    mapped = store.map_layer(MODULES[0])
    store.verify_mapped(mapped)  # SHA-256 through the mapping: reads every byte
    fmt, bias, _ = store.build(MODULES[0], mapped)
    usage = mapped_usage(root)
    grew = rss_anon() - before
    for t in (*fmt.state_tensors().values(), bias):
        assert usage.contains(t.data_ptr()) and usage.contains(t.data_ptr() + t.nbytes - 1)
    assert usage.rss >= size - 4096 and usage.anonymous == 0
    assert grew < size // 8, (grew, size)  # a copy would add the whole file as anonymous memory
    mapped.release()
    assert mapped_usage(root).rss == 0
    assert torch.equal(fmt.tile("down", 7, torch.float32, None), down[7])  # paged in again from the file


# ---- layout in memory: data on a page, dense rows as the engine holds them


@case_params
def test_each_file_starts_its_data_on_a_page_and_stock_safetensors_reads_it(case, tmp_path):
    """The data section starts at ``DATA_ALIGN`` (the mapping starts on a page, so do the first weights), the
    weights (gate_up, down) first and on 64-byte lines, the scales and biases after them; safetensors' own loader
    reads the same tensors."""
    store = ExpertStore.open(_write(tmp_path / "s", case))
    for module in MODULES:
        path = store.root / store.layers[module].file
        infos = sorted(read_header(path).values(), key=lambda info: info.offset)
        assert infos[0].offset % files.DATA_ALIGN == 0, infos
        assert {i.key for i in infos[:2]} == {"gate_up", "down"} and infos[1].offset % 64 == 0, infos
        fmt, gate_up_bias, down_bias = _build(store, module)
        stock = load_file(str(path))
        held = {**fmt.state_tensors(), "gate_up_bias": gate_up_bias, "down_bias": down_bias}
        assert stock.keys() == held.keys()
        for name, t in stock.items():
            assert torch.equal(t.view(torch.uint8), held[name].contiguous().view(torch.uint8)), name


def _dense_layer(seed: int = 0) -> DenseExperts:
    """bf16 dense experts in the engine's layout (``DenseExperts.empty``)."""
    return DenseExperts(*as_loaded(*(t.bfloat16() for t in gaussian(seed=seed))))


def test_padded_dense_rows_are_stored_padded_and_mapped_as_they_are(tmp_path, monkeypatch):
    """bf16 rows the engine pads (forced onto H = 256 and I = 128 here: bf16 rows whose bytes are a multiple of 256)
    are written with their padding (zeros), and the store's experts are views of the mapping with the same row
    strides: nothing copied, nothing laid out anew."""
    monkeypatch.setattr(dense, "ALIAS_BYTES", 256)
    store = ExpertStore.open(_write(tmp_path / "s", bias=False, build=_dense_layer))
    want = [_dense_layer(seed=n) for n in range(len(MODULES))]
    for module, ref in zip(MODULES, want):
        mapped = store.map_layer(module)
        stored = load_file(str(mapped.path))
        assert stored["gate_up"].shape == (E, 2 * I, H + 32) and stored["down"].shape == (E, H, I + 32)
        assert (
            torch.count_nonzero(stored["gate_up"][:, :, H:])
            == torch.count_nonzero(stored["down"][:, :, I:])
            == 0
        )
        fmt, _, _ = store.build(module, mapped)
        assert isinstance(fmt, DenseExperts)
        assert fmt.gate_up.stride(1) == H + 32 and fmt.down.stride(1) == I + 32
        assert fmt.gate_up.data_ptr() == mapped.tensors["gate_up"].data_ptr()  # a view of the mapping
        assert torch.equal(fmt.gate_up, ref.gate_up) and torch.equal(fmt.down, ref.down)


def test_a_dense_store_with_contiguous_rows_still_loads(tmp_path, monkeypatch):
    """A store whose dense rows were written contiguous (before padding, or by a build that does not pad them)
    loads as it is where the engine would pad them: contiguous views of the mapping."""
    root = _write(tmp_path / "s", layers=MODULES[:1], bias=False, build=_dense_layer)
    monkeypatch.setattr(dense, "ALIAS_BYTES", 256)
    store = ExpertStore.open(root)
    fmt, _, _ = _build(store, MODULES[0])
    assert isinstance(fmt, DenseExperts) and fmt.gate_up.is_contiguous() and fmt.down.is_contiguous()
    gate_up, down = gaussian()
    assert torch.equal(fmt.gate_up, gate_up.bfloat16()) and torch.equal(fmt.down, down.bfloat16())


def test_stored_dense_rows_of_another_length_fail_the_build_naming_the_file(tmp_path, monkeypatch):
    wide = torch.zeros(E, 2 * I, H + 40, dtype=torch.bfloat16)  # more than a line of padding
    monkeypatch.setattr(DenseExperts, "state_tensors", lambda self: {"gate_up": wide, "down": self.down})
    _write(tmp_path / "s", layers=MODULES[:1], bias=False, build=_dense_layer)
    path = tmp_path / "s" / f"{MODULES[0]}.safetensors"
    with pytest.raises(
        LoadError, match=rf"{path} does not hold valid dense experts: .*rows of {H + 40} values"
    ):
        _build(ExpertStore.open(tmp_path / "s"), MODULES[0])


def _write_dense(root: Path, layers: list[str]) -> Path:
    return _write(root, layers=layers, bias=False, build=_dense_layer)


def _stale_warnings(caplog, roots: list[Path]) -> tuple[list[str], dict[Path, ExpertStore]]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moetune.store.files"):
        stores = {root: ExpertStore.open(root) for root in roots}
    return [r.getMessage() for r in caplog.records if "older moetune" in r.getMessage()], stores


def test_a_bf16_store_written_before_this_layout_loads_with_a_warning(tmp_path, monkeypatch, caplog):
    """bf16 files whose data section is off a cache line (safetensors' own 8-byte alignment, as stores were
    written before ``DATA_ALIGN``) still load, the same values, with a warning naming the store and the command
    that rewrites it (their manifests at format version 1, as older moetunes wrote them); so do bf16 rows the
    engine now pads stored contiguous. A store written now (version 2), and a quantized one off the lines (its
    steps measured level), get none."""
    # module names 8 bytes apart in length: so are the headers, and the data start at every multiple of 8 mod 64
    layers = [f"model.layers.{n}.mlp.experts{'_' * 8 * n}" for n in range(8)]
    monkeypatch.setattr(files, "DATA_ALIGN", 8)
    old, old_int8 = _write_dense(tmp_path / "old", layers), _write(tmp_path / "old-int8", layers=layers)

    def off_line(root: Path) -> int:
        return sum(
            min(i.offset for i in read_header(p).values()) % 64 != 0 for p in root.glob("*.safetensors")
        )

    assert 0 < off_line(old) < 8 and off_line(old_int8) > 0  # the premise: some files' data are off a line
    for root in (old, old_int8):  # as older moetunes wrote the manifest: format version 1
        manifest = json.loads((root / MANIFEST).read_text())
        manifest["moetune_store"] = 1
        (root / MANIFEST).write_text(json.dumps(manifest))
    monkeypatch.undo()
    new = _write_dense(tmp_path / "new", layers)
    assert off_line(new) == 0 and json.loads((new / MANIFEST).read_text())["moetune_store"] == 2
    warned, stores = _stale_warnings(caplog, [old, old_int8, new])
    assert len(warned) == 1 and str(old) in warned[0]
    assert (
        f"moetune convert /ckpt {old} --format bf16 --overwrite" in warned[0]  # its source, format: a command
        and f"{off_line(old)} of its 8 files" in warned[0]
    )
    for module in layers:
        a, b = (_build(stores[root], module)[0].dequantize() for root in (old, new))
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    monkeypatch.setattr(dense, "ALIAS_BYTES", 256)  # now the engine pads the tiny rows: new's are contiguous
    warned, _ = _stale_warnings(caplog, [new, _write_dense(tmp_path / "padded", layers)])
    assert len(warned) == 1 and f"store {new} was" in warned[0] and "8 of its 8 files" in warned[0]


# ---- writing: atomic, refusing to clobber


def test_interrupted_write_leaves_the_destination_alone_and_a_rerun_succeeds(tmp_path):
    root = tmp_path / "s"
    with pytest.raises(RuntimeError, match="injected"):  # as a kill -9 would: the writer never cleans up
        _write(root, fail_after=2)
    staging, _ = staging_paths(root)
    assert not root.exists() and (staging / f"{MODULES[1]}.safetensors").exists()
    with pytest.raises(LoadError, match=rf"{root} does not exist .* did not finish .*{staging.name}"):
        ExpertStore.open(root)
    ExpertStore.open(_write(root))  # no --overwrite needed: an unfinished store is not a store
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]  # the leftover was removed


def test_a_finished_store_is_refused_unless_overwritten_and_stays_whole_until_replaced(tmp_path):
    root = _write(tmp_path / "s")
    before = {p.name: p.read_bytes() for p in root.iterdir()}
    with pytest.raises(ConfigError, match=rf"{root} already holds a converted store .* --overwrite"):
        StoreWriter.prepare(root)
    writer = StoreWriter.prepare(root, overwrite=True)
    writer.begin()
    writer.add(MODULES[0], CASES[1].build(*gaussian(seed=9)))
    assert {p.name: p.read_bytes() for p in root.iterdir()} == before  # the old store until the new is whole
    writer.finish("qwen3_moe", SOURCE)
    assert [layer.module for layer in ExpertStore.open(root).manifest.layers] == [MODULES[0]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_a_kill_between_the_two_renames_is_undone_by_the_next_run(tmp_path):
    root = _write(tmp_path / "s")
    staging, aside = staging_paths(root)
    root.rename(aside)  # the state replace_folder passes through: old store aside, new one staged
    staging.mkdir()
    with pytest.raises(LoadError, match=rf"previous store is in {aside}"):
        ExpertStore.open(root)
    StoreWriter.prepare(root, overwrite=True)  # restores the old store first
    assert ExpertStore.open(root).manifest.layers and not aside.exists() and not staging.exists()


@pytest.mark.parametrize(
    "name", ["model.safetensors", "config.json", "notes.txt", f"{MODULES[0]}.safetensors"]
)
def test_a_directory_with_files_convert_did_not_write_is_refused_and_kept(tmp_path, name):
    (tmp_path / name).write_bytes(b"a user's own file")
    with pytest.raises(ConfigError, match=rf"holds entries moetune convert did not write \({name}\)"):
        StoreWriter.prepare(tmp_path)
    assert (tmp_path / name).read_bytes() == b"a user's own file"
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="exists and is not a directory"):
        StoreWriter.prepare(tmp_path / "f")


def test_a_store_with_a_foreign_file_is_refused_even_with_overwrite(tmp_path):
    root = _write(tmp_path / "s")
    (root / "README.md").write_text("mine")
    with pytest.raises(ConfigError, match=r"is a moetune store but also holds .*\(README.md\)"):
        StoreWriter.prepare(root, overwrite=True)


def test_an_unfinished_store_of_an_older_moetune_is_replaced(tmp_path):
    root = _write(tmp_path / "s")
    (root / MANIFEST).unlink()  # older moetune wrote layer files into DST itself, the manifest last
    leftover = root / f"{MODULES[2]}.safetensors.tmp"
    leftover.write_bytes((root / f"{MODULES[2]}.safetensors").read_bytes()[:500])
    ExpertStore.open(_write(root))
    assert not leftover.exists()


@pytest.mark.parametrize("name", [f"{MODULES[2]}.safetensors.tmp", f"{MANIFEST}.tmp"])
def test_an_empty_temporary_of_an_older_moetune_does_not_block_a_rerun(tmp_path, name):
    """A writer killed right after creating its temporary leaves it empty: it holds nothing, so it neither blocks
    a rerun nor needs --overwrite (before, it was 'an entry convert did not write')."""
    root = _write(tmp_path / "s")
    for p in root.iterdir():
        p.unlink()
    (root / name).write_bytes(b"")
    ExpertStore.open(_write(root))
    assert not (root / name).exists()
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "notes.tmp").write_bytes(b"")  # an empty file of another name is still a user's
    with pytest.raises(ConfigError, match=r"did not write \(notes.tmp\)"):
        StoreWriter.prepare(tmp_path / "t")


# ---- every manifest failure: a LoadError naming the file


def test_missing_file(tmp_path):
    root = _write(tmp_path / "s")
    (root / f"{MODULES[1]}.safetensors").unlink()
    with pytest.raises(LoadError, match=rf"{root}/{MODULES[1]}.safetensors is missing"):
        ExpertStore.open(root)


def test_truncated_file(tmp_path):
    root = _write(tmp_path / "s")
    path = root / f"{MODULES[2]}.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(LoadError, match=rf"{path} is truncated: \d+ bytes, the manifest says \d+"):
        ExpertStore.open(root)


def test_altered_byte_fails_verification(tmp_path):
    root = _write(tmp_path / "s")
    path = root / f"{MODULES[1]}.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x01  # one bit of one code: the size and header still match
    path.write_bytes(bytes(data))
    store = ExpertStore.open(root)  # cheap checks pass
    _build(store, MODULES[0])
    with pytest.raises(LoadError, match=rf"{path} was altered after conversion: its SHA-256 is [0-9a-f]+"):
        store.verify()


def test_header_that_disagrees_with_the_manifest(tmp_path):
    root = _write(tmp_path / "s")
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["layers"][0]["bias"] = False
    manifest["layers"][1]["num_experts"] = E + 1
    (root / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(LoadError, match=rf"{MODULES[0]}.safetensors does not match {MANIFEST}: biases"):
        ExpertStore.open(root)
    manifest["layers"][0]["bias"] = True
    (root / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        LoadError,
        match=rf"{MODULES[1]}.safetensors does not match .* has {E} experts, the manifest says {E + 1}",
    ):
        ExpertStore.open(root)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda m: m.pop("layers"), r"field 'layers' is missing or malformed"),
        (lambda m: m["files"].clear(), r"layer file\(s\) \[.*\] have no size and SHA-256"),
        (lambda m: m.update(moetune_store=99), r"store format version 99; this moetune reads versions 1..2"),
        (
            lambda m: m.update(format="int3"),
            r"unknown expert weight format 'int3'; supported: dense, fp8_block",
        ),
        (lambda m: m["source"].update(files="x"), r"field 'source' is missing or malformed"),
    ],
)
def test_malformed_manifest(tmp_path, edit, match):
    root = _write(tmp_path / "s")
    manifest = json.loads((root / MANIFEST).read_text())
    edit(manifest)
    (root / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(LoadError, match=rf"{root / MANIFEST}.*{match}"):
        ExpertStore.open(root)


def test_params_the_tensors_contradict(tmp_path):
    root = _write(tmp_path / "s", next(c for c in CASES if c.id == "int4-g64-sym"), bias=False)
    manifest = json.loads((root / MANIFEST).read_text())
    manifest["params"]["group_size"] = 32
    (root / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        LoadError, match=rf"{MODULES[0]}.safetensors does not hold valid int4 experts: .*gate_up_scale"
    ):
        _build(ExpertStore.open(root), MODULES[0])


def _sites() -> list[ExpertsSite]:
    return [_site(m) for m in MODULES]


def test_a_matching_model_passes(tmp_path):
    ExpertStore.open(_write(tmp_path / "s")).check_model("qwen3_moe", _sites(), SOURCE, "int8")


def test_format_parameters_other_than_asked(tmp_path):
    root = _write(tmp_path / "s", next(c for c in CASES if c.id == "int4-g64-sym"))
    store = ExpertStore.open(root)
    store.check_model("qwen3_moe", _sites(), SOURCE, "int4", {"symmetric": True})
    with pytest.raises(
        LoadError,
        match=r"format parameters are \{'group_size': 64, 'symmetric': True\}, but \{'group_size': 32\}",
    ) as err:
        store.check_model("qwen3_moe", _sites(), SOURCE, "int4", {"group_size": 32, "symmetric": True})
    assert str(err.value).endswith("--format int4 --group-size 32 --overwrite")  # the options asked for


@pytest.mark.parametrize(
    "model_type,sites,source,fmt,match",
    [
        ("mixtral", None, SOURCE, None, r"model_type is 'qwen3_moe', the checkpoint's is 'mixtral'"),
        (None, None, SOURCE, "int4", r"format is 'int8', but expert_format 'int4' was asked for"),
        (
            None,
            [_site(m, e=E * 2) for m in MODULES],
            SOURCE,
            None,
            rf"{MODULES[0]}.safetensors: \(E, H, I, bias\) = \({E}, {H}, {I}, True\), the model's .* has \({2 * E}, ",
        ),
        (
            None,
            [_site(m, i=I // 2) for m in MODULES],
            SOURCE,
            None,
            r"the model's model.layers.2.mlp.experts has",
        ),
        (None, [_site(m, bias=False) for m in MODULES], SOURCE, None, r"True\), the model's .* False\)"),
        (
            None,
            _sites()[:2],
            SOURCE,
            None,
            r"experts for module\(s\) the model does not have: model.layers.2.mlp.experts",
        ),
        (
            None,
            [*_sites(), _site("model.layers.3.mlp.experts")],
            SOURCE,
            None,
            r"no experts for the model's module\(s\) model.layers.3",
        ),
        (
            None,
            None,
            replace(SOURCE, config_sha256="other"),
            None,
            r"config.json differs: it was converted from another checkpoint \(/ckpt\)",
        ),
        (
            None,
            None,
            replace(SOURCE, files=(("model.safetensors", 99),)),
            None,
            r"the safetensors files differ",
        ),
        (
            None,
            None,
            replace(SOURCE, fingerprint="other"),
            None,
            r"hold other bytes \(their first MiB differs\)",
        ),
    ],
)
def test_model_mismatch(tmp_path, model_type, sites, source, fmt, match):
    root = _write(tmp_path / "s")
    with pytest.raises(
        LoadError, match=rf"(?s)expert store {root} does not fit .*{MANIFEST}\):\n  .*{match}"
    ):
        ExpertStore.open(root).check_model(model_type or "qwen3_moe", sites or _sites(), source, fmt)


# ---- the YAML's `moetune:` section


@pytest.mark.usefixtures("workdir")
def test_yaml_store_options():
    engine = {"expert_path": "store", "expert_residency": "disk", "expert_residency_budget": "2GB"}
    cfg = parse_config(minimal(moetune=engine)).engine.experts  # parsed once: bytes, enum, path
    assert (cfg.expert_path, cfg.expert_residency, cfg.expert_residency_budget) == (
        Path("store"),
        "disk",
        2 * 10**9,
    )
    assert (
        parse_config(
            minimal(moetune={**engine, "expert_residency_budget": 4096})
        ).engine.experts.expert_residency_budget
        == 4096
    )
    text = problems_of(minimal(moetune={"expert_residency": "disk", "expert_format": "int3"}))
    assert "moetune.expert_residency: 'disk' pages experts from a converted store" in text
    assert "moetune.expert_format: got 'int3'" in text  # every problem at once
    text = problems_of(minimal(moetune={"expert_path": "s", "expert_residency_budget": "lots"}))
    assert "moetune.expert_residency_budget: got 'lots'; allowed: a positive number of bytes" in text
