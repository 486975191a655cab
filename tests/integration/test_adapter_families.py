"""Adapters of the families whose keys or experts broke the round trip: saved, loaded again by moetune (the
model, a resume), and what stock PEFT makes of them.

- Mistral Large 4, DeepSeek-OCR-2, Laguna, Inkling 2: PEFT 0.21 loads every adapter through transformers 5's
  checkpoint conversion for the model type, which renames keys that are already the model's own; PEFT then left
  them out with a warning, and moetune's loader (built on it) refused its own adapters and a resume restarted
  their LoRA silently. moetune now loads them by name; attaching LoRA warns that stock PEFT will not.
- NemotronH (non-gated experts: ``up_proj``) and LongCat-Flash (zero-computation experts beside the routed ones):
  the adapter check sized their expert LoRA from the engine's layout, not the module's parameters, and refused
  them. NemotronH's ``lora_target: all`` also named its Mamba mixers' ``out_proj``, which PEFT refuses.

Then the same round trip on every MoE family transformers ships that moetune loads (``MOE_FAMILIES``).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from moetune.adapters import attach_lora, save_adapter
from moetune.errors import AdapterError
from moetune.loading import load_model
from moetune.testing.families import MOE_FAMILIES, survey_config
from moetune.testing.survey import _inputs, _random_model

# what moetune export refuses, by name: weights transformers builds at load from other checkpoint tensors (a split
# or merge, not a rename), experts stored per projection for all experts at once (Step-3.7)
EXPORT_REFUSED = {
    "lara_mini": "by a plain rename",
    "minimax_m3_vl": "by a plain rename",
    "nemotron_h_omni": "by a plain rename",
    "step3p7": "per projection for all experts at once",
}
# what moetune export --merge refuses beyond those, by name: experts a conversion at load dequantizes from another
# stored form (no writer for it)
MERGE_REFUSED = {"inkling2_loop": "conversion at load: Inkling2LoopDequantizeExperts"}
RENAMED_BY_PEFT = ("mistral_large4", "deepseek_ocr2", "laguna", "inkling2")
MODULE_LAYOUTS = ("nemotron_h", "longcat_flash")


def _save(family: str, path: Path) -> tuple[type, Path]:
    model = _random_model(survey_config(family), seed=0)
    model.save_pretrained(path)
    return type(model), path


def _trained(path: Path):
    """moetune's model of ``path`` with LoRA on every target, each A and B random."""
    from moetune.adapters import attach_lora
    from moetune.adapters.load import load_model

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        model = attach_lora(
            load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1), rank=4, alpha=8
        )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval(), [str(w.message) for w in seen if "stock PEFT will not load" in str(w.message)]


def _logits(model, family: str) -> torch.Tensor:
    inputs = _inputs(0, survey_config(family).get_text_config().vocab_size)
    inputs.pop("labels")
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", [*RENAMED_BY_PEFT, *MODULE_LAYOUTS])
def test_saved_adapter_loads_again_and_resumes(family, tmp_path) -> None:
    from peft import PeftModel

    from moetune.adapters import attach_lora, load_adapter_weights, save_adapter
    from moetune.adapters.load import load_model
    from moetune.train.other_kind import ResumesOtherKind

    cls, path = _save(family, tmp_path / "m")
    model, warned = _trained(path)
    want = _logits(model, family)
    save_adapter(model, tmp_path / "a")

    again = load_model(
        path, device="cpu", dtype="float32", progress=False, num_threads=1, adapter=tmp_path / "a"
    )
    torch.testing.assert_close(_logits(again.eval(), family), want, rtol=0, atol=0)
    fresh = attach_lora(
        load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1), rank=4, alpha=8
    )
    load_adapter_weights(fresh, tmp_path / "a")
    torch.testing.assert_close(_logits(fresh.eval(), family), want, rtol=0, atol=0)

    class Resuming(
        ResumesOtherKind
    ):  # the Trainer's resume of a LoRA checkpoint of its own kind, one process
        is_fsdp_enabled = False

    resumed = attach_lora(
        load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1), rank=4, alpha=8
    )
    Resuming()._load_from_checkpoint(str(tmp_path / "a"), resumed)
    torch.testing.assert_close(_logits(resumed.eval(), family), want, rtol=0, atol=0)

    # what stock PEFT makes of it, on transformers' own model: the adapter as saved, or (the renamed families,
    # PEFT's conversion) another model, which the warning at attach said
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = PeftModel.from_pretrained(
            cls.from_pretrained(path, dtype=torch.float32), tmp_path / "a"
        ).eval()
    diff = (_logits(stock, family) - want).abs().max()
    if family in RENAMED_BY_PEFT:
        assert warned and diff > 1e-2
    else:
        assert not warned and diff <= 1e-5 * want.abs().max()


