"""``check_adapter_folder`` accepts a good adapter of every tiny family (no false refusal: shared experts, dense
MLPs targeted by weight, transposed and interleaved experts, vision-language models), and refuses it against
a wider model's config."""

from __future__ import annotations

import pytest

from moetune.adapters import attach_lora, save_adapter
from moetune.adapters.check import check_adapter_folder
from moetune.errors import AdapterError
from moetune.loading import hf, load_model
from moetune.loading.checkpoint import Checkpoint
from moetune.testing.tiny import TINY_FAMILIES, save_tiny_model


@pytest.mark.slow
@pytest.mark.parametrize("family", TINY_FAMILIES.names())
def test_good_adapter_passes_the_check_for_its_model_only(family, tmp_path):
    path = save_tiny_model(family, tmp_path / "m", tokenizer=False)
    peft = attach_lora(load_model(path, device="cpu", dtype="float32", progress=False), rank=4, alpha=8)
    save_adapter(peft, tmp_path / "a")
    adapter = check_adapter_folder(tmp_path / "a", hf.load_config(Checkpoint.open(path)))
    assert adapter.r == 4 and any("experts" in k for k in adapter.tensors)
    other_path = save_tiny_model(
        "qwen3_moe", tmp_path / "other", tokenizer=False, hidden_size=96, head_dim=24
    )
    with pytest.raises(AdapterError, match="(?i)was the adapter saved for this model"):
        check_adapter_folder(tmp_path / "a", hf.load_config(Checkpoint.open(other_path)))
