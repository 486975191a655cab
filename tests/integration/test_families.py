"""Every MoE family transformers 5.24 ships loads exactly in moetune or is refused by name; none crashes.

``moetune.testing.survey.survey_family`` saves a tiny random checkpoint of the family's real config class with
``save_pretrained``, loads it with ``moetune.load_model`` (float64, CPU) and compares with transformers' own
model of the same folder (float64; the tolerances and why in ``survey.TOL``): every expert weight in the engines, logits, and the gradient of every non-expert
parameter (routers included). The outcome of each family is pinned below, so a family that stops loading, or
starts to, fails here until this file says so.

The default suite runs ``FAST``: the families made to load by family-specific code (an own-gate activation, a
layout or call without transformers' flags, a split or stacked checkpoint layout, an omni model's thinker) and
one refused family; the whole sweep (~30 s) is marked slow.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import moetune
from moetune.layer import PostNormExperts
from moetune.testing.families import MOE_FAMILIES, survey_config
from moetune.testing.survey import _random_model, survey_family

REFUSED = {
    # no text-generation class in transformers
    "nllb-moe": "no causal-LM or image-text-to-text class",
    "switch_transformers": "no causal-LM or image-text-to-text class",
    "openai_privacy_filter": "no causal-LM or image-text-to-text class",
    # experts the engine cannot run, with the reason
    "nemo_speechlm": "speech-to-text model",
    "doge": "single neurons",
    "jetmoe": "JetMoeMoE",
    "diffusion_gemma": "ties the experts of its encoder",
}

FAST = (
    "deepseek_v4",  # clamped SwiGLU, hash-routed layers
    "glm5_next",  # clamped SwiGLU in a vision-language model
    "llama4",  # flags from the spec, pre-scaled dense call
    "qwen3_omni_moe",  # thinker loaded from the whole omni checkpoint
    "ernie4_5_vl_moe",  # one checkpoint list split over text and vision experts
    "lfm2_moe",  # act_fn given as a plain function
    "longcat_flash",  # zero-computation experts beside the routed ones
    "step3p7",  # stacked per-projection experts, clamped after the activation
    "nemotron_h",  # non-gated experts (relu2), run as gated ones on tied rows
    "muse_spark",  # a norm on each expert's output inside the weighted sum
    "dbrx",  # flat [E*I, H] experts (down transposed), called on [B, S, H]
    "nemo_speechlm",  # refused
)


def _check(model_type: str, workdir: Path) -> None:
    result = survey_family(model_type, workdir)
    if model_type in REFUSED:
        assert result.startswith("refused: "), result
        assert repr(model_type) in result, result  # the family is named ...
        assert REFUSED[model_type] in result, result  # ... with the reason
        assert "moetune supports" in result or "Supported:" in result, result  # ... and what is supported
    else:
        assert result == "exact", result


@pytest.mark.parametrize("model_type", FAST)
def test_family(model_type, tmp_path):
    _check(model_type, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", [t for t in MOE_FAMILIES if t not in FAST])
def test_family_sweep(model_type, tmp_path):
    _check(model_type, tmp_path)


def test_the_list_covers_every_family_transformers_ships():
    """Step 1 of ``MOE_FAMILIES``' recipe, re-run on the installed transformers: every model folder whose modeling
    file uses ``use_experts_implementation`` has a model type in the list."""
    import transformers

    models = Path(transformers.__file__).parent / "models"
    missing = []
    for modeling in sorted(models.glob("*/modeling_*.py")):
        if modeling.name != f"modeling_{modeling.parent.name}.py":
            continue
        if "use_experts_implementation" not in modeling.read_text():
            continue
        configs = "".join(p.read_text() for p in modeling.parent.glob("configuration_*.py"))
        types = set(re.findall(r'model_type = "([^"]+)"', configs))
        if not types & set(MOE_FAMILIES):
            missing.append(f"{modeling.parent.name} ({sorted(types)})")
    assert not missing, f"MoE families not in moetune.testing.families.MOE_FAMILIES: {missing}"
    assert set(REFUSED) <= set(MOE_FAMILIES) and set(FAST) <= set(MOE_FAMILIES)


def test_post_expert_norm_moves_with_the_model(tmp_path):
    """Muse Spark's post_expert_norm is a torch module of the model on moetune's experts module: ``model.to``
    casts it (and it is loaded from the checkpoint), while the engine's host state stays as it is."""
    ref = _random_model(survey_config("muse_spark"), seed=0)
    ref.save_pretrained(tmp_path)
    model = moetune.load_model(tmp_path, dtype="float32", device="cpu", progress=False, num_threads=1)
    experts = {n: m for n, m in model.named_modules() if isinstance(m, PostNormExperts)}
    assert experts
    for path, module in experts.items():
        assert torch.equal(module.post_expert_norm.weight, ref.get_submodule(path).post_expert_norm.weight)
    model.to(torch.float64)
    for module in experts.values():
        assert module.post_expert_norm.weight.dtype == torch.float64
        assert module.engine.weights.storage_dtype == torch.float32
