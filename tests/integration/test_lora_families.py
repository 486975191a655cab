"""``lora_target: all`` across families, against stock transformers + PEFT loading the saved adapter.

qwen2_moe (shared expert + its gate, dense layers), deepseek_v3 (first_k_dense_replace dense MLP, shared
experts: names PEFT rewrites into routed-expert targets for this model type, so they are saved as
``target_parameters`` on their weights) and gpt_oss (transposed experts with gate/up interleaved and biases,
while the engine keeps gate rows first). For each: the modules carrying LoRA are exactly every ``nn.Linear``
but ``lm_head`` plus the fused experts (never the router), in moetune and in stock PEFT after loading; and
with every LoRA tensor random, stock ``PeftModel.from_pretrained`` on the plain transformers model and
``moetune.load_model(adapter=...)`` give moetune's float32 logits, and checkpoint resume restores every tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from moetune.testing.tiny import VOCAB, save_tiny_model

FAMILIES = ("qwen2_moe", "deepseek_v3", "gpt_oss")
# what "all" must reach beyond attention, by family (module paths of the tiny models)
MUST_TARGET = {
    "qwen2_moe": ("model.layers.0.mlp.gate_proj", "model.layers.1.mlp.shared_expert.up_proj"),
    "deepseek_v3": ("model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.gate_proj"),
    "gpt_oss": ("model.layers.0.mlp.experts",),
}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, save_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "m")


def expected_sites(stock: nn.Module) -> set[str]:
    """From the plain transformers model alone: every nn.Linear but lm_head, and every fused experts module."""
    linear = {p for p, m in stock.named_modules() if isinstance(m, nn.Linear) and p != "lm_head"}
    experts = {
        p
        for p, m in stock.named_modules()
        if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and m.gate_up_proj.dim() == 3
    }
    return linear | experts


def lora_sites(peft_model: nn.Module) -> set[str]:
    """Module paths (of the wrapped model) carrying LoRA: PEFT's layers (in moetune, routed experts' too) with
    an adapter, nested ParamWrappers / expert LoRA layers collapsed."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    out = set()
    for path, m in peft_model.named_modules():
        if isinstance(m, BaseTunerLayer) and m.lora_A:
            path = path.removeprefix("base_model.model.")
            while path.endswith(".base_layer"):
                path = path.removesuffix(".base_layer")
            out.add(path)
    return out


def test_all_targets_every_linear_and_expert_and_round_trips_through_stock_peft(family, tmp_path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moetune.adapters import attach_lora, load_adapter_weights, save_adapter
    from moetune.adapters.load import load_model

    name, path = family
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = expected_sites(stock)
    assert set(MUST_TARGET[name]) <= expected
    routers = {p for p, m in stock.named_modules() if p.endswith((".mlp.gate", ".mlp.router"))}
    assert routers and not routers & expected

    model = attach_lora(load_model(path, device="cpu", dtype="float32", progress=False), rank=4, alpha=8)
    assert lora_sites(model) == expected
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # every A and B random: a wrong row order or a missing module cannot hide
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ids = torch.randint(4, VOCAB, (2, 12), generator=gen)
    base = stock(input_ids=ids).logits
    want = model.eval()(input_ids=ids).logits
    assert (want - base).abs().max() > 0.1  # the adapter changes the logits a lot

    save_adapter(model, tmp_path / "adapter")
    loaded = PeftModel.from_pretrained(stock, tmp_path / "adapter").eval()
    assert lora_sites(loaded) == expected
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    again = load_model(path, device="cpu", dtype="float32", progress=False, adapter=tmp_path / "adapter")
    assert lora_sites(again) == expected
    torch.testing.assert_close(again(input_ids=ids).logits, want, atol=1e-6, rtol=0)
    # checkpoint resume: the same file copied into freshly attached LoRA restores every tensor exactly
    fresh = attach_lora(load_model(path, device="cpu", dtype="float32", progress=False), rank=4, alpha=8)
    load_adapter_weights(fresh, tmp_path / "adapter")
    trained = dict(model.named_parameters())
    restored = {n: p for n, p in fresh.named_parameters() if "lora_" in n}
    assert restored and all(torch.equal(p, trained[n]) for n, p in restored.items())


@pytest.mark.parametrize("name", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_all_leaves_the_vision_tower_and_projector_frozen(name, tmp_path) -> None:
    """LLaMA-Factory's lora_target all skips its registry's vision keys and projector keys for these models
    (``visual.patch_embed`` / ``visual.blocks`` and ``visual.merger``, under its freeze_vision_tower and
    freeze_multi_modal_projector defaults); moetune, which trains on text, does the same, and a target naming
    only vision modules is an error that says why."""
    from moetune.adapters import attach_lora
    from moetune.adapters.load import load_model
    from moetune.errors import AdapterError

    path = save_tiny_model(name, tmp_path / "m", tokenizer=False)
    model = load_model(path, device="cpu", dtype="float32", progress=False)
    vision = {p for p, m in model.named_modules() if isinstance(m, nn.Linear) and ".visual." in f".{p}"}
    text = {
        p
        for p, m in model.named_modules()
        if isinstance(m, nn.Linear) and p.startswith("model.language_model.")
    }
    assert vision and text
    sites = lora_sites(attach_lora(model, rank=4, alpha=8))
    assert not {s for s in sites if ".visual." in f".{s}"}
    assert text <= sites
    with pytest.raises(AdapterError, match="outside the language model"):
        attach_lora(load_model(path, device="cpu", dtype="float32", progress=False), targets=("qkv",))


@pytest.mark.parametrize("name", ["qwen3_vl_moe", "qwen3_5_moe"])
def test_full_mode_leaves_the_vision_tower_frozen(name, tmp_path) -> None:
    """finetuning_type full trains the language model and lm_head; the vision tower and projector stay frozen
    (LLaMA-Factory's freeze_vision_tower / freeze_multi_modal_projector defaults), as they do under LoRA."""
    from moetune.adapters.load import load_model
    from moetune.config.schema import FinetuningType
    from moetune.train.modes import ModeSettings, apply_mode

    path = save_tiny_model(name, tmp_path / "m", tokenizer=False)
    model = apply_mode(
        load_model(path, device="cpu", dtype="float32", progress=False), ModeSettings(FinetuningType.FULL)
    )
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not {n for n in trainable if ".visual." in f".{n}"}
    assert any(n.startswith("model.language_model.") for n in trainable) and "lm_head.weight" in trainable
