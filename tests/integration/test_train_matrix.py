"""Every supported family trains as shipped: ``moetune train`` against stock transformers + PEFT.

For each family moetune claims (the 10 text families and the 2 vision-language ones), a tiny random
checkpoint is saved to disk with a tokenizer and trained through the recipe ``moetune train`` runs
(``load_config`` on a LLaMA-Factory-style YAML, then ``run``): LoRA on all targets, 3 optimizer steps over
alpaca rows of different lengths (batches of 4, so every batch is padded), with gradient checkpointing on
and off and both activation policies. The reference is the same 3 steps run by a plain transformers
``Trainer`` on the unmodified transformers model with stock PEFT, started from moetune's initial adapter
(loaded with ``PeftModel.from_pretrained``), same data order, same optimizer. Then: the saved adapter loads
in stock PEFT to moetune's logits, and a run resumed from the step-2 checkpoint reaches the same step-3 loss.

The DeepSeek-V3 shared-experts overlap crashed on step 2 here (a result handed across steps by address).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import yaml

from moetune.config import load_config
from moetune.testing.tiny import TINY_FAMILIES, save_tiny_model

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "examples/data/demo_tokenizer"  # ids 0-16 (pad 0, bos 1, eos 2) fit every tiny vocab
FAMILIES = TINY_FAMILIES.names()
STEPS = 3
# float32 on both sides; Adam turns gradient differences of ~1e-7 into parameter differences of ~lr * 1e-7 /
# (sqrt(v) + eps), so three steps stay well inside this.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)


def test_the_matrix_covers_the_trained_families():
    """The 10 text and 2 vision-language families with a tiny builder (``TINY_FAMILIES``) train here; every other
    family that loads is checked exactly (logits and gradients) by tests/integration/test_families.py."""
    assert set(FAMILIES) == {
        *("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss"),
        *("ernie4_5_moe", "minimax", "qwen3_vl_moe", "qwen3_5_moe"),
    }


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    """64 alpaca rows of 1-12 input and 1-8 output words: every batch of 4 has different lengths."""
    root = tmp_path_factory.mktemp("data")
    words, rnd = ["a", "b", "c", "d", "e", "f", "g", "h"], random.Random(0)

    def text(n: int) -> str:
        return " ".join(rnd.choice(words) for _ in range(n))

    rows = [
        {"instruction": "say", "input": text(rnd.randint(1, 12)), "output": text(rnd.randint(1, 8))}
        for _ in range(64)
    ]
    (root / "rows.json").write_text(json.dumps(rows))
    (root / "dataset_info.json").write_text(
        json.dumps({"rows": {"file_name": "rows.json", "formatting": "alpaca"}})
    )
    return root


def _float_checkpoint(family: str, root: Path) -> tuple[Path, Path]:
    path = save_tiny_model(family, root / "m", tokenizer=False)
    return path, path


def _fp8_checkpoint(root: Path) -> tuple[Path, Path]:
    """DeepSeek-V3.1's release layout (FP8 e4m3 with 128 x 128 block scales), and its dequantized twin."""
    from moetune.testing.fp8_checkpoint import save_fp8_checkpoint

    ref = root / "dequantized"
    return save_fp8_checkpoint("deepseek_v3", root / "m", dequantized_path=ref), ref


def _mxfp4_checkpoint(root: Path) -> tuple[Path, Path]:
    """gpt-oss's release layout (MXFP4 experts: e2m1 blocks with e8m0 scales), and its twin dequantized by
    transformers' own MXFP4 code."""
    from moetune.testing.mxfp4_checkpoint import save_mxfp4_checkpoint

    ref = root / "dequantized"
    return save_mxfp4_checkpoint(root / "m", dequantized_path=ref), ref


def _kimi_int4_checkpoint(root: Path) -> tuple[Path, Path]:
    """Kimi-K2-Thinking's release layout (``kimi_k2``, compressed-tensors INT4 experts, sharded), and its twin
    with the experts dequantized (``q * s``) as a plain DeepSeek-V3 checkpoint."""
    from moetune.testing.kimi import save_kimi_thinking

    ref = root / "dequantized"
    return save_kimi_thinking(root / "m", dequantized_path=ref), ref


# name -> root -> (the checkpoint moetune trains on, the float checkpoint the reference trains on)
CHECKPOINTS = {
    **{f: (lambda root, f=f: _float_checkpoint(f, root)) for f in FAMILIES},
    "deepseek_v3-fp8": _fp8_checkpoint,
    "gpt_oss-mxfp4": _mxfp4_checkpoint,
    "kimi_k2-int4": _kimi_int4_checkpoint,
}


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, Path]:
    from transformers import AutoTokenizer

    path, ref = CHECKPOINTS[request.param](tmp_path_factory.mktemp(request.param))
    for folder in {path, ref}:
        AutoTokenizer.from_pretrained(str(TOKENIZER)).save_pretrained(folder)
    return request.param, path, ref


