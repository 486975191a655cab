"""Routed-expert LoRA is an ordinary PEFT adapter: PEFT's own save, a plain ``Trainer``'s checkpoints and resume,
``disable_adapter``, ``add_adapter`` / ``set_adapter``, ``unload`` and merge errors, against stock PEFT on the
unmodified transformers model (and, for the saved files, against the keys stock PEFT itself writes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moetune.testing.tiny import VOCAB, save_tiny_model

ATOL = 1e-5  # float32 logits, moetune's engine vs transformers' experts: sums in different orders


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: save_tiny_model(f, root / f, tokenizer=False) for f in ("qwen3_moe", "gpt_oss")}


def _stock(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _attach(path: Path, targets=("q_proj", "experts")):
    from moetune.adapters import attach_lora
    from moetune.loading import load_model

    return attach_lora(
        load_model(path, device="cpu", dtype="float32", progress=False), rank=4, alpha=8, targets=targets
    )


def _randomize(model, seed: int = 7) -> None:
    """Every LoRA tensor random, so no LoRA path (nor a wrong row order) can hide."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (2, 11), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_save_pretrained_writes_what_stock_peft_writes_and_loads(checkpoints, family, tmp_path) -> None:
    """``PeftModel.save_pretrained`` itself (no moetune saver) writes the expert LoRA: the keys, shapes and dtypes
    stock PEFT writes when it adapts the unmodified model from the saved config, and stock
    ``PeftModel.from_pretrained`` on that model computes moetune's logits (gpt-oss: transposed experts with
    gate/up interleaved)."""
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file

    path = checkpoints[family]
    model = _attach(path)
    _randomize(model)
    ids = _ids()
    want = model.eval()(input_ids=ids).logits
    base = _stock(path)(input_ids=ids).logits
    assert (want - base).abs().max() > 0.1  # the adapter changes the logits a lot

    model.save_pretrained(tmp_path / "a")
    saved = load_file(tmp_path / "a" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    # qualified with its parent: PEFT 0.22 remaps bare names (apply.qualified_targets)
    assert config["target_modules"] == ["self_attn.q_proj"]
    reference = get_peft_model(_stock(path), LoraConfig.from_pretrained(tmp_path / "a"))
    ref_state = get_peft_model_state_dict(reference)
    assert {k: (v.shape, v.dtype) for k, v in saved.items()} == {
        k: (v.shape, v.dtype) for k, v in ref_state.items()
    }
    moe = [
        p for p, m in _stock(path).named_modules() if getattr(m, "gate_up_proj", torch.empty(0)).dim() == 3
    ]
    assert len(moe) >= 2
    for experts in moe:  # every MoE layer's expert LoRA, gate_up's wrapper nested inside down_proj's
        for key in ("base_layer.lora_A", "base_layer.lora_B", "lora_A", "lora_B"):
            assert f"base_model.model.{experts}.{key}.weight" in saved, (experts, key)

    loaded = PeftModel.from_pretrained(_stock(path), tmp_path / "a").eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=ATOL, rtol=0)


