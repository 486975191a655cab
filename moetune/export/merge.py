"""A merged checkpoint: a trained adapter added into the base checkpoint's own weights, written in its own layout.

What ``llamafactory-cli export`` (and PEFT's ``merge_and_unload`` + ``save_pretrained``) make, without building the
model: the checkpoint is rewritten shard by shard, each tensor an adapter touches replaced, everything else kept
byte for byte, so the result has the checkpoint's names, shards, index, dtypes, quantization and config, and loads
wherever the base model loads (transformers, vLLM, SGLang, moetune) with no adapter.

Which tensor each LoRA pair goes into is the serving layout's mapping (``moetune.export.serving.checkpoint_pairs``,
``merging=True``): every pair under the checkpoint name of the weight it adapts, routed-expert LoRA one pair per
expert and projection where the checkpoint stores one matrix per expert, rsLoRA folded into B. A pair adds
``(lora_alpha / r) * B @ A`` (``[out, in]``, the stored matrix's shape) to its weight. Where the checkpoint stores
the experts fused as the transformers module holds them (gpt-oss in float, Qwen3.5-MoE, Llama 4), the fused pair
adds what stock PEFT's ``ParamWrapper`` merges, ``get_delta_weight``'s ``[E, d1, d2]``. Router LoRA merges like any
Linear's; whole weights saved beside the LoRA (``modules_to_save``) replace theirs, of the same shape only.

Float weights are merged in fp32 and rounded once to their stored dtype. Quantized ones are dequantized, merged
and quantized again in their own format by their method (``QuantMethod.quantize``): FP8 block (DeepSeek-V3,
Kimi-K2-Instruct: e4m3 with 128 x 128 block scales taken again from the merged block) and compressed-tensors INT4
(Kimi-K2-Thinking: symmetric groups); each merged weight is then within half a quantization step of the exact sum,
as every weight of such a checkpoint is of its trained value. Refused by name before anything is written: moetune's
LoRA experts (no checkpoint format holds them), weights a checkpoint builds by a conversion at load, MXFP4 experts,
resized embeddings.

Files beside the weights (config.json, tokenizer, generation config, custom code, the index) are copied, the
adapter folder's tokenizer files over the model's (they carry the chat template the run trained with); folders
inside the model folder and weights in other formats (gpt-oss's ``original/``) are left out and named. The result
is staged beside ``out`` and moved in whole; every written shard carries a mark (``moetune_export: merged``) so
that ``overwrite`` replaces earlier merges only.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from moetune.adapters.check import PREFIX, check_adapter_folder, expert_lora_prefixes
from moetune.adapters.peft_layout import deinterleave_rows, interleave_rows
from moetune.adapters.swap import CONFIG_NAME, WEIGHTS_NAME
from moetune.errors import AdapterError, listing
from moetune.export.serving import TOKENIZER_FILES, checkpoint_pairs, prepare_out, publish
from moetune.loading.checkpoint import OTHER_WEIGHT_PATTERNS, Checkpoint, ShardReader
from moetune.loading.quant import ROLES

if TYPE_CHECKING:
    from moetune.loading.load import PlannedLoad

MERGE_MARK = {"moetune_export": "merged"}  # in every written shard's metadata: what --overwrite may replace
Edit = Callable[[torch.Tensor], torch.Tensor]  # fp32 weight -> fp32 merged weight, the stored (logical) shape


@dataclass(frozen=True)
class MergeResult:
    """What a merge wrote: ``changed`` checkpoint weights (logical keys), ``written`` shards rewritten, ``copied``
    files copied as they were, and ``left_out`` entries of the model folder not copied."""

    changed: list[str]
    written: list[str]
    copied: list[str]
    left_out: list[str]


@dataclass(frozen=True)
class MergePlan:
    """Every edit, by the logical checkpoint key it changes, decided from headers and the adapter alone."""

    planned: PlannedLoad
    edits: dict[str, list[Edit]]

    def stored_keys(self, key: str) -> list[str]:
        """The stored tensors of logical weight ``key`` (its parts when quantized)."""
        q = self.planned.quantized.get(key)
        return [key] if q is None else [p.key for p in q.parts.values()]

    def merged(self, key: str, reader: ShardReader) -> dict[str, torch.Tensor]:
        """Logical weight ``key`` with its edits, as stored: ``{stored key: tensor}`` for every part that changes."""
        planned = self.planned
        q = planned.quantized.get(key)
        if q is None:
            info = planned.checkpoint.tensors[key]
            w = reader.read(info).to(torch.float32)
        else:
            assert planned.method is not None
            w = planned.method.dequantize(q, reader)
        for edit in self.edits[key]:
            w = edit(w)
        if not torch.isfinite(w).all():
            raise AdapterError(f"merging the adapter into {key} gives NaN or Inf values; nothing was written")
        if q is None:
            return {key: w.to(reader_dtype(planned.checkpoint, key))}
        assert planned.method is not None
        parts = planned.method.quantize(q, w)  # a method that writes (refused at planning otherwise)
        return {q.parts[role].key: t for role, t in parts.items()}


def reader_dtype(checkpoint: Checkpoint, key: str) -> torch.dtype:
    from moetune.tensorfile import TORCH_DTYPES

    return TORCH_DTYPES[checkpoint.tensors[key].dtype]


def _add_pair(a: torch.Tensor, b: torch.Tensor, scale: float) -> Edit:
    """``w += scale * B @ A`` (a ``[r, in]``, b ``[out, r]``), the product formed only when the weight is written."""
    return lambda w: w.addmm_(b.to(torch.float32), a.to(torch.float32), alpha=scale)


def _add_fused(delta: Callable[[], torch.Tensor]) -> Edit:
    return lambda w: w.add_(delta())


def _replace(value: torch.Tensor) -> Edit:
    return lambda w: value.to(torch.float32).clone()


def _stored_fused_delta(
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    num_experts: int,
    flagged: bool,
    scale: float,
    order: _FusedOrder,
) -> torch.Tensor:
    """:func:`fused_delta` in the order the checkpoint stores the parameter (``order``)."""
    delta = fused_delta(lora_a, lora_b, num_experts, flagged, scale)
    if order.interleave is not None:  # gate and up rows the other way round than the module holds them
        rows = delta.movedim(order.rows_dim, 1)  # [E, 2I, .]
        rows = interleave_rows(rows) if order.interleave else deinterleave_rows(rows)
        delta = rows.movedim(1, order.rows_dim)
    return (delta.transpose(1, 2) if order.swapped else delta).contiguous()


@dataclass(frozen=True)
class _FusedOrder:
    """How a checkpoint stores a fused experts parameter against the module: ``interleave`` True / False to
    interleave / de-interleave gate_up's rows (along ``rows_dim`` of the module's shape), None to keep them;
    ``swapped``: its last two dimensions swapped."""

    interleave: bool | None
    rows_dim: int
    swapped: bool


def fused_delta(
    lora_a: torch.Tensor, lora_b: torch.Tensor, num_experts: int, flagged: bool, scale: float
) -> torch.Tensor:
    """What stock PEFT's ``ParamWrapper.get_delta_weight`` adds to a 3-D ``[E, d1, d2]`` parameter: lora_A
    ``[E * r, in]`` expert-major, lora_B ``[out, r * E]`` rank-major, ``in, out = d1, d2`` when the module declares
    ``is_transposed`` (``flagged``), else ``d2, d1``; fp32 ``[E, d1, d2]``."""
    r = lora_a.shape[0] // num_experts
    a = lora_a.to(torch.float32).reshape(num_experts, r, lora_a.shape[1])
    b = lora_b.to(torch.float32).reshape(lora_b.shape[0], r, num_experts)
    return torch.einsum("o r e, e r i -> e i o" if flagged else "o r e, e r i -> e o i", b, a) * scale


def plan_merge(
    model_path: str | Path, adapter_path: str | Path, *, trust_remote_code: bool = False
) -> MergePlan:
    """Every edit the merge of the adapter in ``adapter_path`` into the checkpoint in ``model_path`` makes, from the
    checkpoint's headers and the adapter; ``AdapterError`` for anything it cannot merge, before any weight is read."""
    from moetune.adapters.save import read_tensors
    from moetune.loading.load import plan_load
    from moetune.loading.options import LoadOptions

    folder = check_adapter_folder(
        adapter_path
    ).folder  # the folder alone first: no checkpoint header read for it
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
        edits.setdefault(key, []).append(change)

    tensors = pairs.tensors
    fused_prefixes = tuple(PREFIX + p for p in pairs.fused_paths)
    for key in sorted(tensors):
        if not key.endswith(".lora_A.weight") or key.startswith(fused_prefixes):
            continue
        module = key.removeprefix(PREFIX).removesuffix(".lora_A.weight")
        a, b = tensors[key], tensors[f"{PREFIX}{module}.lora_B.weight"]
        edit(pairs.weights[module], _add_pair(a, b, scale), (b.shape[0], a.shape[1]), f"the LoRA of {module}")
    layers = {layer.site.path: layer for layer in planned.plan.layers}
    for path in pairs.fused_paths:
        experts = planned.model.get_submodule(path)  # on the meta device: shapes only
        params = {n: tuple(p.shape) for n, p in experts.named_parameters(recurse=False) if p.dim() == 3}
        flagged = bool(getattr(experts, "is_transposed", False))
        sources = {s.role: s for s in layers[path].sources if s.expert is None and s.role not in ROLES}
        for param, prefix in expert_lora_prefixes(path, list(params), pairs.config).items():
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
            a, b = (tensors[f"{PREFIX}{prefix}.lora_{x}.weight"] for x in "AB")
            layout = layers[path].site.layout
            regroup = source.interleaved != layout.interleaved and param == "gate_up_proj"
            order = _FusedOrder(
                source.interleaved if regroup else None, 2 if layout.transposed else 1, source.swapped
            )
            shape = params[param]
            shape = (shape[0], shape[2], shape[1]) if source.swapped else shape

            delta = partial(_stored_fused_delta, a, b, shape[0], flagged, scale, order)
            edit(source.info.key, _add_fused(delta), shape, f"the fused LoRA of {path}.{param}")
    if pairs.whole:
        saved = read_tensors(folder / WEIGHTS_NAME)
        for stored, adapter_key in pairs.whole.items():
            value = saved[adapter_key]
            edit(
                stored,
                _replace(value),
                tuple(value.shape),
                f"{adapter_key} (a whole weight saved beside the LoRA)",
            )
    method = planned.method
    if method is not None:
        for key in sorted(k for k in edits if k in planned.quantized):
            if not method.writes:
                problems.append(
                    f"{key} is a {method.label} weight; moetune writes no {method.label} weights, so it cannot "
                    "merge into them. Use the adapter unmerged (moetune generate / chat, or moetune export for "
                    "vLLM / SGLang)"
                )
    if problems:
        raise AdapterError(
            f"adapter {folder} cannot be merged into {planned.checkpoint.path}:{listing(problems)}"
        )
    return MergePlan(planned, edits)


