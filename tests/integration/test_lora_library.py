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
    # both projections' B (the outer layer's down, its base_layer's gate_up) moved from their zero init
    assert all(
        m.lora_B["default"].weight.abs().max() > 0 for e in experts.values() for m in (e, e.base_layer)
    )
    out = save_adapter(model, tmp_path / "adapter")
    assert (out / "adapter_model.safetensors").is_file()


def test_full_save_pretrained_refuses_but_the_peft_adapter_saves(tmp_path, model_dir) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from moetune.adapters import attach_lora
    from moetune.errors import SaveError

    model = _load(model_dir)
    # the experts live in the engine, not in parameters: a full checkpoint would silently lack them
    with pytest.raises(SaveError, match=r"model\.layers\.0\.mlp\.experts: .*moetune\.save_adapter"):
        model.save_pretrained(tmp_path / "full")
    assert not list((tmp_path / "full").glob("*.safetensors"))
    peft = attach_lora(model, rank=4, alpha=8, targets=("q_proj", "v_proj", "experts"))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    peft.save_pretrained(tmp_path / "peft")  # PEFT's own save: collects the state dict through its wrapper
    saved = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    live = {n.replace(".default", ""): p for n, p in peft.named_parameters() if ".lora_" in n}
    assert saved and all(torch.equal(t, live[k]) for k, t in saved.items())
    stock = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), tmp_path / "peft")
    q_b = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight"
    assert torch.equal(stock.state_dict()[q_b], live[q_b.replace(".default", "")])
    with pytest.raises(SaveError):  # the model under the adapter is still refused on its own
        peft.get_base_model().save_pretrained(tmp_path / "base")


def test_trl_sft_trainer_trains_expert_lora(tmp_path, model_dir) -> None:
    """The library path with TRL: load_model -> attach_lora -> trl.SFTTrainer with its defaults (gradient
    checkpointing on; conversational prompt/completion through the tokenizer's chat template, loss on the
    completion) -> save_adapter."""
    trl = pytest.importorskip("trl")
    import json

    from datasets import Dataset
    from transformers import AutoTokenizer

    from moetune.adapters import attach_lora, load_adapter_weights, save_adapter
    from moetune.adapters.apply import expert_modules

    rows = json.loads((ROOT / "examples/data/demo_train.json").read_text())[:48]
    data = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"{r['instruction']}\n{r['input']}"}],
                "completion": [{"role": "assistant", "content": r["output"]}],
            }
            for r in rows
        ]
    )
    model = attach_lora(_load(model_dir), rank=4, alpha=8)
    experts = expert_modules(model)
    before = {p: [t.detach().clone() for t in e.parameters()] for p, e in experts.items()}
    args = trl.SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_steps=6,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        logging_steps=1,
        max_length=32,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=AutoTokenizer.from_pretrained(model_dir)
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(losses) == 6 and max(losses[-2:]) < min(losses[:2])
    for path, module in experts.items():  # every expert LoRA tensor moved (B from its zero init)
        assert all(not torch.equal(a, b) for a, b in zip(module.parameters(), before[path])), path
    out = save_adapter(model, tmp_path / "adapter")
    fresh = attach_lora(_load(model_dir), rank=4, alpha=8)
    load_adapter_weights(fresh, out)  # the saved adapter holds the trained expert LoRA
    for path, module in expert_modules(fresh).items():
        assert all(torch.equal(a, b) for a, b in zip(module.parameters(), experts[path].parameters()))


def test_attaching_lora_says_nothing_about_transformers_deprecations(model_dir) -> None:
    """PEFT reads ``is_gradient_checkpointing``, which transformers 5 deprecates: every ``get_peft_model`` warned
    (in ``moetune demo`` too). moetune's attach says nothing a user cannot act on; other warnings still pass."""
    import warnings

    from moetune.adapters.apply import GRADIENT_CHECKPOINTING_DEPRECATION, attach_lora

    model = _load(model_dir)
    with warnings.catch_warnings(record=True) as direct:
        warnings.simplefilter("always")
        model.is_gradient_checkpointing  # noqa: B018 - what PEFT reads
    deprecated = [w for w in direct if GRADIENT_CHECKPOINTING_DEPRECATION in str(w.message)]
    if not deprecated:
        pytest.skip("this transformers does not deprecate is_gradient_checkpointing")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        attach_lora(model, rank=4, alpha=8, targets=("q_proj", "experts"))
        warnings.warn("a later warning", UserWarning, stacklevel=1)
    messages = [str(w.message) for w in seen]
    assert not [m for m in messages if GRADIENT_CHECKPOINTING_DEPRECATION in m], messages
    assert "a later warning" in messages  # the filter ended with the attach