def _config(tmp: Path, model: Path, data: Path, **over) -> Path:
    cfg = {
        "model_name_or_path": str(model),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "lora",
        "lora_rank": 4,
        "lora_alpha": 8,
        "lora_dropout": 0.0,
        "lora_target": "all",
        "dataset": "rows",
        "dataset_dir": str(data),
        "cutoff_len": 64,
        "output_dir": str(tmp / "out"),
        "per_device_train_batch_size": 4,
        "learning_rate": 1e-3,
        "max_steps": STEPS,
        "logging_steps": 1,
        "save_steps": 2,
        "seed": 0,
        "report_to": "none",
        "moetune": {"device": "cpu", "num_threads": 1},
        **over,
    }
    path = tmp / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _losses(log_history: list[dict]) -> list[float]:
    return [h["loss"] for h in log_history if "loss" in h]


def _stock(path: Path):
    from transformers import AutoConfig

    from moetune.testing.tiny import auto_class

    return auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)


def _reference_losses(cfg_path: Path, model_path: Path, tmp: Path) -> list[float]:
    """The same steps on the unmodified transformers model at ``model_path`` with stock PEFT, from the
    initial adapter of the recipe configured by ``cfg_path``."""
    from peft import PeftModel
    from transformers import AutoTokenizer, Trainer, TrainingArguments

    from moetune.adapters import save_adapter
    from moetune.config import training_arguments_kwargs
    from moetune.train.data import prepare_datasets
    from moetune.train.recipe import setup

    cfg = load_config(cfg_path)
    peft_model, _, _ = setup(cfg, progress=False)  # the recipe's own initial adapter (seeded)
    save_adapter(peft_model, tmp / "init")
    del peft_model
    reference = PeftModel.from_pretrained(_stock(model_path), tmp / "init", is_trainable=True)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    data = prepare_datasets(cfg.data, tokenizer, seed=cfg.training.seed)
    kwargs = training_arguments_kwargs(cfg)
    kwargs.update(output_dir=str(tmp / "ref"), gradient_checkpointing=False, save_strategy="no")
    trainer = Trainer(
        model=reference,
        args=TrainingArguments(**kwargs, disable_tqdm=True),
        train_dataset=data.train,
        data_collator=data.collator,
        processing_class=tokenizer,
    )
    trainer.train()
    return _losses(trainer.state.log_history)


@pytest.fixture(scope="module")
def reference(checkpoint, data_dir, tmp_path_factory) -> list[float]:
    name, path, ref = checkpoint
    tmp = tmp_path_factory.mktemp(f"{name}-ref")
    losses = _reference_losses(_config(tmp, path, data_dir), ref, tmp)
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    return losses


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no-ckpt", "ckpt"])
@pytest.mark.parametrize("policy", ["retain", "recompute"])
def test_train_matches_stock_transformers_and_peft(
    checkpoint, data_dir, reference, tmp_path, checkpointing, policy
) -> None:
    from moetune.train.recipe import run

    name, path, _ = checkpoint
    cfg = _config(
        tmp_path,
        path,
        data_dir,
        gradient_checkpointing=checkpointing,
        moetune={"device": "cpu", "num_threads": 1, "activation_policy": policy},
    )
    result = run(load_config(cfg), progress=False)
    losses = _losses(result.trainer.state.log_history)
    assert len(losses) == STEPS
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), **LOSS_TOL)
    assert result.summary["final_train_loss"] == pytest.approx(losses[-1])


def test_adapter_loads_in_stock_peft_and_resume_continues(checkpoint, data_dir, reference, tmp_path) -> None:
    from peft import PeftModel

    from moetune.train.recipe import run

    name, path, ref = checkpoint
    result = run(load_config(_config(tmp_path, path, data_dir, gradient_checkpointing=True)), progress=False)
    out = tmp_path / "out"
    ids = torch.randint(4, 17, (2, 9), generator=torch.Generator().manual_seed(1))
    want = result.model.eval()(input_ids=ids).logits
    got = PeftModel.from_pretrained(_stock(ref), out).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    resumed = _config(
        tmp_path,
        path,
        data_dir,
        gradient_checkpointing=True,
        resume_from_checkpoint=str(out / "checkpoint-2"),
        output_dir=str(tmp_path / "resumed"),
    )
    again = run(load_config(resumed), progress=False)
    losses = _losses(again.trainer.state.log_history)
    assert len(losses) == STEPS  # the first two carried over from the checkpoint's trainer state
    assert losses[-1] == pytest.approx(_losses(result.trainer.state.log_history)[-1], abs=1e-6)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(reference), **LOSS_TOL)