def _left_out(model: Path, checkpoint: Checkpoint) -> tuple[list[Path], list[str]]:
    """(files to copy as they are, entries left out) of the model folder beside its safetensors shards."""
    shards = set(checkpoint.files)
    other = {p.name for pattern in OTHER_WEIGHT_PATTERNS for p in model.glob(pattern)}
    copy, left = [], []
    for entry in sorted(model.iterdir()):
        if entry.name in shards:
            continue
        if entry.is_file() and entry.name not in other and not entry.name.startswith("."):
            copy.append(entry)
        else:
            left.append(entry.name + ("/" if entry.is_dir() else ""))
    return copy, left


def _write_shard(
    plan: MergePlan, stored: Checkpoint, reader: ShardReader, name: str, owner: dict[str, str], path: Path
) -> None:
    """Shard ``name`` again at ``path``: its tensors in the same names, dtypes and shapes, those of edited weights
    (``owner``: stored key -> logical weight) merged, the others as stored; its metadata with the merge's mark.
    One weight's parts at a time are held (a part in another shard is computed again there)."""
    from safetensors import safe_open

    from moetune.tensorfile import write_streamed

    with safe_open(str(stored.file_path(name)), "pt") as f:
        metadata = dict(f.metadata() or {})
    placeholders = {
        k: torch.empty(info.shape, dtype=reader_dtype(stored, k), device="meta")
        for k, info in stored.tensors.items()
        if info.file == name
    }
    done: dict[str, torch.Tensor] = {}  # parts of merged weights not written yet
    merged: set[str] = set()

    def produce(k: str) -> torch.Tensor:
        if (
            k in owner and owner[k] not in merged
        ):  # every part of the weight at once; each dropped once written
            merged.add(owner[k])
            done.update(plan.merged(owner[k], reader))
        return (
            done.pop(k) if k in done else reader.read(stored.tensors[k])
        )  # a part the merge keeps as stored

    # by name: a weight's parts come one after the other, so only one weight's are held at a time
    write_streamed(path, placeholders, {**metadata, **MERGE_MARK}, produce=produce, by_name=True)