def test_peft_refused_mamba_projections(tmp_path) -> None:
    """NemotronH: ``all`` leaves its Mamba mixers' out_proj out (PEFT refuses LoRA there); naming it is an error
    saying why, before PEFT's own ValueError."""
    from moetune.adapters import attach_lora
    from moetune.adapters.load import load_model

    _, path = _save("nemotron_h", tmp_path / "m")
    model = load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1)
    assert any(n.endswith(".out_proj") for n, _ in model.named_modules())
    with pytest.raises(AdapterError, match="PEFT refuses LoRA on modules named out_proj"):
        attach_lora(model, rank=4, alpha=8, targets=("out_proj",))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_every_family_adapter_round_trip(family, tmp_path):
    """Every MoE family transformers ships that moetune loads: LoRA on every target saved, loaded again by moetune
    (the trained logits), by stock PEFT on transformers' own model (the same logits, unless
    ``stock_peft_renames`` says PEFT's conversion renames its keys, which attaching warns about), and exported
    for serving engines (applied to the checkpoint as an engine applies it: the same logits)."""
    from peft import PeftModel

    from moetune.adapters.apply import stock_peft_renames
    from moetune.errors import ArchError
    from moetune.testing.survey import RUN_ON

    try:
        ref = _random_model(survey_config(family), seed=0)
        ref.save_pretrained(tmp_path / "m")
        model = load_model(tmp_path / "m", device="cpu", dtype="float32", progress=False, num_threads=1)
    except ArchError as e:
        pytest.skip(f"not loaded: {str(e)[:120]}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft = attach_lora(model, rank=4, alpha=8)
    except AdapterError as e:
        assert "flat" in str(e), e  # DBRX's flat experts: refused by design, with the reason
        pytest.skip("experts stock PEFT adapts otherwise (DBRX)")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    inputs = _inputs(0, survey_config(family).get_text_config().vocab_size)
    inputs.pop("labels")
    run_on = RUN_ON.get(family)

    def logits(m):
        m = m.eval()
        with torch.no_grad():
            if run_on is not None:  # transformers' whole-model forward fails for it (survey.RUN_ON)
                base = m.get_base_model() if hasattr(m, "get_base_model") else m
                return base.get_submodule(run_on)(**inputs).logits
            return m(**inputs).logits

    want = logits(peft)
    save_adapter(peft, tmp_path / "a")
    from moetune.adapters.load import load_model as load_with_adapter

    again = load_with_adapter(
        tmp_path / "m", device="cpu", dtype="float32", progress=False, num_threads=1, adapter=tmp_path / "a"
    )
    scale = max(1.0, want.abs().max().item())
    # bit for bit but for Jamba, whose Mamba reference scan (no mamba_ssm here) moved logits by 1.7e-6
    assert (logits(again) - want).abs().max() <= 1e-5 * scale
    # transformers' class of what moetune loaded (Qwen3-Omni: its thinker), with PEFT's own loading
    base = type(peft.get_base_model()).from_pretrained(tmp_path / "m", dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        stock = PeftModel.from_pretrained(base, tmp_path / "a")
    diff = (logits(stock) - want).abs().max()
    renamed = bool(stock_peft_renames(peft))
    if renamed:
        assert diff > 1e-3
    else:
        assert diff <= 2e-5 * scale

    # the serving copy (moetune export): each pair added to the checkpoint tensor it names, as an engine applies
    # it, gives the logits of stock PEFT's own merge (merge_and_unload: it also reaches a Linear whose weight the
    # model reads directly, Jamba's dt_proj, where LoRA in the forward never runs); where stock PEFT does not load
    # the adapter, the trained logits. Fused expert LoRA is kept as trained (tests/integration/test_serving_export.py).
    # The merged checkpoint (moetune export --merge), loaded by transformers with no adapter: the same logits
    from moetune.export import export_merged_checkpoint, export_serving_adapter
    from tests.integration.test_serving_export import _served

    if family in EXPORT_REFUSED:
        for export in (export_serving_adapter, export_merged_checkpoint):
            with pytest.raises(AdapterError, match=EXPORT_REFUSED[family]):
                export(tmp_path / "m", tmp_path / "a", tmp_path / "out")
        return
    reference = want if renamed else logits(stock.merge_and_unload())

    def reloaded(path: Path) -> torch.Tensor:
        return logits(type(peft.get_base_model()).from_pretrained(path, dtype=torch.float32))

    if family in MERGE_REFUSED:
        with pytest.raises(AdapterError, match=MERGE_REFUSED[family]):
            export_merged_checkpoint(tmp_path / "m", tmp_path / "a", tmp_path / "merged", progress=False)
    else:
        export_merged_checkpoint(tmp_path / "m", tmp_path / "a", tmp_path / "merged", progress=False)
        assert (reloaded(tmp_path / "merged") - reference).abs().max() <= 2e-5 * scale
    result = export_serving_adapter(tmp_path / "m", tmp_path / "a", tmp_path / "serve")
    if result.fused == 0:
        served = _served(tmp_path / "m", tmp_path / "serve", tmp_path / "served")
        assert (reloaded(served) - reference).abs().max() <= 2e-5 * scale


def test_all_leaves_a_router_s_inner_linear_out(tmp_path) -> None:
    """LongCat-Flash's router holds an nn.Linear ``classifier`` whose weight it reads directly
    (``F.linear(x, self.classifier.weight)``): Linear LoRA there never runs, so ``all`` leaves it out with the
    routers themselves."""
    _, path = _save("longcat_flash", tmp_path / "m")
    model = load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1)
    assert any(n.endswith("router.classifier") for n, _ in model.named_modules())
    peft = attach_lora(model, rank=4, alpha=8)
    assert not [n for n, _ in peft.named_parameters() if ".router." in n and "lora_" in n]
    assert [n for n, _ in peft.named_parameters() if ".q_b_proj." in n and "lora_" in n]


@pytest.mark.parametrize("family", ["llama4", "gpt_oss", "qwen3_moe"])
def test_expert_lora_is_stock_peft_lora_in_training(family, tmp_path) -> None:
    """LoRA attached by moetune has stock PEFT's tensors on transformers' own model: the same names and shapes,
    lora_B zero at the start (Llama 4's flagless transposed experts, whose in and out PEFT swaps, included), and
    with every tensor random the same loss and the same gradient of every lora_A / lora_B, named alike."""
    from peft import LoraConfig, PeftModel, get_peft_model

    config = survey_config(family)
    # Llama 4's text model: transformers' whole-model forward fails for it (survey.RUN_ON)
    config = config.get_text_config() if family == "llama4" else config
    cls, path = type(ref := _random_model(config, seed=0)), tmp_path / "m"
    ref.save_pretrained(path)
    model = attach_lora(
        load_model(path, device="cpu", dtype="float32", progress=False, num_threads=1), rank=4, alpha=8
    )
    ours = {n.removeprefix("base_model.model."): p for n, p in model.named_parameters() if ".lora_" in n}
    peft_config = model.peft_config["default"]
    fresh = get_peft_model(
        cls.from_pretrained(path, dtype=torch.float32),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=peft_config.target_modules,
            target_parameters=peft_config.target_parameters,
        ),
    )
    stock_shapes = {
        n.removeprefix("base_model.model."): tuple(p.shape)
        for n, p in fresh.named_parameters()
        if ".lora_" in n
    }
    assert {n: tuple(p.shape) for n, p in ours.items()} == stock_shapes
    assert all(not p.any() for n, p in ours.items() if ".lora_B." in n)
    assert any(".experts." in n for n in ours)

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ours.values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    save_adapter(model, tmp_path / "a")
    stock = PeftModel.from_pretrained(
        cls.from_pretrained(path, dtype=torch.float32), tmp_path / "a", is_trainable=True
    )
    inputs = _inputs(0, config.vocab_size)
    losses, grads = [], []
    for m in (model.train(), stock.train()):
        loss = m(**inputs).loss
        loss.backward()
        losses.append(loss.item())
        grads.append(
            {n.removeprefix("base_model.model."): p.grad for n, p in m.named_parameters() if ".lora_" in n}
        )
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    assert sorted(grads[0]) == sorted(grads[1])
    for name, want in grads[1].items():
        got = grads[0][name]
        assert got is not None and want.abs().max() > 0, name
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), name


