"""``check_adapter_folder`` accepts what stock PEFT saves (no false refusal), with and without the model config."""

from __future__ import annotations

import pytest

from moetune.adapters.check import check_adapter_folder
from moetune.errors import AdapterError
from moetune.testing.tiny import tiny_model


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], r".*\.self_attn\.(k|o)_proj"])
def test_stock_peft_adapter_passes(targets, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = tiny_model("qwen3_moe")
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    peft.save_pretrained(tmp_path)
    adapter = check_adapter_folder(tmp_path, model.config)
    assert adapter.r == 4 and adapter.lora_alpha == 8.0 and adapter.tensors
    assert check_adapter_folder(tmp_path).config == adapter.config


def test_stock_peft_adapter_of_a_wider_model_is_refused_by_shape(tmp_path):
    from peft import LoraConfig, get_peft_model

    wide = tiny_model("qwen3_moe", hidden_size=96, head_dim=24)
    get_peft_model(wide, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])).save_pretrained(tmp_path)
    check_adapter_folder(tmp_path)  # consistent on its own
    with pytest.raises(AdapterError, match=r"q_proj's lora_A \[4, 96\] .* expected \[4, 64\]"):
        check_adapter_folder(tmp_path, tiny_model("qwen3_moe").config)
