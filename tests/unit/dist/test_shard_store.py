"""``expert_parallel: sharded`` over moetune's own stores (``expert_path``, written by ``moetune convert``): a
rank's engine holds exactly the bytes of the whole store engine's experts ``[r E/w, (r+1) E/w)`` (every store
format, biases included), and the rank read nothing else of the store's files.

"Nothing else read" is shown three ways: the whole-file passes (``MappedFile.sha256``, whole-file ``populate``)
never run, every range the rank brings in lies inside its experts' bytes, and a copy of the store whose other
experts' bytes are overwritten with garbage loads the same engine without complaint; one altered byte inside
the rank's share fails its per-expert hash, naming the file."""

from __future__ import annotations

import json
import logging
import mmap
import shutil
from pathlib import Path

import pytest
import torch

from moetune.config.experts import ExpertResidency
from moetune.dist.shard import ExpertShard
from moetune.engine import ExpertEngine
from moetune.engine.formats import dense
from moetune.engine.residency import PagedExperts
from moetune.errors import ConfigError, LoadError
from moetune.loading.convert import convert_checkpoint
from moetune.loading.load import PlannedLoad, plan_load, shard_slices
from moetune.loading.options import LoadOptions
from moetune.store import ExpertStore, store_engines
from moetune.store.manifest import MANIFEST, StoredLayer
from moetune.store.mapped import MappedFile
from moetune.tensorfile import read_header
from moetune.testing.tiny import save_tiny_model
from tests.unit.dist.test_shard_quantized import _assert_holds_slice
from tests.unit.engine_cases import make_routing

# store label -> (tiny family, convert's expert_format, the engine format held); I = 32 for int4/mxfp4 groups
STORES = {
    "int8": ("qwen3_moe", "int8", "int8"),
    "int4": ("qwen3_moe", "int4", "int4"),
    "fp8_block": ("qwen3_moe", "fp8", "fp8_block"),
    "mxfp4": ("qwen3_moe", "mxfp4", "mxfp4"),
    "bf16": ("qwen3_moe", "bf16", "dense"),
    "bf16_padded": (
        "qwen3_moe",
        "bf16",
        "dense",
    ),  # rows one line apart (forced onto H = 64 and I = 32 at convert)
    "int8_biases": ("gpt_oss", "int8", "int8"),  # fused gate_up / down biases stored beside the weights
}
OVERRIDES = {"qwen3_moe": {"moe_intermediate_size": 32}, "gpt_oss": {"intermediate_size": 32}}


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("stores")
    sources = {
        family: save_tiny_model(family, root / family, tokenizer=False, **OVERRIDES[family])
        for family in {family for family, *_ in STORES.values()}
    }
    out = {}
    for label, (family, fmt, _) in STORES.items():
        group = 32 if fmt == "int4" else None  # divides H = 64 and I = 32
        with pytest.MonkeyPatch.context() as m:
            if (
                label == "bf16_padded"
            ):  # bf16 rows of a multiple of 64 bytes (H = 64, I = 32) padded by a line
                m.setattr(dense, "ALIAS_BYTES", 64)
            convert_checkpoint(
                sources[family], root / label, fmt, int4_group_size=group, num_threads=1, progress=False
            )
        out[label] = (sources[family], root / label)
    return out


def _planned(src: Path) -> tuple[PlannedLoad, LoadOptions]:
    opts = LoadOptions.create(device="cpu", dtype="float32", progress=False)
    return plan_load(src, opts), opts


def _engines(
    store: Path, planned: PlannedLoad, opts: LoadOptions, share: list[range] | None
) -> list[ExpertEngine]:
    sites = [layer.site for layer in planned.plan.layers]
    return list(
        store_engines(ExpertStore.open(store), sites, opts.dtype, opts.engine, progress=False, experts=share)
    )


def _share_spans(path: Path, num_experts: int, held: range) -> list[tuple[int, int]]:
    """Byte ranges ``[start, end)`` of ``path`` holding experts ``held`` (every tensor leads with E)."""
    spans = []
    for info in read_header(path).values():
        per = info.nbytes // num_experts
        spans.append((info.offset + held.start * per, info.offset + held.stop * per))
    return spans


