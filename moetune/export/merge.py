"""A merged checkpoint: a trained adapter added into the base checkpoint's own weights, written in its own layout.

What ``llamafactory-cli export`` (and PEFT's ``merge_and_unload`` + ``save_pretrained``) make, without building the
model: the checkpoint is rewritten shard by shard, each tensor an adapter touches replaced, everything else kept
byte for byte, so the result has the checkpoint's names, shards, dtypes and config, and loads wherever the base
model loads (transformers, vLLM, SGLang, moetune) with no adapter.

Which tensor each LoRA pair goes into is the serving layout's mapping (``moetune.export.serving.checkpoint_pairs``,
``merging=True``): every pair under the checkpoint name of the weight it adapts, routed-expert LoRA one pair per
expert and projection where the checkpoint stores one matrix per expert, rsLoRA folded into B. A pair adds
``(lora_alpha / r) * B @ A`` (``[out, in]``, the stored matrix's shape) to its weight. Where the checkpoint stores
the experts fused (gpt-oss, Qwen3.5-MoE, Llama 4), each expert's slice gets what stock PEFT's ``ParamWrapper``
merges (``get_delta_weight``), put in the stored order (transposed, gate and up interleaved, as stored). Router
LoRA merges like any Linear's; whole weights saved beside the LoRA (``modules_to_save``, a LoRA'd ``lm_head``'s
base weight) replace theirs before any LoRA is added, of the same shape only.

Float weights are merged in fp32 and rounded once to their stored dtype. Quantized checkpoints (FP8 block:
DeepSeek-V3, Kimi-K2-Instruct; compressed-tensors INT4: Kimi-K2-Thinking; MXFP4: gpt-oss) take one of two forms
(``quantized``):

- ``bfloat16`` (the default): every quantized weight is written dequantized, in bf16 (the merged ones with their
  delta added in fp32 first), and ``quantization_config`` leaves ``config.json``: a float checkpoint twice the
  size (or four times, from INT4 / MXFP4), the adapter kept to bf16's precision.
- ``requantize``: the merged weights are quantized again in their own format by their method
  (``QuantMethod.quantize``), the checkpoint keeps its size and format, and the result says what share of the
  adapter's change the requantized weights keep (``MergeResult.kept``: the projection of the written change on
  the exact one). A stored weight sits on its format's grid, so a change smaller than half a step rounds back to
  it: on random ``[1024, 2048]`` weights of std 0.02, a rank-8 change of 0.36% of their norm keeps 14% in FP8, 2%
  in INT4 and 26% in MXFP4 (with noise 7.5 times its size), against 100% in bf16 (``bench/merge_precision.py``),
  which is why requantizing is not the default.

Refused by name before anything is written: moetune's LoRA experts (no checkpoint format holds them), weights a
checkpoint builds by a conversion at load, a whole weight of another shape (a resized vocabulary), an edit to an
embedding the config ties to the output head (``tie_word_embeddings``), a disk without room for the result.

Files beside the weights (config.json, tokenizer, generation config, custom code, the index) are copied (the index
and config rewritten where weights change form), the adapter folder's tokenizer files over the model's (they carry
the chat template the run trained with); folders inside the model folder, weights in other formats and
safetensors files the checkpoint does not list (gpt-oss's ``original/``, Mistral's ``consolidated.safetensors``)
are left out and named. The result is staged beside ``out`` and moved in whole (a failed merge leaves ``out`` as
it was); every written shard carries a mark (``moetune_export: merged``) so that ``overwrite`` replaces earlier
merges only.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from moetune.adapters.check import PREFIX, check_adapter_folder, expert_lora_prefixes
from moetune.adapters.peft_layout import deinterleave_rows, interleave_rows
from moetune.adapters.swap import CONFIG_NAME
from moetune.errors import AdapterError, OutputDirError, listing
from moetune.export.serving import TOKENIZER_FILES, checkpoint_names, checkpoint_pairs, prepare_out, publish
from moetune.finite import all_finite
from moetune.loading.checkpoint import INDEX, OTHER_WEIGHT_PATTERNS, Checkpoint, ShardReader
from moetune.loading.quant import ROLES
from moetune.tensorfile import TORCH_DTYPES

if TYPE_CHECKING:
    from moetune.loading.load import PlannedLoad
    from moetune.loading.quant import QuantizedWeight

MERGE_MARK = {"moetune_export": "merged"}  # in every written shard's metadata: what --overwrite may replace
Quantized = Literal["bfloat16", "requantize"]
QUANTIZED_FORMS: tuple[Quantized, ...] = ("bfloat16", "requantize")
KEPT_CHUNK = 1 << 18  # values per step of MergeResult.kept's sums: 2 MiB fp64 temporaries, reused by malloc
# fp32 working copies up to this many bytes go in buffers kept for the next weight: glibc maps every allocation
# above 32 MiB afresh, and faulting its pages in was ~40% of a merge's time (docs/benchmarks.md, "Merging");
# larger ones (a LoRA'd lm_head) are allocated each time rather than held
REUSED_MAX_BYTES = 1 << 30
DISK_MARGIN = 1.02  # free space asked beyond the estimated size (headers, filesystem blocks)


class Edit(Protocol):
    """One change to a weight, applied in fp32 to the weight (2-D) or, for a fused experts tensor, to one expert's
    slice (``expert`` its index), in the stored layout."""

    def apply(self, w: torch.Tensor, expert: int | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class PairEdit:
    """``w += scale * B @ A``: a ``[r, in]``, b ``[out, r]`` (views of the adapter), formed when the weight is
    written."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float

    def apply(self, w: torch.Tensor, expert: int | None) -> torch.Tensor:
        return w.addmm_(self.b.to(torch.float32), self.a.to(torch.float32), alpha=self.scale)


