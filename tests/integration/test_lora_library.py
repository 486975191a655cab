"""The library path: load_model -> attach_lora -> the user's own transformers Trainer -> save_adapter."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moetune.errors import AdapterError
from moetune.train.demo import make_demo_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("m") / "tiny", ROOT / "examples/data/demo_tokenizer")


def _load(path: Path):
    from moetune.loading import load_model

    return load_model(path, device="cpu", dtype="float32", progress=False)


def test_unmatched_target_lists_what_was_searched(model_dir) -> None:
    from moetune.adapters.apply import attach_lora

    with pytest.raises(AdapterError, match=r"matched no module.*q_proj"):
        attach_lora(_load(model_dir), targets=("qkv",))


def test_user_trainer_trains_expert_lora(tmp_path, model_dir) -> None:
    from transformers import Trainer, TrainingArguments

    from moetune.adapters import attach_lora, save_adapter
    from moetune.adapters.apply import expert_modules

    model = attach_lora(_load(model_dir), rank=4, alpha=8, targets=("q_proj", "v_proj", "experts"))
    experts = expert_modules(model)
    assert len(experts) == 2 and all(p.requires_grad for e in experts.values() for p in e.parameters())
    ids = torch.randint(4, 17, (8, 10))
    data = [{"input_ids": r, "labels": r} for r in ids]
    args = TrainingArguments(
        str(tmp_path / "o"),
        max_steps=2,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=data).train()
    assert all(e.lora_down_B.abs().max() > 0 for e in experts.values())
    out = save_adapter(model, tmp_path / "adapter")
    assert (out / "adapter_model.safetensors").is_file()