def _scramble_others(store: Path, planned: PlannedLoad, held: list[range]) -> None:
    """Overwrite every expert byte outside ``held`` in the store's layer files with 0xA5 (the manifest kept)."""
    manifest = json.loads((store / MANIFEST).read_text())
    files = {layer["module"]: store / layer["file"] for layer in manifest["layers"]}
    for layer, share in zip(planned.plan.layers, held):
        path, e = files[layer.site.path], layer.site.layout.num_experts
        data = bytearray(path.read_bytes())
        for info in read_header(path).values():
            per = info.nbytes // e
            for j in [*range(share.start), *range(share.stop, e)]:
                start = info.offset + j * per
                data[start : start + per] = b"\xa5" * per
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("label", list(STORES))
@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_reads_and_holds_only_its_experts_of_a_store(
    stores, label, world, tmp_path, monkeypatch
) -> None:
    src, store = stores[label]
    planned, opts = _planned(src)
    native = STORES[label][2]
    whole = _engines(store, planned, opts, None)
    assert all(engine.weights.name == native for engine in whole)
    if label == "int8_biases":
        assert all(engine.gate_up_bias is not None and engine.down_bias is not None for engine in whole)
    pad = (
        32 if label == "bf16_padded" else 0
    )  # the store's rows, read under today's rule (which pads none here)
    for engine in whole if native == "dense" else []:
        assert (engine.weights.gate_up.stride(1), engine.weights.down.stride(1)) == (64 + pad, 32 + pad)

    populated: list[tuple[Path, int, int]] = []
    real_populate = MappedFile.populate

    def recording_populate(self: MappedFile, view: torch.Tensor | None = None) -> None:
        assert view is not None, f"{self.path} brought in whole"
        start = view.data_ptr() - self.address
        populated.append((self.path, start, start + view.numel() * view.element_size()))
        real_populate(self, view)

    def no_whole_hash(self: MappedFile) -> str:
        raise AssertionError(f"{self.path} hashed whole by a rank")

    for r in range(world):
        held = shard_slices(ExpertShard(r, world, None), planned)
        assert held is not None
        layer_files = {layer.module: store / layer.file for layer in ExpertStore.open(store).manifest.layers}
        # the rank's share, from the store as written
        with monkeypatch.context() as m:
            m.setattr(MappedFile, "sha256", no_whole_hash)
            mine = _engines(store, planned, opts, held)
        for engine, full, share in zip(mine, whole, held):
            assert share == range(r * full.num_experts // world, (r + 1) * full.num_experts // world)
            _assert_holds_slice(engine, full, share, native)
            assert engine.weights.nbytes * world == full.weights.nbytes

        # from a copy whose other experts are garbage: the same bytes, and every page brought in is the rank's
        scrambled = tmp_path / f"rank{r}"
        shutil.copytree(store, scrambled)
        _scramble_others(scrambled, planned, held)
        populated.clear()
        with monkeypatch.context() as m:
            m.setattr(MappedFile, "sha256", no_whole_hash)
            m.setattr(MappedFile, "populate", recording_populate)
            manifest = json.loads((scrambled / MANIFEST).read_text())
            for f in manifest["files"].values():  # an older store: no per-expert hashes, pages populated
                del f["experts_sha256"]
            (scrambled / MANIFEST).write_text(json.dumps(manifest))
            old = _engines(scrambled, planned, opts, held)
        assert populated
        for path, start, end in populated:
            layer = next(
                layer
                for layer in planned.plan.layers
                if scrambled / layer_files[layer.site.path].name == path
            )
            share = held[planned.plan.layers.index(layer)]
            spans = _share_spans(path, layer.site.layout.num_experts, share)
            assert any(s <= start and end <= e for s, e in spans), (path, start, end, spans)
        for engine, full, share in zip(old, whole, held):
            _assert_holds_slice(engine, full, share, native)
        shutil.copy(store / MANIFEST, scrambled / MANIFEST)  # per-expert hashes back: the rank's verify
        for engine, full, share in zip(_engines(scrambled, planned, opts, held), whole, held):
            _assert_holds_slice(engine, full, share, native)
        # the whole file no longer matches
        with pytest.raises(LoadError, match="was altered after conversion"):
            ExpertStore.open(scrambled).verify()


def _flip_a_byte_of(store: Path, copy: Path, share: range, at: int) -> tuple[Path, StoredLayer]:
    """A copy of ``store`` with byte ``at`` of ``share``'s rows of the first tensor of the first layer flipped."""
    shutil.copytree(store, copy)
    first = ExpertStore.open(copy).manifest.layers[0]
    path = copy / first.file
    start, _ = _share_spans(path, first.num_experts, share)[0]
    data = bytearray(path.read_bytes())
    data[start + at] ^= 0x01
    path.write_bytes(bytes(data))
    return copy, first


def test_an_altered_byte_in_a_share_fails_its_hash_and_an_older_store_warns(stores, tmp_path, caplog) -> None:
    src, store = stores["int8"]
    planned, opts = _planned(src)
    held = shard_slices(ExpertShard(1, 2, None), planned)
    assert held is not None
    copy, first = _flip_a_byte_of(store, tmp_path / "store", held[0], 3)
    path = copy / first.file
    e0 = held[0].start
    with pytest.raises(LoadError, match=rf"{first.file}.*expert\(s\) \[{e0}\] of {first.module}"):
        _engines(copy, planned, opts, held)
    # rank 0 does not hold that expert: it loads, unaware of the altered byte
    assert len(_engines(copy, planned, opts, shard_slices(ExpertShard(0, 2, None), planned))) == len(held)

    manifest = json.loads((store / MANIFEST).read_text())
    for f in manifest["files"].values():
        del f["experts_sha256"]
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="moetune.store.files"):
        _engines(copy, planned, opts, held)
    assert f"{path} has no per-expert SHA-256" in caplog.text and "used unverified" in caplog.text