@dataclass(frozen=True)
class Replace:
    """The weight becomes ``value`` (a whole weight saved beside the LoRA)."""

    value: torch.Tensor

    def apply(self, w: torch.Tensor, expert: int | None) -> torch.Tensor:
        return self.value.to(torch.float32).clone()


@dataclass(frozen=True)
class FusedEdit:
    """Stock PEFT's ``ParamWrapper`` delta of a fused ``[E, d1, d2]`` parameter, one expert at a time: lora_A
    ``[E * r, in]`` expert-major, lora_B ``[out, r * E]`` rank-major; ``M_e = scale * B_e @ A_e`` is ``[d1, d2]``
    as is (``in, out = d2, d1``: the module does not declare ``is_transposed``) or transposed (it declares it).
    Then the stored order: gate_up's rows (``rows_dim`` of the module's ``[d1, d2]``) interleaved (``interleave``
    True) or de-interleaved (False) where the checkpoint orders them otherwise, and the two dimensions swapped
    (``swapped``) where it stores them so."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    num_experts: int
    flagged: bool
    scale: float
    interleave: bool | None
    rows_dim: int
    swapped: bool

    def delta(self, expert: int) -> torch.Tensor:
        r = self.lora_a.shape[0] // self.num_experts
        a = self.lora_a[expert * r : (expert + 1) * r].to(torch.float32)  # [r, in]
        b = self.lora_b.view(self.lora_b.shape[0], r, self.num_experts)[:, :, expert].to(torch.float32)
        m = (b @ a) * self.scale  # [out, in]
        m = m.t() if self.flagged else m  # the module's [d1, d2]
        if self.interleave is not None:
            rows = m.movedim(self.rows_dim, 0)[None]  # [1, 2I, .]
            rows = interleave_rows(rows) if self.interleave else deinterleave_rows(rows)
            m = rows[0].movedim(0, self.rows_dim)
        return m.t() if self.swapped else m

    def apply(self, w: torch.Tensor, expert: int | None) -> torch.Tensor:
        assert expert is not None
        return w.add_(self.delta(expert))


@dataclass(frozen=True)
class MergeResult:
    """What a merge wrote: ``changed`` checkpoint weights (logical keys), ``written`` shards rewritten, ``copied``
    files copied as they were, ``left_out`` entries of the model folder not copied, ``dequantized`` quantized
    weights written in bf16 (``quantized="bfloat16"``), ``kept`` the share of the adapter's change the requantized
    weights keep (``quantized="requantize"``; None when no quantized weight was merged)."""

    changed: list[str]
    written: list[str]
    copied: list[str]
    left_out: list[str]
    dequantized: list[str] = field(default_factory=list)
    kept: float | None = None


@dataclass
class _Kept:
    """Running sums for ``MergeResult.kept``: ``<written - before, exact - before>`` and ``|exact - before|^2``."""

    along: float = 0.0
    exact: float = 0.0

    def add(self, before: torch.Tensor, exact: torch.Tensor, written: torch.Tensor) -> None:
        """One weight's terms (three fp32 tensors of one shape), in fp64 over ``KEPT_CHUNK`` values at a time:
        whole-weight fp64 temporaries cost the merge a page-faulted allocation each (half the time of a
        requantizing merge, ``bench/merge.py``)."""
        b, e, w = (t.reshape(-1) for t in (before, exact, written))
        for s in range(0, b.numel(), KEPT_CHUNK):
            base = b[s : s + KEPT_CHUNK].double()
            change = e[s : s + KEPT_CHUNK].double().sub_(base)
            self.along += float(torch.dot(w[s : s + KEPT_CHUNK].double().sub_(base), change))
            self.exact += float(torch.dot(change, change))


@dataclass
class MergePlan:
    """Every edit, by the logical checkpoint key it changes, decided from headers and the adapter alone;
    ``stored``: the checkpoint's shards as they are (``planned.checkpoint`` is the logical view); ``dequantize``:
    the quantized weights written in bf16 (every one, in ``bfloat16`` form)."""

    planned: PlannedLoad
    stored: Checkpoint
    edits: dict[str, list[Edit]]
    dequantize: set[str]
    kept: _Kept = field(default_factory=_Kept)
    _buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def _buffer(self, role: str, shape: tuple[int, ...]) -> torch.Tensor:
        """An fp32 ``shape`` tensor for ``role`` (``weight``, ``before``, ``written``): a view of the role's buffer,
        grown to the largest weight seen, so each weight of a merge reuses its pages; a fresh tensor above
        ``REUSED_MAX_BYTES``. Its values are the last weight's: callers overwrite it whole."""
        n = math.prod(shape)
        if n * 4 > REUSED_MAX_BYTES:
            return torch.empty(shape, dtype=torch.float32)
        held = self._buffers.get(role)
        if held is None or held.numel() < n:
            held = self._buffers[role] = torch.empty(n, dtype=torch.float32)
        return held[:n].view(shape)

    def quantized(self, key: str) -> QuantizedWeight | None:
        return self.planned.quantized.get(key)

    @cached_property
    def _shard_keys(self) -> dict[str, list[str]]:
        """Shard -> the keys it is written with: its stored tensors, and the weights written dequantized whose
        main part it holds (an FP8 weight's logical key is its codes' too)."""
        out: dict[str, list[str]] = {}
        for k, info in self.stored.tensors.items():
            out.setdefault(info.file, []).append(k)
        for key in self.dequantize:
            out.setdefault(self.planned.quantized[key].info.file, []).append(key)
        return out

    @cached_property
    def _gone(self) -> set[str]:
        """Stored parts of the weights written dequantized."""
        return {p.key for k in self.dequantize for p in self.planned.quantized[k].parts.values()}

    @cached_property
    def owners(self) -> dict[str, str]:
        """Stored or written key -> the logical weight whose merge produces it."""
        out = {key: key for key in self.dequantize}
        for key in self.edits:
            q = self.quantized(key)
            out.update(
                {key: key} if q is None or key in self.dequantize else {p.key: key for p in q.parts.values()}
            )
        return out

    def outputs(self, name: str) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """``{key: (dtype, shape)}`` of shard ``name`` as written: its stored tensors but the parts of weights
        written dequantized, which it holds instead (under their logical key, in bf16) when their main part is
        here."""
        out = {}
        for k in self._shard_keys.get(name, []):
            if k in self.dequantize:
                out[k] = (torch.bfloat16, tuple(self.planned.quantized[k].info.shape))
            elif k not in self._gone:
                info = self.stored.tensors[k]
                out[k] = (TORCH_DTYPES[info.dtype], tuple(info.shape))
        return out

    def nbytes(self, name: str) -> int:
        """Data bytes of shard ``name`` as written."""
        return sum(dtype.itemsize * math.prod(shape) for dtype, shape in self.outputs(name).values())

    def merged(self, key: str, reader: ShardReader) -> dict[str, torch.Tensor]:
        """Logical weight ``key`` with its edits, as written: ``{key: tensor}`` for every tensor that changes (its
        parts when requantized). A fused experts tensor goes one expert at a time (peak: the result and one
        expert's slice in fp32)."""
        planned, edits = self.planned, self.edits.get(key, [])
        q = self.quantized(key)
        info = planned.checkpoint.tensors[key]  # logical: float shape
        requantize = q is not None and key not in self.dequantize
        if len(info.shape) == 2:
            w, before = self._fp32(key, q, reader, None)
            for e in edits:
                w = e.apply(w, None)
            return self._written(key, q, w, before, requantize)
        out: dict[str, torch.Tensor] = {}
        for expert in range(info.shape[0]):
            w, before = self._fp32(key, q, reader, expert)
            for e in edits:
                w = e.apply(w, expert)
            for k, t in self._written(key, q, w, before, requantize).items():
                if k not in out:
                    shape = tuple(self._stored_shape(k, q, key))
                    out[k] = torch.empty(shape, dtype=t.dtype)
                out[k][expert] = t
        return out

    def _stored_shape(self, k: str, q: QuantizedWeight | None, key: str) -> tuple[int, ...]:
        if q is None or k == key and key in self.dequantize:
            return tuple(self.planned.checkpoint.tensors[key].shape)
        return next(tuple(p.shape) for p in q.parts.values() if p.key == k)

    def _fp32(
        self, key: str, q: QuantizedWeight | None, reader: ShardReader, expert: int | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the weight or its expert's slice in fp32, a copy of it when its change is measured, else None)."""
        if q is None:
            stored = reader.read(self.planned.checkpoint.tensors[key], expert)
            w = self._buffer("weight", tuple(stored.shape)).copy_(stored)
        else:
            assert self.planned.method is not None
            parts = {role: reader.read(info, expert) for role, info in q.parts.items()}
            shape = self._dequantized_shape(key, expert)
            w = self.planned.method.dequantize_parts(q, parts, self._buffer("weight", shape))
        measured = q is not None and key not in self.dequantize and key in self.edits
        return w, self._buffer("before", tuple(w.shape)).copy_(w) if measured else None

    def _dequantized_shape(self, key: str, expert: int | None) -> tuple[int, ...]:
        """A quantized weight's fp32 shape as ``dequantize_parts`` gives it (its logical shape; one expert's)."""
        shape = tuple(self.planned.checkpoint.tensors[key].shape)
        return shape if expert is None else shape[1:]

    def _written(
        self,
        key: str,
        q: QuantizedWeight | None,
        w: torch.Tensor,
        before: torch.Tensor | None,
        requantize: bool,
    ) -> dict[str, torch.Tensor]:
        if not all_finite(w):
            raise AdapterError(f"merging the adapter into {key} gives NaN or Inf values; nothing was written")
        if q is None:  # a copy even in fp32: w is a reused buffer
            return {key: w.to(TORCH_DTYPES[self.planned.checkpoint.tensors[key].dtype], copy=True)}
        if not requantize:
            return {key: w.to(torch.bfloat16)}
        method = self.planned.method
        assert method is not None
        parts = method.quantize(q, w)
        if before is not None:
            self.kept.add(
                before, w, method.dequantize_parts(q, parts, self._buffer("written", tuple(w.shape)))
            )
        return {q.parts[role].key: t for role, t in parts.items()}


def plan_merge(
    model_path: str | Path,
    adapter_path: str | Path,
    *,
    quantized: Quantized = "bfloat16",
    trust_remote_code: bool = False,
) -> MergePlan:
    """Every edit the merge of the adapter in ``adapter_path`` into the checkpoint in ``model_path`` makes, from the
    checkpoint's headers and the adapter; ``AdapterError`` for anything it cannot merge, before any weight is read."""
    from moetune.loading.load import plan_load
    from moetune.loading.options import LoadOptions

    if quantized not in QUANTIZED_FORMS:
        raise AdapterError(f"quantized is {quantized!r}; one of {', '.join(QUANTIZED_FORMS)}")
    # the folder alone first: no checkpoint header read for it
    folder = check_adapter_folder(adapter_path).folder
    options = LoadOptions.create(
        device="cpu", dtype="float32", progress=False, trust_remote_code=trust_remote_code
    )
    planned = plan_load(model_path, options)
    pairs = checkpoint_pairs(planned, folder, merging=True)
    scale = float(pairs.config["lora_alpha"]) / int(pairs.config["r"])
    logical = planned.checkpoint.tensors
    edits: dict[str, list[Edit]] = {}
    problems: list[str] = []

    def edit(key: str, change: Edit, shape: tuple[int, ...], what: str) -> None:
        info = logical.get(key)
        if info is None or tuple(info.shape) != shape:
            have = "no such tensor" if info is None else f"{list(info.shape)}"
            problems.append(f"{what} is {list(shape)}; the checkpoint's {key} is {have}")
            return
        changes = edits.setdefault(key, [])
        # a whole weight first (a LoRA'd module's saved base weight), the LoRA on top of it
        changes.insert(0 if isinstance(change, Replace) else len(changes), change)

    for stored_key, value in pairs.whole.items():
        what = f"the whole weight the adapter saves for {stored_key}"
        edit(stored_key, Replace(value), tuple(value.shape), what)
    tensors = pairs.tensors
    fused_prefixes = tuple(PREFIX + p for p in pairs.fused_paths)
    for key in sorted(tensors):
        if not key.endswith(".lora_A.weight") or key.startswith(fused_prefixes):
            continue
        module = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        a, b = tensors[key], tensors[f"{PREFIX}{module}.lora_B.weight"]
        edit(pairs.weights[module], PairEdit(a, b, scale), (b.shape[0], a.shape[1]), f"the LoRA of {module}")
    problems += _fused_edits(planned, pairs.fused_paths, tensors, pairs.config, scale, edit)
    problems += _tied(planned, set(edits))
    method = planned.method
    touched = sorted(k for k in edits if k in planned.quantized)
    if method is not None and touched and not method.writes:
        problems.append(
            f"{listing(touched, inline=True)}: moetune reads no {method.label} weights to merge into"
        )
    if problems:
        raise AdapterError(
            f"adapter {folder} cannot be merged into {planned.checkpoint.path}:{listing(problems)}"
        )
    dequantize = set(planned.quantized) if quantized == "bfloat16" else set()
    return MergePlan(planned, Checkpoint.open(model_path), edits, dequantize)


def _fused_edits(
    planned: PlannedLoad,
    paths: tuple[str, ...],
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any],
    scale: float,
    edit: Callable[[str, Edit, tuple[int, ...], str], None],
) -> list[str]:
    """The fused experts modules' edits (through ``edit``), and what cannot be merged there."""
    problems: list[str] = []
    layers = {layer.site.path: layer for layer in planned.plan.layers}
    for path in paths:
        experts = planned.model.get_submodule(path)  # on the meta device: shapes only
        params = {n: tuple(p.shape) for n, p in experts.named_parameters(recurse=False) if p.dim() == 3}
        flagged = bool(getattr(experts, "is_transposed", False))
        layout = layers[path].site.layout
        sources = {s.role: s for s in layers[path].sources if s.expert is None and s.role not in ROLES}
        for param, prefix in expert_lora_prefixes(path, list(params), config).items():
            source = sources.get(param)
            target = planned.targets.get(source.info.key) if source is not None else None
            # stored as the module holds it, its last two dimensions swapped or gate and up interleaved the other way
            # (a transpose or an interleave at load)
            if source is None or target is None or not set(target.ops) <= {"Transpose", "Interleave"}:
                problems.append(
                    f"{path}.{param}: the checkpoint stores it in another layout than the module holds it (made by "
                    f"a conversion at load: {', '.join(target.ops) if target else 'no plain tensor'}), so the "
                    "fused LoRA has no stored tensor to go into"
                )
                continue
            regroup = source.interleaved != layout.interleaved and param == "gate_up_proj"
            e, d1, d2 = params[param]
            change = FusedEdit(
                tensors[f"{PREFIX}{prefix}.lora_A.weight"],
                tensors[f"{PREFIX}{prefix}.lora_B.weight"],
                e,
                flagged,
                scale,
                source.interleaved if regroup else None,
                1 if layout.transposed else 0,  # 2I in the module's [d1, d2]
                source.swapped,
            )
            shape = (e, d2, d1) if source.swapped else (e, d1, d2)
            edit(source.info.key, change, shape, f"the fused LoRA of {path}.{param}")
    return problems