def test_plain_trainer_checkpoint_holds_expert_lora_and_resumes(checkpoints, tmp_path) -> None:
    """A plain transformers ``Trainer`` (no moetune subclass) checkpoints the expert LoRA through
    ``PeftModel.save_pretrained``; stock PEFT loads the checkpoint to the trained model's logits, and the
    Trainer's own ``resume_from_checkpoint`` puts every expert LoRA tensor back into a fresh model."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import Trainer, TrainingArguments

    path = checkpoints["qwen3_moe"]
    rows = torch.randint(4, VOCAB, (8, 10), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": r, "labels": r} for r in rows]

    def trainer(model, out: Path) -> Trainer:
        args = TrainingArguments(
            str(out),
            max_steps=2,
            save_steps=2,
            per_device_train_batch_size=4,
            learning_rate=1e-2,
            report_to=[],
            use_cpu=True,
            disable_tqdm=True,
        )
        return Trainer(model=model, args=args, train_dataset=data)

    model = _attach(path)
    trainer(model, tmp_path / "run").train()
    ckpt = tmp_path / "run" / "checkpoint-2"
    saved = load_file(ckpt / "adapter_model.safetensors")
    down_b = "base_model.model.model.layers.0.mlp.experts.lora_B.weight"
    assert saved[down_b].abs().max() > 0  # trained away from B = 0, and in the checkpoint
    ids = _ids()
    want = model.eval()(input_ids=ids).logits
    loaded = PeftModel.from_pretrained(_stock(path), ckpt).eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=ATOL, rtol=0)

    fresh = _attach(path)
    trainer(fresh, tmp_path / "resumed").train(resume_from_checkpoint=str(ckpt))  # at max_steps: loads only
    trained = dict(model.named_parameters())
    experts = {n: p for n, p in fresh.named_parameters() if ".mlp.experts." in n}
    assert experts and all(torch.equal(p, trained[n]) for n, p in experts.items())


def test_disable_adapter_runs_the_base_experts_and_unload_returns_them(checkpoints) -> None:
    """Expert LoRA only: under ``disable_adapter()`` the logits are the unmodified transformers model's; a
    forward's backward still uses its own LoRA when a disabled forward ran in between (TRL's DPO reference
    logits); ``merge_and_unload`` refuses with a clear error; ``unload()`` gives back the very ``CpuExperts``."""
    from moetune.adapters.apply import expert_modules
    from moetune.errors import AdapterError
    from moetune.layer import CpuExperts

    path = checkpoints["qwen3_moe"]
    model = _attach(path, targets=("experts",))
    _randomize(model)
    ids = _ids()
    base = _stock(path)(input_ids=ids).logits
    with model.disable_adapter():
        torch.testing.assert_close(model(input_ids=ids).logits, base, atol=ATOL, rtol=0)
    assert (model(input_ids=ids).logits - base).abs().max() > 0.1  # and back on after the context

    model(input_ids=ids, labels=ids).loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    with torch.no_grad(), model.disable_adapter():
        model(input_ids=ids)
    loss.backward()
    assert all(torch.equal(p.grad, want[n]) for n, p in model.named_parameters() if p.requires_grad)

    with pytest.raises(AdapterError, match="merging LoRA into routed experts .* not supported"):
        model.merge_and_unload()
    experts = [layer.experts for layer in expert_modules(model).values()]
    plain = model.unload()
    after = [m for m in plain.modules() if isinstance(m, CpuExperts)]
    assert len(after) == len(experts) == 2 and all(a is b for a, b in zip(after, experts))
    torch.testing.assert_close(plain(input_ids=ids).logits, base, atol=ATOL, rtol=0)


def test_add_adapter_and_set_adapter_switch_expert_lora(checkpoints, tmp_path) -> None:
    """A second adapter added with PEFT's own ``add_adapter`` (experts named in ``target_modules``, another rank)
    gets its own expert LoRA; ``set_adapter`` switches it with the attention LoRA. Each adapter, saved by
    ``save_pretrained`` (the second after ``to_stock_config``), loads in stock PEFT to the logits moetune
    computes with it active; saved as given (experts in ``target_modules``) it loads in moetune. Two adapters
    active at once on the experts raise a clear error."""
    from peft import LoraConfig, PeftModel

    from moetune.adapters import to_stock_config
    from moetune.adapters.load import load_model
    from moetune.errors import AdapterError

    path = checkpoints["qwen3_moe"]
    model = _attach(path)
    model.add_adapter("second", LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "experts"]))
    _randomize(model)
    model.save_pretrained(tmp_path / "as_given", selected_adapters=["second"])
    as_given = json.loads((tmp_path / "as_given" / "second" / "adapter_config.json").read_text())
    assert "experts" in as_given["target_modules"] and not as_given["target_parameters"]
    to_stock_config(model, "second")
    model.save_pretrained(tmp_path / "a")  # "default" in a/, "second" in a/second/
    ids = _ids()
    logits = {}
    for name, folder in (("default", tmp_path / "a"), ("second", tmp_path / "a" / "second")):
        model.set_adapter(name)
        logits[name] = model.eval()(input_ids=ids).logits
        stock = PeftModel.from_pretrained(_stock(path), folder).eval()
        torch.testing.assert_close(stock(input_ids=ids).logits, logits[name], atol=ATOL, rtol=0)
    assert (logits["default"] - logits["second"]).abs().max() > 0.1
    again = load_model(
        path, device="cpu", dtype="float32", progress=False, adapter=tmp_path / "as_given" / "second"
    )
    torch.testing.assert_close(again(input_ids=ids).logits, logits["second"], atol=1e-6, rtol=0)

    model.base_model.set_adapter(["default", "second"])
    with pytest.raises(AdapterError, match="one expert LoRA per call"):
        model(input_ids=ids)