def _write_all(
    plan: MergePlan,
    stored: Checkpoint,
    staged: Path,
    by_file: dict[str, set[str]],
    owner: dict[str, str],
    copy: list[Path],
    adapter: Path,
    progress: bool,
) -> tuple[list[str], list[str]]:
    """Every file of the merged checkpoint into ``staged``: the shards (rewritten where ``by_file`` has edits,
    else copied), the other files of the model folder, the adapter's tokenizer files; (written, copied) names."""
    from tqdm.auto import tqdm

    from moetune.atomic import fsync

    written, copied = [], []
    total = sum(stored.file_path(f).stat().st_size for f in stored.files)
    with (
        ShardReader(stored, []) as reader,
        tqdm(total=total, desc="merging", unit="B", unit_scale=True, disable=not progress) as bar,
    ):
        for name in stored.files:
            if name not in by_file:
                shutil.copy2(stored.file_path(name), staged / name)
                copied.append(name)
            else:
                _write_shard(plan, stored, reader, name, owner, staged / name)
                written.append(name)
            bar.update(stored.file_path(name).stat().st_size)
    for path in copy:
        shutil.copy2(path, staged / path.name)
        copied.append(path.name)
    for name in TOKENIZER_FILES:
        if (adapter / name).is_file():
            shutil.copy2(adapter / name, staged / name)
    assert (staged / "config.json").is_file() and not (staged / CONFIG_NAME).exists()
    for path in staged.iterdir():
        fsync(path)
    return written, copied