def _tied(planned: PlannedLoad, keys: set[str]) -> list[str]:
    """Edits to an embedding the config ties to the output head: the checkpoint stores one tensor for both, and
    stock PEFT's merge changes only the one the adapter trained."""
    model = planned.model
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if (
        inputs is None
        or outputs is None
        or not getattr(model.config.get_text_config(), "tie_word_embeddings", False)
    ):
        return []
    names = checkpoint_names(planned)
    paths = [f"{n}.weight" for n, m in model.named_modules() if m is inputs or m is outputs]
    tied = {names[p] for p in paths if p in names}
    return [
        f"{key}: the config ties the input embedding and the output head (tie_word_embeddings), which the "
        "checkpoint stores once, so merging into one would change both; use the adapter unmerged"
        for key in sorted(keys & tied)
    ]


def _left_out(model: Path, checkpoint: Checkpoint) -> tuple[list[Path], list[str]]:
    """(files to copy as they are, entries left out) of the model folder beside its safetensors shards: folders,
    weights in other formats and safetensors files the checkpoint does not list are left out."""
    shards = set(checkpoint.files)
    other = {p.name for pattern in (*OTHER_WEIGHT_PATTERNS, "*.safetensors") for p in model.glob(pattern)}
    copy, left = [], []
    for entry in sorted(model.iterdir()):
        if entry.name in shards:
            continue
        if entry.is_file() and entry.name not in other and not entry.name.startswith("."):
            copy.append(entry)
        else:
            left.append(entry.name + ("/" if entry.is_dir() else ""))
    return copy, left


