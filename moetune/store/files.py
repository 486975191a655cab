"""Pre-quantized expert stores: one safetensors file per experts module plus ``manifest.json``.

Writing (``StoreWriter``) is atomic per file and for the store as a whole. Each layer goes to
``<module>.safetensors.tmp`` inside a staging folder beside the destination, is fsynced and renamed; the
manifest, with every file's size and SHA-256, is written the same way after the last layer, and then the
staging folder takes the destination's place whole (``destination``: which destinations are accepted, what a
kill leaves and how the next run recovers). A previous store stays loadable until the new one replaces it.

Reading (``ExpertStore``) memory-maps the files (``MappedFile``): a format's tensors are views of the
mapping, and nothing is copied. ``ExpertStore.open`` checks every file's presence, size and safetensors
header against the manifest. ``check_model`` compares the manifest with the model (model type, experts
modules, E/H/I, biases, format, the source checkpoint's identity). Both run before any weight is read, and
each problem is a ``LoadError`` naming the file.

SHA-256 verification reads every byte, which is far too slow to run as an extra pass over a terabyte store
at every load. So each file is hashed in the pass that reads it anyway, before its weights are used:
``ram`` residency hashes each file while loading (that pass is also what brings its pages into memory);
``disk`` residency hashes each file the first time the prefetcher reads it, during the first training step.
An altered byte then fails that load or that step with a ``LoadError`` naming the file. ``verify()`` checks
everything up front.

A rank of ``expert_parallel: sharded`` holds experts ``[r E/w, (r+1) E/w)`` of every layer: every tensor of a
layer's file leads with the expert dimension (``_check_file``), so its share is one contiguous byte range per
tensor, and ``build(..., experts)`` takes views of those ranges only. It verifies them against the manifest's
per-expert hashes (``experts_sha256``, which hash nothing but that expert's bytes); the other experts' bytes
are never read. A store written before those hashes existed is used unverified, with a warning per file.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from moetune.arch import ExpertsSite
from moetune.atomic import replace_folder, write_atomically
from moetune.engine.formats import FORMATS, ExpertFormat
from moetune.engine.formats.dense import row_stride
from moetune.errors import EngineError, LoadError, RegistryError, listing
from moetune.store.destination import SUFFIX, check_destination, recover, staging_paths, unfinished_note
from moetune.store.manifest import (
    CONVERT_FORMAT_HINT,
    MANIFEST,
    Manifest,
    SourceIdentity,
    StoredFile,
    StoredLayer,
)
from moetune.store.mapped import MappedFile, page_rounded
from moetune.tensorfile import TensorInfo, read_header, write_streamed

BIASES = ("gate_up_bias", "down_bias")  # [E, 2I], [E, H]: stored next to the format's tensors, in float
_READ_CHUNK = 64 << 20
# Where a store file's data section starts: on a page, as the mapping does. With safetensors' own 8-byte alignment a
# mapped store's weights sat 8-56 bytes off a 64-byte line and the kernels' 64-byte loads straddled two (engine steps
# on bf16 weights 8 bytes off a line: 1.03-1.19x slower; AMD EPYC Zen 4, docs/performance.md "Stores: weights on
# cache lines"). The data go largest first: the weights (whole lines for any model's shapes) before the scales and
# biases.
DATA_ALIGN = 4096
_LINE = 64  # a cache line


def _stale(fmt: str, layer: StoredLayer, tensors: Mapping[str, TensorInfo]) -> bool:
    """A dense bf16 file written before the layout above: its data section off a cache line, or rows that the
    engine pads stored contiguous (``DenseExperts.state_tensors``). Quantized formats' steps measured level on
    either layout (0.99-1.05x: their loads are narrower), so only dense files are reported."""
    infos = [tensors[k] for k in ("gate_up", "down") if k in tensors]
    if fmt != "dense" or len(infos) != 2 or any(i.dtype != "BF16" or len(i.shape) != 3 for i in infos):
        return False
    off_line = min(i.offset for i in tensors.values()) % _LINE != 0
    rows = zip(infos, (layer.hidden_size, layer.intermediate_size))
    unpadded = any(i.shape[2] == k != row_stride(k, torch.bfloat16) for i, k in rows)
    return off_line or unpadded


logger = logging.getLogger(__name__)


def experts_sha256(tensors: Mapping[str, torch.Tensor], experts: range) -> list[str]:
    """One hex SHA-256 per expert ``e`` in ``experts``: the bytes of ``tensors[k][e]`` for every tensor ``k``
    (all ``[E, ...]``, contiguous) in sorted key order. Reads those bytes only (a mapping's other pages stay
    untouched)."""
    names = sorted(tensors)
    out = []
    for e in experts:
        h = hashlib.sha256()
        for k in names:
            row = tensors[k][e].contiguous()  # a view already (rows of a contiguous [E, ...]): no copy
            h.update((ctypes.c_ubyte * (row.numel() * row.element_size())).from_address(row.data_ptr()))
        out.append(h.hexdigest())
    return out


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_READ_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class StoreWriter:
    """Writes a store into ``root``: ``prepare`` (checks only), ``begin``, ``add`` per layer, ``finish`` (or
    ``abort``). Everything is written into ``staging`` and moved to ``root`` whole by ``finish``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.staging, self.aside = staging_paths(root)
        self.layers: list[StoredLayer] = []
        self.files: dict[str, StoredFile] = {}
        self.format: tuple[str, dict[str, Any]] | None = None

    @classmethod
    def prepare(cls, dst: str | Path, *, overwrite: bool = False) -> StoreWriter:
        """Check that ``dst`` may be written, before any long work: ``ConfigError`` for a finished store
        (unless ``overwrite``), a file, or a directory holding anything moetune did not write there
        (``destination.check_destination``). First puts back what an interrupted conversion left (logged)."""
        root = Path(dst).expanduser()
        recover(root)
        check_destination(root, overwrite=overwrite)
        return cls(root)

    def begin(self) -> None:
        """Create the (empty) staging folder."""
        self.staging.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()

    def abort(self) -> None:
        """Remove the staging folder (a conversion that failed); ``root`` was never touched."""
        shutil.rmtree(self.staging, ignore_errors=True)

    def add(
        self,
        module: str,
        fmt: ExpertFormat,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        """Write experts module ``module``'s weights (and biases ``[E, 2I]`` / ``[E, H]``) as one file."""
        this = (fmt.name, fmt.params())
        assert self.format in (None, this), f"one format per store: {self.format} then {this}"
        self.format = this
        tensors = dict(fmt.state_tensors())
        for name, bias in zip(BIASES, (gate_up_bias, down_bias)):
            if bias is not None:
                tensors[name] = bias.detach()
        tensors = {k: t.contiguous() for k, t in tensors.items()}
        final = self.staging / f"{module}{SUFFIX}"
        metadata = {"moetune_store": "1", "module": module, "format": fmt.name}
        write_atomically(
            final, lambda tmp: write_streamed(tmp, tensors, metadata, align=DATA_ALIGN, largest_first=True)
        )
        per_expert = tuple(experts_sha256(tensors, range(fmt.num_experts)))
        self.files[final.name] = StoredFile(final.stat().st_size, file_sha256(final), per_expert)
        e, h, i = fmt.num_experts, fmt.hidden_size, fmt.intermediate_size
        self.layers.append(StoredLayer(module, final.name, e, h, i, gate_up_bias is not None))

    def finish(self, model_type: str, source: SourceIdentity) -> Manifest:
        """Write the manifest (last, atomically), then put the whole store in ``root``'s place."""
        if self.format is None:
            raise LoadError(f"no experts module was written to {self.root}; a store needs at least one")
        manifest = Manifest(
            model_type, self.format[0], self.format[1], source, tuple(self.layers), self.files
        )
        write_atomically(self.staging / MANIFEST, lambda tmp: tmp.write_text(manifest.to_json()))
        replace_folder(self.staging, self.root, aside=self.aside)
        return manifest


class ExpertStore:
    """A finished store, opened: manifest parsed, files present with the sizes and headers it lists."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.root = root
        self.manifest = manifest
        self.layers = {layer.module: layer for layer in manifest.layers}
        self._verified: set[tuple[str, range | None]] = set()  # (file, share): checked already

    @classmethod
    def open(cls, path: str | Path) -> ExpertStore:
        root = Path(path).expanduser()
        if not root.is_dir():
            raise LoadError(
                f"expert store {root} does not exist (make one with: moetune convert SRC {root} --format {CONVERT_FORMAT_HINT}).{unfinished_note(root)}"
            )
        if not (root / MANIFEST).is_file():
            if (root / "config.json").is_file():  # a model folder: converting into it would be refused
                raise LoadError(
                    f"expert_path {root} is a model folder (config.json, no {MANIFEST}), not a moetune store; "
                    f"give the model as model_name_or_path, or convert it into a new folder first: moetune convert "
                    f"{root} STORE_DIR --format {CONVERT_FORMAT_HINT}, then expert_path: STORE_DIR"
                )
            raise LoadError(
                f"{root} has no {MANIFEST}: not a moetune store, or a conversion that did not finish (the "
                f"manifest is written last). Run moetune convert SRC {root} --format {CONVERT_FORMAT_HINT} again.{unfinished_note(root)}"
            )
        manifest = Manifest.read(root / MANIFEST)
        try:
            allowed = set(FORMATS.get(manifest.format).STATE_FIELDS) | set(BIASES)
        except RegistryError as e:
            raise LoadError(f"{root / MANIFEST}: {e}") from None
        stale = [
            layer.file
            for layer in manifest.layers
            if _stale(
                manifest.format, layer, cls._check_file(root, layer, manifest.files[layer.file], allowed)
            )
        ]
        if stale:
            logger.warning(
                "moetune: expert store %s was written by an older moetune: %d of its %d files hold bf16 weights "
                "off the cache lines or rows the engine now pads (%s%s), on which an engine step ran 1.16-1.26x "
                "slower where measured; rewrite it: %s",
                root,
                len(stale),
                len(manifest.layers),
                ", ".join(stale[:2]),
                ", ..." if len(stale) > 2 else "",
                manifest.convert_line(manifest.source.path, root),
            )
        return cls(root, manifest)

    @staticmethod
    def _check_file(
        root: Path, layer: StoredLayer, stored: StoredFile, allowed: set[str]
    ) -> dict[str, TensorInfo]:
        """Presence, size and header of ``layer``'s file; reads only the header, which it returns."""
        path = root / layer.file
        if not path.is_file():
            raise LoadError(
                f"{path} is missing ({layer.module}'s experts); the store is incomplete: convert again"
            )
        size = path.stat().st_size
        if size != stored.size:
            how = "truncated" if size < stored.size else "longer than written"
            raise LoadError(f"{path} is {how}: {size} bytes, the manifest says {stored.size}; convert again")
        tensors = read_header(path)
        names = set(tensors)
        want_bias = set(BIASES) if layer.bias else set()
        problems = [f"unexpected tensor(s) {sorted(names - allowed)}"] if names - allowed else []
        if names & set(BIASES) != want_bias:
            problems.append(f"biases {sorted(names & set(BIASES))}, the manifest says {sorted(want_bias)}")
        problems += [
            f"{k} has {info.shape[0] if info.shape else 'no'} experts, the manifest says {layer.num_experts}"
            for k, info in tensors.items()
            if not info.shape or info.shape[0] != layer.num_experts
        ]
        if stored.experts_sha256 is not None and len(stored.experts_sha256) != layer.num_experts:
            problems.append(
                f"'experts_sha256' lists {len(stored.experts_sha256)} hashes, the manifest says "
                f"{layer.num_experts} experts (one hash each)"
            )
        if problems:
            raise LoadError(f"{path} does not match {MANIFEST}: {'; '.join(problems)}")
        return tensors

    def check_model(
        self,
        model_type: str,
        sites: list[ExpertsSite],
        source: SourceIdentity,
        expected_format: str | None = None,
        expected_params: Mapping[str, Any] | None = None,
    ) -> None:
        """``LoadError`` listing every way the store does not fit the model about to load (before any read).

        ``expected_format`` / ``expected_params``: what the caller asked for explicitly (None: anything)."""
        m = self.manifest
        problems = []
        if m.model_type != model_type:
            problems.append(f"model_type is {m.model_type!r}, the checkpoint's is {model_type!r}")
        if expected_format is not None and expected_format != m.format:
            problems.append(f"format is {m.format!r}, but expert_format {expected_format!r} was asked for")
        differ = {k: v for k, v in (expected_params or {}).items() if m.params.get(k) != v}
        if differ:
            problems.append(f"format parameters are {m.params}, but {differ} was asked for")
        by_path = {s.path: s for s in sites}
        missing = [p for p in by_path if p not in self.layers]
        extra = [p for p in self.layers if p not in by_path]
        if missing:
            problems.append(f"no experts for the model's module(s) {listing(missing, inline=True)}")
        if extra:
            problems.append(f"experts for module(s) the model does not have: {listing(extra, inline=True)}")
        for path, layer in self.layers.items():
            site = by_path.get(path)
            if site is None:
                continue
            lay = site.layout
            want = (lay.num_experts, lay.hidden_size, lay.intermediate_size, lay.has_bias)
            got = (layer.num_experts, layer.hidden_size, layer.intermediate_size, layer.bias)
            if got != want:
                problems.append(f"{layer.file}: (E, H, I, bias) = {got}, the model's {path} has {want}")
        if not problems:
            problems += [
                f"{d}: it was converted from another checkpoint ({m.source.path})"
                for d in m.source.differences(source)
            ]
        if problems:
            raise LoadError(
                f"expert store {self.root} does not fit the model being loaded ({self.root / MANIFEST}):"
                f"{listing(problems)}"
                f"\nConvert this checkpoint: "
                f"{m.convert_line(source.path, self.root, expected_format, expected_params)}"
            )

    def layer_nbytes(self, module: str) -> int:
        """Size of ``module``'s file."""
        return self.manifest.files[self.layers[module].file].size

    def layer_resident_bytes(self, module: str) -> int:
        """Memory ``module``'s file occupies when all its pages are resident (whole pages)."""
        return page_rounded(self.layer_nbytes(module))

    def map_layer(self, module: str) -> MappedFile:
        """Layer ``module``'s file, memory-mapped (nothing read yet)."""
        return MappedFile(self.root / self.layers[module].file)

    def build(
        self, module: str, mapped: MappedFile, experts: range | None = None
    ) -> tuple[ExpertFormat, torch.Tensor | None, torch.Tensor | None]:
        """The layer's format over views of ``mapped`` (no copy), and its biases (views, or None); with
        ``experts`` (a rank's share), of those experts' rows only."""
        tensors = self.share(mapped, experts)
        weights = {k: t for k, t in tensors.items() if k not in BIASES}
        try:
            fmt = FORMATS.get(self.manifest.format).from_state_tensors(weights, **self.manifest.params)
        except EngineError as e:
            raise LoadError(f"{mapped.path} does not hold valid {self.manifest.format} experts: {e}") from e
        got = (fmt.num_experts, fmt.hidden_size, fmt.intermediate_size)
        if got != self._sizes(module, experts):
            raise LoadError(
                f"{mapped.path}: its tensors hold (E, H, I) = {got}, the manifest says {self._sizes(module, experts)}"
            )
        return fmt, tensors.get(BIASES[0]), tensors.get(BIASES[1])

    def _sizes(self, module: str, experts: range | None = None) -> tuple[int, int, int]:
        layer = self.layers[module]
        e = layer.num_experts if experts is None else len(experts)
        return e, layer.hidden_size, layer.intermediate_size

    def _check_share(self, module: str, experts: range) -> None:
        e = self.layers[module].num_experts
        if experts.step != 1 or not 0 <= experts.start < experts.stop <= e:
            raise LoadError(
                f"{self.root / self.layers[module].file}: experts {experts} are not a run of {module}'s "
                f"{e} experts"
            )

    def share(self, mapped: MappedFile, experts: range | None) -> dict[str, torch.Tensor]:
        """``mapped``'s tensors (views), or with ``experts`` their rows ``[experts.start, experts.stop)``:
        contiguous views of one byte range each (nothing read)."""
        if experts is None:
            return dict(mapped.tensors)
        self._check_share(self._module_of(mapped), experts)
        return {k: t[experts.start : experts.stop] for k, t in mapped.tensors.items()}

    def share_nbytes(self, module: str, experts: range | None) -> int:
        """Bytes of ``module``'s tensors for ``experts`` (None: its whole file), from the header."""
        return sum(end - start for start, end in self._share_spans(module, experts))

    def share_resident_bytes(self, module: str, experts: range | None) -> int:
        """Memory ``module``'s share occupies when its pages are resident: the whole pages under each tensor's
        rows of ``experts`` (None: the whole file's pages), pages two tensors share counted once."""
        if experts is None:
            return self.layer_resident_bytes(module)
        total, last = 0, 0
        for start, end in sorted(self._share_spans(module, experts)):
            start, end = max(start - start % mmap.PAGESIZE, last), page_rounded(end)
            total += max(end - start, 0)
            last = max(last, end)
        return total

    def _share_spans(self, module: str, experts: range | None) -> list[tuple[int, int]]:
        """Byte ranges ``[start, end)`` of ``module``'s file holding ``experts``' rows, one per tensor (every
        tensor leads with E); None: the whole file."""
        if experts is None:
            return [(0, self.layer_nbytes(module))]
        self._check_share(module, experts)
        e = self.layers[module].num_experts
        return [
            (
                info.offset + experts.start * (info.nbytes // e),
                info.offset + experts.stop * (info.nbytes // e),
            )
            for info in read_header(self.root / self.layers[module].file).values()
        ]

    def _module_of(self, mapped: MappedFile) -> str:
        return next(m for m, layer in self.layers.items() if layer.file == mapped.path.name)

    def verify_share(self, mapped: MappedFile, experts: range) -> None:
        """Check experts ``experts`` of ``mapped`` against the manifest's per-expert hashes, once, reading only
        their bytes (which brings their pages in); a store without them: a warning (once), and their pages
        brought in."""
        key = (mapped.path.name, experts)
        if key in self._verified:
            return
        module = self._module_of(mapped)
        tensors = self.share(mapped, experts)
        want = self.manifest.files[mapped.path.name].experts_sha256
        if want is None:
            logger.warning(
                "moetune: %s has no per-expert SHA-256 in %s (a store written by an older moetune): experts "
                "%d-%d of %s are used unverified; convert again (%s) to verify them with expert_parallel: sharded",
                mapped.path,
                MANIFEST,
                experts.start,
                experts.stop - 1,
                module,
                self.manifest.convert_line(self.manifest.source.path, self.root),
            )
            for t in tensors.values():
                mapped.populate(t)
            self._verified.add(key)  # nothing to check: warned once
            return
        got = experts_sha256(tensors, range(len(experts)))
        bad = [e for e, g, w in zip(experts, got, want[experts.start : experts.stop]) if g != w]
        if bad:
            raise LoadError(
                f"{mapped.path} was altered after conversion: the bytes of expert(s) {bad} of {module} do not "
                f"match their SHA-256 in {self.root / MANIFEST}. Convert the checkpoint again: "
                f"{self.manifest.convert_line(self.manifest.source.path, self.root)}"
            )
        self._verified.add(key)

    def is_verified(self, mapped: MappedFile, experts: range | None = None) -> bool:
        """Whether ``mapped`` (or its experts ``experts``) was checked already."""
        return (mapped.path.name, experts) in self._verified

    def verify_mapped(self, mapped: MappedFile) -> None:
        """SHA-256 of ``mapped`` (read through the mapping, which populates it) against the manifest, once."""
        key = (mapped.path.name, None)
        if key in self._verified:
            return
        want = self.manifest.files[mapped.path.name].sha256
        got = mapped.sha256()
        if got != want:
            raise LoadError(
                f"{mapped.path} was altered after conversion: its SHA-256 is {got}, the manifest says {want}. "
                f"Convert the checkpoint again: {self.manifest.convert_line(self.manifest.source.path, self.root)}"
            )
        self._verified.add(key)

    def verify(self) -> None:
        """Hash every file now (one full read of the store)."""
        for module in self.layers:
            self.verify_mapped(self.map_layer(module))


class StorePages:
    """One layer file as a ``Pageable`` for disk residency, or with ``experts`` (a rank of ``expert_parallel:
    sharded``) only those experts' rows of it. The first ``warm`` verifies what it covers (the file's SHA-256, or
    the experts' own hashes, read through the mapping, which also brings the pages in); later ones only
    populate it. ``release`` drops the pages again (of the share only from the page cache)."""

    def __init__(self, store: ExpertStore, mapped: MappedFile, experts: range | None = None) -> None:
        self.store, self.mapped, self.experts = store, mapped, experts
        module = store._module_of(mapped)
        # the views of the share (nothing read); None: the whole file
        self.views = None if experts is None else list(store.share(mapped, experts).values())
        self.nbytes = store.share_resident_bytes(module, experts)  # what it occupies resident

    def warm(self) -> None:
        if not self.store.is_verified(self.mapped, self.experts):
            if self.experts is None:
                self.store.verify_mapped(self.mapped)
            else:
                self.store.verify_share(self.mapped, self.experts)
        elif self.views is None:
            self.mapped.populate()
        else:
            for view in self.views:
                self.mapped.populate(view)

    def release(self) -> None:
        self.mapped.release(self.views)
