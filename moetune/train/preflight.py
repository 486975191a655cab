"""Checks ``moetune train`` runs after the config parses and before the model loads.

Everything here reads headers, small files and a model built on the meta device, so a mistake costs seconds,
not a load of hundreds of GB of experts followed by a traceback at the first save or resume:

- ``output_dir`` can be written: a file is created and removed in it (or in its nearest existing parent);
- the model folder: ``load_model``'s own planning (config.json, safetensors headers, architecture, expert
  layout) on a meta-device model, no integer-typed float weight (which transformers would silently cast),
  and tokenizer files present;
- ``lora_target`` resolves on that meta-device model with ``attach_lora``'s own resolution;
- the checkpoint to resume from is complete (:func:`check_resume_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from moetune.config import MoetuneConfig
from moetune.config.schema import FinetuningType
from moetune.errors import AdapterError, CheckpointError, LoadError, MoetuneError, OutputDirError, listing
from moetune.train.guards import checkpoints
from moetune.train.modes import ModeSettings

logger = logging.getLogger(__name__)

# files of which a model folder needs at least one for transformers to build its tokenizer
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tiktoken.model",
)
TRAINER_STATE = "trainer_state.json"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# integer safetensors codes; a float weight stored so is a mistake unless a quantization method reads it
_INTEGER_CODES = ("I64", "I32", "I16", "I8", "U8", "BOOL")
_PEFT_PREFIX = "base_model.model."


def check_before_load(
    cfg: MoetuneConfig, dtype: str, modes: ModeSettings, *, write_probe: bool = True
) -> Any:
    """Every check of this module, in order, for a model to be loaded in ``dtype`` and trained as ``modes``
    says (``moetune.train.modes``: its checks run on the same meta-device model); raises the first problem's
    ``MoetuneError``. ``write_probe``: whether this process writes the probe file in ``output_dir`` (the main
    process of a multi-process run only: one writer per file). Returns the load it planned
    (``moetune.loading.load.PlannedLoad``), for ``load_model(planned=)``: the meta-device model is built once."""
    from moetune.adapters.apply import check_router_dropout, resolve_targets
    from moetune.engine.kernels import check_kernels_env
    from moetune.loading.load import plan_load
    from moetune.loading.options import LoadOptions
    from moetune.train.modes import check_mode_planned

    check_kernels_env()  # MOETUNE_KERNELS, read by every engine the load builds
    if write_probe:
        check_output_dir(cfg.training.output_dir)
    model_path = cfg.model.model_name_or_path
    planned = plan_load(
        model_path,
        LoadOptions.create(
            dtype=dtype,
            experts=cfg.engine.experts,
            trust_remote_code=cfg.model.trust_remote_code,
        ),
    )
    check_weight_dtypes(planned)
    check_tokenizer_files(Path(model_path))
    experts = [site.path for site in planned.sites]
    check_mode_planned(planned, cfg.engine.experts, modes)
    if modes.trains_base:  # the experts' optimizer comes from optim / optim_args: refuse an unusable one now
        from moetune.train.expert_optim import spec_of_config

        spec_of_config(cfg)
    lora = modes.method is FinetuningType.LORA
    targets = resolve_targets(planned.model, cfg.finetune.lora_target, experts)
    if lora:
        check_router_dropout(targets, cfg.finetune.lora_dropout)
    resume = resume_checkpoint(cfg)
    if resume is not None:
        lora_paths = {*targets.linear, *targets.experts, *targets.routers} if lora else None
        check_resume_checkpoint(resume, cfg, lora_paths)
    return planned


def check_output_dir(out: Path) -> None:
    """``OutputDirError`` unless a file can be created (and is then removed) in ``out``, or in its nearest
    existing parent when ``out`` does not exist yet (the Trainer creates it at the first save)."""
    probe = out
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise OutputDirError(
            f"output_dir {out}: {probe} is a file, not a folder, so {out} cannot be created; "
            "choose an output_dir whose parents are folders"
        )
    try:
        fd, name = tempfile.mkstemp(prefix=".moetune-write-test-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        raise OutputDirError(
            f"output_dir {out}: cannot write in {probe} ({err.strerror or err}); checkpoints and the adapter "
            "would fail at the first save, after the training. Choose a writable output_dir or fix its permissions"
        ) from None


def check_weight_dtypes(planned: Any) -> None:
    """``LoadError`` for a non-expert weight stored as integers where the model holds floats (an unquantized
    checkpoint's ``q_proj`` saved as I32 would otherwise be cast silently)."""
    if planned.method is not None:  # quantized: the method reads its codes and scales (moetune.loading.quant)
        return
    meta = planned.model.state_dict()
    bad = []
    for key in planned.plan.other_keys:
        info, dest = planned.checkpoint.tensors[key], planned.targets[key]
        target = meta.get(dest.target)
        if target is not None and target.is_floating_point() and info.dtype in _INTEGER_CODES:
            bad.append(f"{info.file}: {key} is stored as {info.dtype}")
    if bad:
        raise LoadError(
            f"checkpoint {planned.checkpoint.path}: {len(bad)} weight(s) the model holds as floating point are "
            f"stored as integers, which would be cast without scaling:{listing(bad)}\nA quantized checkpoint "
            "needs its quantization_config in config.json; otherwise re-save these weights in F32/BF16/F16"
        )


def check_tokenizer_files(model_path: Path) -> None:
    """``LoadError`` when the model folder has none of the files a tokenizer is built from (transformers would
    otherwise build an empty one and the data step would report a missing chat template)."""
    if (
        model_path.is_dir()
        and not any((model_path / f).is_file() for f in TOKENIZER_FILES)
        and not any(model_path.glob("*.tiktoken"))
    ):
        raise LoadError(
            f"{model_path} has no tokenizer files (looked for {', '.join(TOKENIZER_FILES)}, *.tiktoken); copy the "
            "tokenizer of the model (tokenizer.json and tokenizer_config.json) into the folder"
        )


def load_tokenizer(cfg: MoetuneConfig) -> Any:
    """The model's tokenizer (``moetune.loading.hf.load_tokenizer``), with an unreadable tokenizer file reported as a
    ``LoadError`` naming the folder rather than a tokenizers or JSON traceback."""
    from moetune.loading.hf import load_tokenizer as load

    path = Path(cfg.model.model_name_or_path)
    check_tokenizer_files(path)
    try:
        return load(path, cfg.model.trust_remote_code)
    except MoetuneError:
        raise
    except (
        OSError,
        ValueError,
        TypeError,
        KeyError,
    ) as err:  # tokenizers' and json's errors on damaged files
        raise LoadError(
            f"cannot build the tokenizer from {path} (is tokenizer.json or tokenizer_config.json damaged?): "
            f"{type(err).__name__}: {err}"
        ) from None


def resume_checkpoint(cfg: MoetuneConfig) -> Path | None:
    """The checkpoint folder the run resumes from: the config's path, or for ``true`` the newest
    ``checkpoint-N`` in output_dir (as ``Trainer.train`` picks it), or None."""
    resume = cfg.training.resume_from_checkpoint
    if isinstance(resume, Path):
        return resume
    if resume is True:
        from transformers.trainer_utils import get_last_checkpoint

        last = get_last_checkpoint(str(cfg.training.output_dir))
        if last:
            check_one_run(cfg.training.output_dir, Path(last))
        return Path(last) if last else None
    return None


def check_one_run(output_dir: Path, last: Path) -> None:
    """``CheckpointError`` when ``output_dir``'s checkpoints are not one run's. Within one run (resumed or not)
    each checkpoint's logged history (``trainer_state.json``'s ``log_history``) begins with every earlier one's;
    a lower step whose history is not how ``last``'s (the highest step, what ``resume_from_checkpoint: true``
    takes) begins is another run's: one that overwrote the folder (``overwrite_output_dir``) without removing an
    earlier run's checkpoints, so resuming the highest step would continue the other run. (Histories, not file
    times: a copied folder keeps them.)"""

    def history(folder: Path) -> list | None:
        try:
            found = json.loads((folder / TRAINER_STATE).read_text()).get("log_history")
        except (OSError, ValueError, AttributeError):
            return None
        return found if isinstance(found, list) else None

    top = history(last)
    if not top:
        return
    other = []
    for _, folder in sorted(checkpoints(output_dir)):
        own = history(folder) if folder != last else None
        if own and json.dumps(own) != json.dumps(top[: len(own)]):  # as text: a logged nan
            other.append(folder)
    if other:
        raise CheckpointError(
            f"resume_from_checkpoint: true would take {last}, the highest step in {output_dir}, but the logged "
            f"history of {listing([p.name for p in other], inline=True)} is not how its history begins: the folder "
            "holds the checkpoints of more than one run (overwrite_output_dir does not remove an earlier run's). "
            "Set resume_from_checkpoint to the checkpoint to continue, or remove the other run's checkpoints"
        )


def checkpoint_problems(folder: Path, cfg: MoetuneConfig, targets: set[str] | None) -> list[str]:
    """What is wrong with checkpoint ``folder`` for a run of ``cfg`` whose LoRA goes on module paths ``targets``
    (None: a full/freeze run, no adapter): unreadable files (torch ``.pt``/``.pth``/``.bin`` zip directories, the
    safetensors header and data size, JSON files), NaN/Inf in the adapter's values, and an adapter whose rank,
    alpha, rsLoRA or modules differ from the run's."""
    from moetune.tensorfile import read_header

    problems = []
    for name in (TRAINER_STATE, ADAPTER_CONFIG, ADAPTER_WEIGHTS) if targets is not None else (TRAINER_STATE,):
        if not (folder / name).is_file():
            problems.append(f"{name} is missing")
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        try:
            if path.suffix in (".pt", ".pth", ".bin"):
                with zipfile.ZipFile(path) as archive:  # torch.save writes a zip; its directory is at the end
                    archive.infolist()
            elif path.suffix == ".safetensors":
                read_header(path)
            elif path.suffix == ".json":
                json.loads(path.read_text())
        except (zipfile.BadZipFile, LoadError, ValueError, OSError) as err:
            problems.append(f"{path.name} is damaged or truncated ({err})")
    if (
        targets is not None
    ):  # the adapter's values (LoRA-sized, read one tensor at a time): a NaN would resume
        problems += _non_finite_adapter(folder)
    if problems:
        return problems
    state = json.loads((folder / TRAINER_STATE).read_text())
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        problems.append(f"{TRAINER_STATE} has no global_step: not a Trainer state")
    if targets is None:
        from transformers.utils import SAFE_WEIGHTS_NAME

        from moetune.train.fsdp import FSDP_MODEL
        from moetune.train.layered import MODEL_INDEX

        weights = (SAFE_WEIGHTS_NAME, MODEL_INDEX, FSDP_MODEL)
        if (folder / ADAPTER_CONFIG).is_file() and not any((folder / n).is_file() for n in weights):
            problems.append(  # transformers failed on it with "Can't find a checkpoint index", after the load
                f"it is a LoRA run's checkpoint ({ADAPTER_CONFIG}, no model weights) and this config trains "
                f"finetuning_type {cfg.finetune.finetuning_type.value}: resume it with finetuning_type: lora"
            )
        return problems
    adapter = json.loads((folder / ADAPTER_CONFIG).read_text())
    ft = cfg.finetune
    for key, saved, want in (
        ("lora_rank", adapter.get("r"), ft.lora_rank),
        ("lora_alpha", adapter.get("lora_alpha"), ft.lora_alpha),
        ("use_rslora", adapter.get("use_rslora", False), ft.use_rslora),
    ):
        if saved != want:
            problems.append(f"{ADAPTER_CONFIG} was trained with {key} {saved}; this config has {key} {want}")
    problems += _lora_experts_problems(folder, cfg)
    saved_modules = {
        key.removeprefix(_PEFT_PREFIX).split(".lora_")[0].removesuffix(".base_layer")
        for key in read_header(folder / ADAPTER_WEIGHTS)
        if ".lora_" in key  # modules_to_save (additional_target) keep whole weights beside the LoRA
    }
    if saved_modules != targets:
        extra, missing = _leaves(saved_modules - targets), _leaves(targets - saved_modules)
        problems.append(
            f"{ADAPTER_WEIGHTS} holds LoRA on other modules than this config's lora_target "
            f"{list(ft.lora_target)} selects (modules only in the checkpoint: {listing(extra, inline=True) or 'none'}; "
            f"only in this run: {listing(missing, inline=True) or 'none'})"
        )
    return problems


def _non_finite_adapter(folder: Path) -> list[str]:
    """The checkpoint's adapter files holding NaN/Inf (``adapters.check.scan_file_values``), one line each."""
    from moetune.adapters.check import scan_file_values
    from moetune.adapters.lora_experts import FILE_NAME

    problems = []
    for path in (folder / ADAPTER_WEIGHTS, folder / FILE_NAME):
        if path.is_file():
            try:
                scan_file_values(path)
            except AdapterError as err:
                problems.append(str(err).replace(f"{folder}/", "", 1))
    return problems


def _lora_experts_problems(folder: Path, cfg: MoetuneConfig) -> list[str]:
    """The checkpoint's LoRA experts (``moetune.adapters.lora_experts``) against the config's: both absent, or the
    same N and I'."""
    from moetune.adapters.lora_experts import FILE_NAME, read_spec

    ft = cfg.finetune
    if not (folder / FILE_NAME).is_file():
        return (
            [f"{FILE_NAME} is missing; this config has lora_experts {ft.lora_experts}"]
            if ft.lora_experts
            else []
        )
    spec = read_spec(folder / FILE_NAME)
    saved = (spec.num_experts, spec.intermediate_size)
    if saved != (ft.lora_experts, ft.lora_expert_intermediate_size):
        return [
            f"{FILE_NAME} holds LoRA experts N={saved[0]}, I'={saved[1]}; this config has lora_experts "
            f"{ft.lora_experts}, lora_expert_intermediate_size {ft.lora_expert_intermediate_size}"
        ]
    return []


def _leaves(paths: set[str]) -> list[str]:
    """Module names without their layer paths (``model.layers.3.self_attn.k_proj`` -> ``k_proj``), for messages."""
    return sorted({p.rpartition(".")[2] for p in paths})


def check_resume_checkpoint(folder: Path, cfg: MoetuneConfig, targets: set[str] | None) -> None:
    """``CheckpointError`` naming each damaged file or mismatch of ``folder`` and the newest other checkpoint
    beside it that passes the same checks."""
    problems = checkpoint_problems(folder, cfg, targets)
    if not problems:
        check_steps_left(folder, cfg)
        for note in resume_notes(folder, cfg):
            logger.warning("moetune: resume_from_checkpoint %s: %s", folder, note)
        return
    others = [path for _, path in sorted(checkpoints(folder.parent), reverse=True) if path != folder]
    good = next((p for p in others if not checkpoint_problems(p, cfg, targets)), None)
    offer = (
        f"The previous complete checkpoint is {good}: set resume_from_checkpoint: {good}"
        if good is not None
        else "No other checkpoint beside it passes these checks: remove resume_from_checkpoint to start over"
    )
    raise CheckpointError(
        f"resume_from_checkpoint {folder} cannot be resumed:{listing(problems)}\n{offer} (or restore the "
        "damaged files; a run whose LoRA settings changed cannot resume another's checkpoint)."
    )


def check_token_ids(tokenizer: Any, data: Any, planned: Any) -> None:
    """``DataError`` when the tokenized rows hold an id past the model's embedding rows (a tokenizer with tokens
    added after the checkpoint was saved): the embedding lookup failed with an ``IndexError`` once the model had
    loaded. The rows are read only when the tokenizer is larger than the embedding."""
    from moetune.errors import DataError

    rows = planned.model.get_input_embeddings().num_embeddings
    if len(tokenizer) <= rows:
        return
    for name, split in (("training", data.train), ("evaluation", data.eval)):
        columns = [c for c in split.column_names if c.endswith("input_ids")] if split is not None else []
        top = max(
            (max(ids) for c in columns for ids in split[c] if ids), default=-1
        )  # preference: chosen_...
        if top >= rows:
            raise DataError(
                f"the {name} rows hold token id {top}, but the model's embedding has {rows} rows (ids 0 .. "
                f"{rows - 1}); the tokenizer has {len(tokenizer)} tokens: tokens were added to it after the "
                "checkpoint was saved. Use the checkpoint's own tokenizer, or resize the model's embeddings first"
            )


def resume_notes(folder: Path, cfg: MoetuneConfig) -> list[str]:
    """What resuming checkpoint ``folder`` will not do as the config asks, one line each (said, not refused:
    transformers resumes so, and LLaMA-Factory alike): a checkpoint without the optimizer's or the scheduler's
    state (``save_only_model``) restarts them, and a scheduler's state restores the learning rate it was built
    with, whatever ``learning_rate`` says now."""
    import torch
    from transformers.trainer import SCHEDULER_NAME

    from moetune.train.fsdp import DDP_OPTIMIZER, FSDP_OPTIMIZER
    from moetune.train.layered import OPTIMIZER_INDEX

    notes = []
    lost = [
        what
        for what, names in (
            # the Trainer's (FSDP: .bin), and moetune's layer by layer under full / freeze (its index)
            ("optimizer", (DDP_OPTIMIZER, FSDP_OPTIMIZER, OPTIMIZER_INDEX)),
            ("scheduler", (SCHEDULER_NAME,)),
        )
        if not any((folder / name).is_file() for name in names)
    ]
    if lost:
        notes.append(
            f"it holds no {' or '.join(lost)} state (saved with save_only_model: true?), so the run continues from "
            f"its weights and step count with {' and '.join(lost)} started afresh ("
            + ", ".join(
                {
                    "optimizer": "AdamW's moments from zero",
                    "scheduler": "the learning-rate schedule from its start",
                }[w]
                for w in lost
            )
            + "): not an exact resume"
        )
    if "scheduler" not in lost:
        try:
            state = torch.load(folder / SCHEDULER_NAME, map_location="cpu", weights_only=True)
        except Exception:  # noqa: BLE001 - another scheduler's pickle: nothing to compare, transformers loads it
            state = None
        base = state.get("base_lrs") if isinstance(state, dict) else None
        want = cfg.training.learning_rate
        if isinstance(base, list) and base and not math.isclose(float(base[0]), want, rel_tol=1e-6):
            notes.append(
                f"its learning-rate schedule was built for learning_rate {base[0]:g} and the Trainer restores it, "
                f"so learning_rate {want:g} in this config has no effect on the resumed run (start a new run to "
                "change it)"
            )
    return notes


def check_steps_left(folder: Path, cfg: MoetuneConfig) -> None:
    """``CheckpointError`` when checkpoint ``folder`` already reached the run's last step (``max_steps``, or for an
    epoch-based run the saved state's own ``max_steps`` when ``num_train_epochs`` is unchanged).

    transformers 5.24's loop tests for the last step only after an optimizer step, so resuming a finished run
    would train one step past it and overwrite the final adapter.
    """
    state = json.loads((folder / TRAINER_STATE).read_text())
    step, tr = state["global_step"], cfg.training
    if tr.max_steps > 0:
        last, key = tr.max_steps, f"max_steps {tr.max_steps}"
    elif state.get("num_train_epochs") == tr.num_train_epochs and isinstance(state.get("max_steps"), int):
        last, key = state["max_steps"], f"num_train_epochs {tr.num_train_epochs} ({state['max_steps']} steps)"
    else:
        return
    if step >= last:
        raise CheckpointError(
            f"resume_from_checkpoint {folder} is at step {step}, which already reaches {key}: there is nothing left "
            f"to train, and that checkpoint holds the run's final weights (use it as the adapter or model, e.g. "
            f"--adapter {folder}). Raise max_steps (or num_train_epochs) to train further, or remove "
            "resume_from_checkpoint"
        )