def _write_shard(plan: MergePlan, reader: ShardReader, name: str, path: Path) -> None:
    """Shard ``name`` again at ``path`` (``MergePlan.outputs``), merged weights merged, the other tensors as stored,
    its metadata with the merge's mark. One weight's tensors at a time are held (a part in another shard is
    computed again there)."""
    from safetensors import safe_open

    from moetune.tensorfile import write_streamed

    stored, owner = plan.stored, plan.owners
    with safe_open(str(stored.file_path(name)), "pt") as f:
        metadata = dict(f.metadata() or {})
    placeholders = {
        k: torch.empty(shape, dtype=dtype, device="meta") for k, (dtype, shape) in plan.outputs(name).items()
    }
    done: dict[str, torch.Tensor] = {}  # tensors of merged weights not written yet
    merged: set[str] = set()

    def produce(k: str) -> torch.Tensor:
        # every tensor of a merged weight at once, each dropped once written; a part the merge keeps, as stored
        if k in owner and owner[k] not in merged:
            merged.add(owner[k])
            done.update(plan.merged(owner[k], reader))
        return done.pop(k) if k in done else reader.read(stored.tensors[k])

    # by name: a weight's parts come one after the other, so only one weight's are held at a time (and the one
    # before being written: behind)
    write_streamed(path, placeholders, {**metadata, **MERGE_MARK}, produce=produce, by_name=True, behind=True)