def test_llama4_adapter_in_the_earlier_layout_is_refused_naming_both_shapes(tmp_path) -> None:
    """Llama 4 expert LoRA saved before moetune took stock PEFT's swapped layout (lora_A on the input side,
    ``[E r, H]``): loading it is an AdapterError naming the shapes found and the shapes expected, not a silent
    misread (H != 2I here, so the shapes tell the layouts apart)."""
    from safetensors.torch import load_file, save_file

    from moetune.adapters.load import load_model as load_with_adapter
    from moetune.adapters.peft_layout import lora_from_peft, lora_to_peft

    config = survey_config("llama4").get_text_config()
    _random_model(config, seed=0).save_pretrained(tmp_path / "m")
    model = attach_lora(
        load_model(tmp_path / "m", device="cpu", dtype="float32", progress=False, num_threads=1),
        rank=4,
        alpha=8,
    )
    save_adapter(model, tmp_path / "a")
    path = tmp_path / "a/adapter_model.safetensors"
    state = load_file(str(path))
    experts = config.num_local_experts
    for key in [k for k in state if ".experts." in k and k.endswith(".lora_A.weight")]:
        b_key = key.replace(".lora_A.", ".lora_B.")
        a, b = lora_from_peft(state[key], state[b_key], experts, swapped=True)
        state[key], state[b_key] = lora_to_peft(a, b)  # the earlier, unswapped layout
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(AdapterError, match=r"lora_A \[\d+, \d+\] / lora_B \[\d+, \d+\] do not fit.*expected"):
        load_with_adapter(
            tmp_path / "m", device="cpu", dtype="float32", progress=False, adapter=tmp_path / "a"
        )
