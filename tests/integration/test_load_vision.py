"""Vision-language MoE models: Qwen3-VL-MoE and Qwen3.5-MoE with a vision config.

``load_model`` returns the checkpoint's ``...ForConditionalGeneration``; the language model's MoE layers run
in the engine, the vision tower stays an ordinary module on ``device``. The ``load_checks`` battery runs on
token ids and on image+text batches made by the real image processor (``moetune.testing.inputs``), against
transformers' ``AutoModelForImageTextToText``. Also: the transposed fused layout the Qwen3-VL releases store
(``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``), and which class a composite checkpoint loads into.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import moetune
from moetune.layer import CpuExperts
from moetune.loading.hf import model_class
from moetune.testing.inputs import image_text_inputs, labels_for, text_inputs
from moetune.testing.tiny import EXPERT_INTERMEDIATE as I
from moetune.testing.tiny import HIDDEN as H
from moetune.testing.tiny import NUM_EXPERTS as E
from moetune.testing.tiny import save_tiny_model, tiny_config
from tests.integration.load_checks import (  # noqa: F401  (collected here)
    FP32_LOGITS_TOL,
    family_fixture,
    test_bfloat16_error_bound,
    test_gradients,
    test_greedy_generation,
    test_logits_loss_and_aux_loss,
    test_structure,
)

pair = family_fixture("qwen3_vl_moe", "qwen3_5_moe")


@pytest.fixture(params=["text", "image"])
def make_inputs(request, pair):
    """The battery's batches: token ids only, or one image per sequence between the tokens."""
    config = pair[3].config

    def make(seed: int, batch: int = 2, seq: int = 14) -> dict:
        if request.param == "text":
            out = text_inputs(seed, batch, seq)
        else:
            out = image_text_inputs(config, seed, batch, seq)
        return {**out, "labels": labels_for(out["input_ids"], config)}

    return make


def _load(path, dtype="float32"):
    return moetune.load_model(path, device="cpu", dtype=dtype, progress=False, num_threads=1)


def test_experts_in_the_language_model_vision_tower_kept(pair):
    family, _, ref, model = pair
    assert type(model).__name__.endswith("ForConditionalGeneration")
    swapped = [n for n, m in model.named_modules() if isinstance(m, CpuExperts)]
    assert swapped and all(n.startswith("model.language_model.layers.") for n in swapped)
    visual = dict(model.model.visual.named_parameters())
    want = dict(ref.model.visual.named_parameters())
    assert visual.keys() == want.keys() and visual
    assert all(torch.equal(visual[n], want[n]) for n in want)
    assert not any(isinstance(m, CpuExperts) for m in model.model.visual.modules())


def test_image_changes_the_logits(pair):
    """The image path is live: the same tokens with another image give other logits (in both models)."""
    _, _, ref, model = pair
    batch = image_text_inputs(model.config, seed=0)
    other = {**batch, "pixel_values": image_text_inputs(model.config, seed=5)["pixel_values"]}
    with torch.no_grad():
        a, b = model(**batch).logits, model(**other).logits
        assert (a - ref(**batch).logits).abs().max().item() <= FP32_LOGITS_TOL
    assert (a - b).abs().max().item() > 1e-3


def test_image_gradients_reach_the_vision_tower(pair):
    """On image batches ``test_gradients`` compares the vision tower's gradients too: they exist."""
    _, _, _, model = pair
    batch = image_text_inputs(model.config, seed=2)
    model.zero_grad()
    model(**batch, labels=labels_for(batch["input_ids"], model.config)).loss.backward()
    grads = [p.grad for p in model.model.visual.parameters()]
    assert all(g is not None for g in grads) and sum(g.abs().sum().item() for g in grads) > 0
    model.zero_grad()


def test_transposed_fused_layout_of_the_releases(tmp_path):
    """Qwen3-VL checkpoints store ``x @ W`` experts: gate_up ``[E, H, 2I]``, down ``[E, I, H]``. transformers
    transposes them at load (``Transpose(1, 2, check_dims=True)``); moetune must read the same weights."""
    src = save_tiny_model("qwen3_vl_moe", tmp_path / "runtime", tokenizer=False)
    state = load_file(str(src / "model.safetensors"))
    fused = [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused and all(state[k].shape in ((E, 2 * I, H), (E, H, I)) for k in fused)
    dst = tmp_path / "release"
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    release = {k: v.transpose(1, 2).contiguous() if k in fused else v for k, v in state.items()}
    save_file(release, str(dst / "model.safetensors"), metadata={"format": "pt"})
    from transformers import AutoModelForImageTextToText

    ref = AutoModelForImageTextToText.from_pretrained(dst, dtype=torch.float32).eval()
    model = _load(dst)
    hf = ref.model.language_model.layers[0].mlp.experts
    engine = model.model.language_model.layers[0].mlp.experts.engine
    assert torch.equal(engine.weights.gate_up, hf.gate_up_proj)
    assert torch.equal(engine.weights.down, hf.down_proj)
    batch = image_text_inputs(model.config, seed=1)
    with torch.no_grad():
        assert (model(**batch).logits - ref(**batch).logits).abs().max().item() <= FP32_LOGITS_TOL


def test_class_follows_architectures():
    """A composite config loads into the class its ``architectures`` names (as transformers' auto classes
    pick), the vision-language class when it names none."""
    config = tiny_config("qwen3_5_moe", architectures=None)
    cls, got = model_class(config)
    assert cls.__name__ == "Qwen3_5MoeForConditionalGeneration" and got is config
    config = tiny_config("qwen3_5_moe", architectures=["Qwen3_5MoeForCausalLM"])
    cls, got = model_class(config)
    assert cls.__name__ == "Qwen3_5MoeForCausalLM" and got is config.text_config  # built on the text part
    cls, _ = model_class(tiny_config("qwen3_vl_moe", architectures=["Qwen3VLMoeForConditionalGeneration"]))
    assert cls.__name__ == "Qwen3VLMoeForConditionalGeneration"


def test_text_only_class_from_a_vision_checkpoint(tmp_path):
    """``architectures: [Qwen3_5MoeForCausalLM]`` in a qwen3_5_moe checkpoint: the language model alone, as
    ``AutoModelForCausalLM`` loads it (the vision weights are left out)."""
    path = save_tiny_model("qwen3_5_moe", tmp_path / "q35", tokenizer=False)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3_5MoeForCausalLM"]}))
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = _load(path)
    assert type(model) is type(ref) and type(model).__name__ == "Qwen3_5MoeForCausalLM"
    ids = text_inputs(4)["input_ids"]
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max().item() <= FP32_LOGITS_TOL


def test_text_only_qwen3_5_moe_checkpoint(tmp_path):
    """A ``qwen3_5_moe_text`` checkpoint (``Qwen3_5MoeForCausalLM`` saved on its own) loads as that class."""
    from transformers import AutoModelForCausalLM

    from moetune.testing.tiny import randomize_

    config = tiny_config("qwen3_5_moe").text_config
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        source = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_(source)
    source.save_pretrained(tmp_path / "text")
    assert json.loads((tmp_path / "text" / "config.json").read_text())["model_type"] == "qwen3_5_moe_text"
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float32).eval()
    model = _load(tmp_path / "text")
    assert type(model) is type(ref) and any(isinstance(m, CpuExperts) for m in model.modules())
    ids = text_inputs(5)["input_ids"]
    with torch.no_grad():
        assert (model(ids).logits - ref(ids).logits).abs().max().item() <= FP32_LOGITS_TOL