def _config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json without its quantization (top level, or a composite model's text_config)."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out


def _check_room(out: Path, need: int) -> None:
    """``OutputDirError`` unless the filesystem ``out`` goes on has ``need`` bytes (and the margin) free."""
    where = out
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need * DISK_MARGIN:
        raise OutputDirError(
            f"--out {out}: the merged checkpoint needs about {need / 1e9:.1f} GB and {where} has {free / 1e9:.1f} GB "
            "free; free space or give a folder on another disk"
        )


def _write_all(
    plan: MergePlan, staged: Path, copy: list[Path], adapter: Path, progress: bool
) -> tuple[list[str], list[str]]:
    """Every file of the merged checkpoint into ``staged``: the shards (rewritten where they hold a weight that
    changes, else copied), the index and config (rewritten where weights change form), the other files of the
    model folder, the adapter's tokenizer files; (written, copied) names. Each shard is flushed to disk by a
    second thread while the next one is merged."""
    from concurrent.futures import ThreadPoolExecutor

    from tqdm.auto import tqdm

    from moetune.atomic import fsync

    stored = plan.stored
    changing = {stored.tensors[k].file for k in plan.owners if k in stored.tensors}
    changing |= {plan.planned.quantized[k].info.file for k in plan.dequantize}
    written, copied = [], []
    total = sum(stored.file_path(f).stat().st_size for f in stored.files)
    with (  # the flusher's exit waits for the flushes it was given
        ShardReader(stored, []) as reader,
        tqdm(total=total, desc="merging", unit="B", unit_scale=True, disable=not progress) as bar,
        ThreadPoolExecutor(1, thread_name_prefix="moetune-fsync") as flusher,
    ):
        flushed = []
        for name in stored.files:
            if name in changing:
                _write_shard(plan, reader, name, staged / name)
                written.append(name)
            else:
                shutil.copy2(stored.file_path(name), staged / name)
                copied.append(name)
            flushed.append(flusher.submit(fsync, staged / name))
            bar.update(stored.file_path(name).stat().st_size)
        for done in flushed:
            done.result()  # a flush's error, raised here
    for path in copy:
        if plan.dequantize and path.name in (INDEX, "config.json"):
            continue
        shutil.copy2(path, staged / path.name)
        copied.append(path.name)
    # the weights changed form: their keys in the index, and no quantization in the config
    if plan.dequantize:
        config = json.loads(stored.file_path("config.json").read_text())
        (staged / "config.json").write_text(json.dumps(_config(config), indent=2) + "\n")
        if (stored.path / INDEX).is_file():
            index = json.loads((stored.path / INDEX).read_text())
            index["weight_map"] = dict(sorted((k, name) for name in stored.files for k in plan.outputs(name)))
            index.setdefault("metadata", {})["total_size"] = sum(plan.nbytes(name) for name in stored.files)
            (staged / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (adapter / name).is_file():
            shutil.copy2(adapter / name, staged / name)
    assert (staged / "config.json").is_file() and not (staged / CONFIG_NAME).exists()
    for path in staged.iterdir():
        if path.name not in stored.files:  # the shards are flushed above
            fsync(path)
    return written, copied


def export_merged_checkpoint(
    model_path: str | Path,
    adapter_path: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    quantized: Quantized = "bfloat16",
    trust_remote_code: bool = False,
) -> MergeResult:
    """Merge the adapter in ``adapter_path`` into the checkpoint in ``model_path`` and write the result to
    ``out_dir`` (module docstring; ``quantized``: the form of a quantized checkpoint's weights). ``out_dir`` must
    be new or empty, or with ``overwrite`` an earlier merge; never the adapter's or the model's folder
    (``OutputDirError``, before anything is read), on a disk with room for the result."""
    out, staged = prepare_out(out_dir, adapter_path, model_path, overwrite, MERGE_MARK)
    plan = plan_merge(model_path, adapter_path, quantized=quantized, trust_remote_code=trust_remote_code)
    copy, left = _left_out(plan.stored.path, plan.stored)
    _check_room(out, sum(map(plan.nbytes, plan.stored.files)) + sum(p.stat().st_size for p in copy))
    staged.mkdir(parents=True)
    try:
        written, copied = _write_all(plan, staged, copy, Path(adapter_path).expanduser(), progress)
    except BaseException:  # a failed merge leaves nothing half-written beside out (and out as it was)
        shutil.rmtree(staged, ignore_errors=True)
        raise
    publish(staged, out)
    kept = plan.kept.along / plan.kept.exact if plan.kept.exact > 0 else None
    return MergeResult(sorted(plan.edits), written, copied, left, sorted(plan.dequantize), kept)
