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


def test_lora_experts_file_is_checked_with_the_adapter(tmp_path):
    """moetune_lora_experts.safetensors beside a stock adapter: a file of whole blocks with moetune's metadata
    passes (on its own and against the model: its MoE blocks, its hidden size); an incomplete block, another
    dtype or a header without the sizes is an AdapterError naming the file, from the headers alone."""
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    from moetune.adapters.lora_experts import LoraExpertsSpec, expected_keys

    model = tiny_model("qwen3_moe")
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])).save_pretrained(tmp_path)
    experts = [
        p
        for p, m in model.named_modules()
        if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and m.gate_up_proj.dim() == 3
    ]
    blocks = [p.rpartition(".")[0] for p in experts]  # the MoE blocks (this tiny model has a dense layer too)
    spec = LoraExpertsSpec(2, 3, model.config.hidden_size)
    tensors = {k: torch.zeros(shape) for k, shape in expected_keys(spec, blocks).items()}
    file = tmp_path / "moetune_lora_experts.safetensors"
    save_file(tensors, str(file), metadata=spec.metadata())
    assert check_adapter_folder(tmp_path).lora_experts == spec
    assert check_adapter_folder(tmp_path, model.config).lora_experts == spec
    dense = {k.replace(blocks[0], "model.layers.1.mlp"): v for k, v in tensors.items()}
    assert "model.layers.1.mlp" not in blocks
    save_file(dense, str(file), metadata=spec.metadata())
    check_adapter_folder(tmp_path)  # whole blocks: consistent on its own
    with pytest.raises(AdapterError, match="tensors not expected model.layers.1.mlp.extra_experts"):
        check_adapter_folder(tmp_path, model.config)
    down = next(k for k in tensors if k.endswith("down_proj"))
    bad = {
        "missing": ({k: v for k, v in tensors.items() if k != down}, spec.metadata()),
        r"is F16": ({**tensors, down: tensors[down].half()}, spec.metadata()),
        "metadata format": (tensors, {}),
    }
    for message, (state, metadata) in bad.items():
        save_file(state, str(file), metadata=metadata)
        with pytest.raises(AdapterError, match=f"moetune_lora_experts.safetensors.*{message}"):
            check_adapter_folder(tmp_path)