def test_config_accepts_a_sharded_store_in_ram_and_on_disk() -> None:
    opts = LoadOptions.create(expert_parallel="sharded", expert_path="/s")
    assert opts.experts.expert_path == Path("/s")
    disk = LoadOptions.create(expert_parallel="sharded", expert_path="/s", expert_residency="disk")
    assert disk.experts.expert_residency is ExpertResidency.DISK


def _run(engines: list[ExpertEngine], seed: int) -> list[torch.Tensor]:
    """Every layer forward, then backward, as a model runs them (routing to the engine's own experts):
    outputs, input and routing-weight gradients."""
    first = engines[0]
    x, ids, w = make_routing(
        T=12, E=first.num_experts, k=2, H=first.hidden_size, dtype=torch.float32, seed=seed
    )
    saved = []
    for engine in engines:
        x, s = engine.forward(x, ids, w)
        saved.append(s)
    out, grad = [x], torch.ones_like(x)
    for engine, s in zip(reversed(engines), reversed(saved)):
        grads = engine.backward(s, grad)
        grad = grads.x
        out += [grads.x, grads.topk_weights]
    return out


@pytest.mark.parametrize("label", ["int8", "fp8_block", "int8_biases", "bf16_padded"])
def test_a_rank_pages_only_its_experts_from_disk(stores, label, tmp_path, monkeypatch, one_thread) -> None:
    """``expert_residency: disk`` with a rank's share: the paged engines hold the whole engine's rows of the rank's
    experts byte for byte and compute what the rank's engines in RAM compute, bit for bit; the pager brings in
    and releases nothing but ranges inside the rank's experts' bytes, never hashes a file whole, and a copy of the
    store whose other experts' bytes are garbage pages the same engines (verified by their per-expert hashes)."""
    src, store = stores[label]
    planned, opts = _planned(src)
    native = STORES[label][2]
    sites = [layer.site for layer in planned.plan.layers]
    whole = _engines(store, planned, opts, None)
    touched: list[tuple[str, Path, int, int]] = []
    real_populate, real_release = MappedFile.populate, MappedFile.release

    def recording_populate(self: MappedFile, view: torch.Tensor | None = None) -> None:
        assert view is not None, f"{self.path} brought in whole"
        touched.append(("populate", self.path, *self.span(view)))
        real_populate(self, view)

    def recording_release(self: MappedFile, views: list[torch.Tensor] | None = None) -> None:
        assert views is not None, f"{self.path} dropped from the page cache whole"
        touched.extend(("release", self.path, *self.span(v)) for v in views)
        real_release(self, views)

    def no_whole_hash(self: MappedFile) -> str:
        raise AssertionError(f"{self.path} hashed whole by a rank")

    world = 2
    for r in range(world):
        held = shard_slices(ExpertShard(r, world, None), planned)
        assert held is not None
        ram = _engines(store, planned, opts, held)
        scrambled = tmp_path / f"rank{r}"
        shutil.copytree(store, scrambled)
        _scramble_others(scrambled, planned, held)
        files = {
            layer.module: scrambled / layer.file for layer in ExpertStore.open(scrambled).manifest.layers
        }
        touched.clear()
        with monkeypatch.context() as m:
            m.setattr(MappedFile, "sha256", no_whole_hash)
            m.setattr(MappedFile, "populate", recording_populate)
            m.setattr(MappedFile, "release", recording_release)
            opened = ExpertStore.open(scrambled)
            paged = list(
                store_engines(
                    opened, sites, opts.dtype, opts.engine, ExpertResidency.DISK, progress=False, experts=held
                )
            )
            for engine, full, share in zip(paged, whole, held):
                assert isinstance(engine.weights, PagedExperts)
                _assert_holds_slice(engine, full, share, native)
            window = paged[0].weights.window
            # the default budget: the two largest of this rank's shares (page-rounded), not whole files
            shares = sorted(opened.share_resident_bytes(s.path, h) for s, h in zip(sites, held))
            assert (
                window.budget
                == sum(shares[-2:])
                < 2 * max(opened.layer_resident_bytes(s.path) for s in sites)
            )
            for seed in (1, 2):  # closing releases every layer: the second pass pages them in again, unhashed
                got = _run(paged, seed)
                want = _run(ram, seed)
                assert all(torch.equal(a, b) for a, b in zip(got, want))
                window.close()
        assert window.stats.misses >= 1 and window.stats.hits >= 1
        assert {kind for kind, *_ in touched} == {"populate", "release"}
        for kind, path, start, end in touched:
            module = next(mod for mod, f in files.items() if f == path)
            share = held[[s.path for s in sites].index(module)]
            spans = _share_spans(path, opened.layers[module].num_experts, share)
            # whole pages around one of the rank's tensor rows
            assert any(
                s - s % mmap.PAGESIZE <= start and end <= -(-e // mmap.PAGESIZE) * mmap.PAGESIZE
                for s, e in spans
            ), (
                kind,
                path,
                start,
                end,
                spans,
            )
        # the whole file no longer matches
        with pytest.raises(LoadError, match="was altered after conversion"):
            ExpertStore.open(scrambled).verify()


def test_disk_residency_checks_a_share_when_it_pages_it_in_and_budgets_per_rank(stores, tmp_path) -> None:
    src, store = stores["int8"]
    planned, opts = _planned(src)
    sites = [layer.site for layer in planned.plan.layers]
    held = shard_slices(ExpertShard(1, 2, None), planned)
    assert held is not None
    copy, first = _flip_a_byte_of(store, tmp_path / "store", held[0], 5)
    opened = ExpertStore.open(copy)
    # loading reads nothing of the weights: the altered byte surfaces when the layer is paged in
    paged = list(
        store_engines(
            opened, sites, opts.dtype, opts.engine, ExpertResidency.DISK, progress=False, experts=held
        )
    )
    e0 = held[0].start
    with pytest.raises(LoadError, match=rf"{first.file}.*expert\(s\) \[{e0}\] of {first.module}"):
        _run(paged, 1)
    paged[0].weights.window.close()
    # rank 0 does not hold that expert: it pages its share in without complaint
    mine = shard_slices(ExpertShard(0, 2, None), planned)
    rank0 = list(
        store_engines(
            opened, sites, opts.dtype, opts.engine, ExpertResidency.DISK, progress=False, experts=mine
        )
    )
    _run(rank0, 1)
    rank0[0].weights.window.close()

    # a budget under two of this rank's shares is refused naming them; one holding them (less than two whole
    # layers) is accepted
    need = sum(sorted(opened.share_resident_bytes(s.path, h) for s, h in zip(sites, held))[-2:])
    whole = sum(sorted(opened.layer_resident_bytes(s.path) for s in sites)[-2:])
    assert need < whole
    with pytest.raises(
        ConfigError,
        match=rf"expert_residency_budget {need - 1} bytes .*this process's experts.*at least {need}",
    ):
        next(
            store_engines(
                opened,
                sites,
                opts.dtype,
                opts.engine,
                ExpertResidency.DISK,
                need - 1,
                progress=False,
                experts=held,
            )
        )
    engines = list(
        store_engines(
            opened, sites, opts.dtype, opts.engine, ExpertResidency.DISK, need, progress=False, experts=mine
        )
    )
    assert engines[0].weights.window.budget == need


def test_a_manifest_with_the_wrong_number_of_expert_hashes_is_refused(stores, tmp_path) -> None:
    _, store = stores["int8"]
    copy = tmp_path / "store"
    shutil.copytree(store, copy)
    manifest = json.loads((copy / MANIFEST).read_text())
    name = next(iter(manifest["files"]))
    manifest["files"][name]["experts_sha256"].pop()
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(
        LoadError, match=rf"{name} does not match {MANIFEST}: 'experts_sha256' lists 7 hashes"
    ):
        ExpertStore.open(copy)


def test_the_convert_line_names_the_store_format_and_options() -> None:
    """The hints that ask for a store to be written again give a command that runs (--format was missing)."""
    from moetune.store.manifest import Manifest, SourceIdentity

    def line(fmt: str, params: dict) -> str:
        source = SourceIdentity.__new__(SourceIdentity)
        manifest = Manifest("qwen3_moe", fmt, params, source, (), {})
        return manifest.convert_line("SRC", "DST")

    assert line("int4", {"group_size": 32, "symmetric": False}) == (
        "moetune convert SRC DST --format int4 --group-size 32 --asymmetric --overwrite"
    )
    assert line("int4", {"group_size": 64, "symmetric": True}) == "moetune convert SRC DST --format int4 --group-size 64 --overwrite"
    assert line("fp8_block", {}) == "moetune convert SRC DST --format fp8 --overwrite"
    assert line("dense", {}) == "moetune convert SRC DST --format bf16 --overwrite"