def export_merged_checkpoint(
    model_path: str | Path,
    adapter_path: str | Path,
    out_dir: str | Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
    trust_remote_code: bool = False,
) -> MergeResult:
    """Merge the adapter in ``adapter_path`` into the checkpoint in ``model_path`` and write the result to
    ``out_dir`` (module docstring). ``out_dir`` must be new or empty, or with ``overwrite`` an earlier merge; never
    the adapter's or the model's folder (``OutputDirError``, before anything is read)."""
    out, staged = prepare_out(out_dir, adapter_path, model_path, overwrite, MERGE_MARK)
    plan = plan_merge(model_path, adapter_path, trust_remote_code=trust_remote_code)
    stored = Checkpoint.open(model_path)  # the shards as they are (the plan's view is the logical one)
    by_file: dict[str, set[str]] = {}
    owner: dict[str, str] = {}  # stored key -> the logical weight it is part of
    for key in plan.edits:
        for part in plan.stored_keys(key):
            by_file.setdefault(stored.tensors[part].file, set()).add(key)
            owner[part] = key
    copy, left = _left_out(stored.path, stored)
    staged.mkdir(parents=True)
    try:
        written, copied = _write_all(
            plan, stored, staged, by_file, owner, copy, Path(adapter_path).expanduser(), progress
        )
    except BaseException:  # a failed merge leaves nothing half-written beside out (and out as it was)
        shutil.rmtree(staged, ignore_errors=True)
        raise
    publish(staged, out)
    return MergeResult(sorted(plan.edits), written, copied, left)
