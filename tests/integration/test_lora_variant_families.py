"""Train-save-reload of LoRA (every target, routed experts included) on the families that run through an experts
variant: NemotronH's non-gated experts (tied rows in the engine, ``up_proj`` in PEFT's layout), Muse Spark's
per-expert output norm (``PostNormExperts``), LongCat-Flash's zero-computation experts (stock PEFT sizes gate_up's
LoRA by E + Z) and DeepSeek-V4 with ``lora_target: all`` (its grouped ``o_a_proj`` left out).

For each: the tiny survey checkpoint of the family (``moetune.testing.survey``), ``attach_lora`` on attention and
the routed experts, three Adam steps on the LM loss (every LoRA tensor random first, so a wrong row order or a missing
module cannot hide), ``save_adapter``; then stock ``PeftModel.from_pretrained`` on the plain transformers model
gives moetune's float32 logits, with the experts' adapter under the module's own parameter names.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# model type -> (lora targets: attention and the routed experts; the experts' target_parameters entry saved)
FAMILIES = {
    "nemotron_h": (("q_proj", "v_proj", "experts"), "mixer.experts.up_proj"),
    "muse_spark": (("q_proj", "v_proj", "experts"), "mlp.experts.gate_up_proj"),
    # stock PEFT sizes gate_up's LoRA by the E routed plus the Z zero-computation experts
    "longcat_flash": (("q_b_proj", "o_proj", "experts"), "mlp.experts.gate_up_proj"),
    # "all" leaves out DeepSeek-V4's grouped o_a_proj (an nn.Linear subclass with its own forward)
    "deepseek_v4": (("all",), "mlp.experts.gate_up_proj"),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory) -> tuple[str, Path]:
    from moetune.testing.families import survey_config
    from moetune.testing.survey import _random_model

    path = tmp_path_factory.mktemp(request.param) / "m"
    _random_model(survey_config(request.param), seed=0).save_pretrained(path)
    return request.param, path


def test_trained_expert_lora_reloads_in_stock_peft(family, tmp_path) -> None:
    from peft import PeftModel

    from moetune.adapters import attach_lora, save_adapter
    from moetune.adapters.load import load_model
    from moetune.errors import AdapterError

    name, path = family
    # explicit targets: stock PEFT refuses LoRA on NemotronH's Mamba out_proj, which "all" would select
    targets, saved_entry = FAMILIES[name]
    model = attach_lora(
        load_model(path, device="cpu", dtype="float32", progress=False), rank=4, alpha=8, targets=targets
    )
    gen = torch.Generator().manual_seed(7)
    lora = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert any(".experts." in n for n in lora)
    with torch.no_grad():
        for p in lora.values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ids = torch.randint(4, 96, (2, 12), generator=gen)
    before = {n: p.detach().clone() for n, p in lora.items()}
    opt = torch.optim.Adam(lora.values(), lr=1e-2)
    model.train()
    for _ in range(3):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    if name == "deepseek_v4":
        assert not any("o_a_proj" in n for n in lora)
        with pytest.raises(AdapterError, match=r"o_a_proj \(DeepseekV4GroupedLinear\)(.|\n)*leave them out"):
            attach_lora(
                load_model(path, device="cpu", dtype="float32", progress=False), targets=("o_a_proj",)
            )
    moved = [n for n, p in lora.items() if ".experts." in n and not torch.equal(p, before[n])]
    assert moved, "the experts' LoRA did not train"
    want = model.eval()(input_ids=ids).logits

    save_adapter(model, tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved_entry in saved["target_parameters"]
    stock = type(model.get_base_model()).from_pretrained(path, dtype=torch.float32).eval()
    base = stock(input_ids=ids).logits
    assert (want - base).abs().max() > 1e-2  # the adapter changes the logits
    loaded = PeftModel.from_pretrained(stock, tmp_path / "adapter").eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-5, rtol=0)


def test_dbrx_trains_attention_lora_and_refuses_expert_lora_before_training(tmp_path) -> None:
    """DBRX's flat expert matrices have no per-expert LoRA in stock PEFT: asking for it is an AdapterError at
    attach time; attention LoRA trains and reloads in stock PEFT."""
    from peft import PeftModel

    from moetune.adapters import attach_lora, save_adapter
    from moetune.adapters.load import load_model
    from moetune.errors import AdapterError
    from moetune.testing.families import survey_config
    from moetune.testing.survey import _random_model

    path = tmp_path / "m"
    _random_model(survey_config("dbrx"), seed=0).save_pretrained(path)
    with pytest.raises(AdapterError, match=r"flat \[E\*I, H\] matrices(.|\n)*Wqkv,out_proj"):
        attach_lora(load_model(path, device="cpu", dtype="float32", progress=False), rank=4, alpha=8)
    model = attach_lora(
        load_model(path, device="cpu", dtype="float32", progress=False),
        rank=4,
        alpha=8,
        targets=("Wqkv", "out_proj"),
    )
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    ids = torch.randint(4, 96, (2, 12), generator=gen)
    want = model.eval()(input_ids=ids).logits
    save_adapter(model, tmp_path / "adapter")
    stock = type(model.get_base_model()).from_pretrained(path, dtype=torch.float32).eval()
    loaded = PeftModel.from_pretrained(stock, tmp_path / "adapter").eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-5, rtol=0)
    again = load_model(path, device="cpu", dtype="float32", progress=False, adapter=tmp_path / "adapter")
    torch.testing.assert_close(again(input_ids=ids).logits, want, atol=1e-6, rtol=0)
