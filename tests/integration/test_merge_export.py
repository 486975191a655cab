"""``moetune export --merge``: the adapter merged into the checkpoint's own weights, checked against stock PEFT.

The reference is stock PEFT's own merge on transformers' model: ``PeftModel.from_pretrained(model, adapter)
.merge_and_unload()``. The merged checkpoint, loaded by transformers with no adapter, must give its logits, keep
every tensor the adapter does not touch byte for byte, and keep the checkpoint's file layout (shards, index,
config). Quantized checkpoints (FP8 block, compressed-tensors INT4) are merged in their own format: each merged
weight within half a quantization step of the exact sum (the dequantized checkpoint with the serving pairs added,
which ``test_serving_export`` holds to stock PEFT's logits).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moetune.errors import AdapterError, OutputDirError
from moetune.testing.tiny import TINY_FAMILIES, VOCAB, save_tiny_model
from tests.integration.test_serving_export import _attach_save, _stock, _trained_adapter

TOL = 2e-5  # fp32 logits: PEFT's merge and this one add the same deltas, rounded in other orders


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _merged_logits_equal_stock_merge(model_dir: Path, adapter: Path, merged: Path) -> None:
    from peft import PeftModel

    ids = torch.randint(4, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = _stock(model_dir)(input_ids=ids).logits
        stock = PeftModel.from_pretrained(_stock(model_dir), adapter).merge_and_unload().eval()
        want = stock(input_ids=ids).logits
        got = _stock(merged)(input_ids=ids).logits
    assert (want - base).abs().max() > 0.05  # the adapter changes the logits: a dropped pair would show
    assert (got - want).abs().max() <= TOL * want.abs().max()


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("family", TINY_FAMILIES.names())
def test_merged_checkpoint_is_stock_peft_merge(family, use_rslora, tmp_path) -> None:
    """Every tiny family (per-expert and fused checkpoints), rsLoRA too: the merged checkpoint is stock PEFT's
    merge, and what the adapter does not touch stays as stored."""
    from moetune.export import export_merged_checkpoint

    model_dir = save_tiny_model(family, tmp_path / "m", tokenizer=False)
    adapter = _trained_adapter(model_dir, tmp_path / "adapter", use_rslora=use_rslora)
    result = export_merged_checkpoint(model_dir, adapter, tmp_path / "merged", progress=False)
    _merged_logits_equal_stock_merge(model_dir, adapter, tmp_path / "merged")
    before, after = _tensors(model_dir), _tensors(tmp_path / "merged")
    assert sorted(before) == sorted(after)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == set(result.changed)
    assert any(".experts." in k for k in changed) and any("embed" in k for k in set(before) - changed)
    assert all(after[k].dtype == before[k].dtype for k in before)
    assert json.loads((tmp_path / "merged/config.json").read_text()) == json.loads(
        (model_dir / "config.json").read_text()
    )
    with safe_open(str(next((tmp_path / "merged").glob("*.safetensors"))), "pt") as f:
        assert f.metadata()["moetune_export"] == "merged"


def test_sharded_bf16_checkpoint_keeps_its_shards_and_index(tmp_path) -> None:
    """A checkpoint in several shards (and bf16): the same shard names and index, an untouched shard copied as is,
    merged weights rounded once to bf16 from the fp32 sum."""
    from transformers import AutoModelForCausalLM

    from moetune.export import export_merged_checkpoint
    from moetune.export.serving import serving_adapter

    small = save_tiny_model("qwen3_moe", tmp_path / "small", tokenizer=False)
    model = AutoModelForCausalLM.from_pretrained(small, dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "m", max_shard_size="20KB")
    model_dir = tmp_path / "m"
    shards = sorted(p.name for p in model_dir.glob("*.safetensors"))
    assert len(shards) > 2 and (model_dir / "model.safetensors.index.json").is_file()
    adapter = _trained_adapter(model_dir, tmp_path / "adapter")
    result = export_merged_checkpoint(model_dir, adapter, tmp_path / "merged", progress=False)
    merged = tmp_path / "merged"
    assert sorted(p.name for p in merged.glob("*.safetensors")) == shards
    assert (merged / "model.safetensors.index.json").read_bytes() == (
        model_dir / "model.safetensors.index.json"
    ).read_bytes()
    assert result.copied and all(
        (merged / n).read_bytes() == (model_dir / n).read_bytes() for n in shards if n in result.copied
    )
    # each merged weight: the stored bf16 weight plus the pairs in fp32 (the serving export's, applied in fp64
    # by the serving test's reference), rounded to bf16 once
    serve = serving_adapter(model_dir, adapter)
    want = _tensors(_served_raw(model_dir, serve, tmp_path / "ref"))
    got = _tensors(merged)
    for key in result.changed:
        assert got[key].dtype == torch.bfloat16
        diff = (got[key].float() - want[key].float()).abs()
        assert (diff <= want[key].float().abs() * 2.0**-8 + 1e-30).all(), key


def _served_raw(model_dir: Path, serve, dst: Path) -> Path:
    """``_served`` with the pairs in hand: every pair added in fp64 to the tensor it names, kept in fp32."""
    scale = serve.config["lora_alpha"] / serve.config["r"]
    dst.mkdir()
    for shard in sorted(model_dir.glob("*.safetensors")):
        weights = load_file(str(shard))
        for key in list(weights):
            a = serve.tensors.get("base_model.model." + key.removesuffix(".weight") + ".lora_A.weight")
            if a is not None:
                b = serve.tensors["base_model.model." + key.removesuffix(".weight") + ".lora_B.weight"]
                weights[key] = (weights[key].double() + scale * b.double() @ a.double()).float()
        save_file(weights, str(dst / shard.name))
    return dst


def _release(release: str, tmp_path: Path) -> tuple[Path, Path]:
    """(the quantized release as shipped, its dequantized float32 reference checkpoint)."""
    from moetune.testing import kimi
    from moetune.testing.fp8_checkpoint import save_fp8_checkpoint
    from moetune.testing.mxfp4_checkpoint import save_mxfp4_checkpoint

    ref = tmp_path / "dequantized"
    save = {
        "deepseek_v3_fp8": lambda p: save_fp8_checkpoint("deepseek_v3", p, dequantized_path=ref),
        "kimi_k2_thinking_int4": lambda p: kimi.save_kimi_thinking(p, dequantized_path=ref),
        "gpt_oss_mxfp4": lambda p: save_mxfp4_checkpoint(p, dequantized_path=ref),
    }[release]
    return save(tmp_path / "m"), ref


def _stock_merged_state(ref: Path, adapter: Path, tmp: Path) -> dict[str, torch.Tensor]:
    """Stock PEFT's merge on transformers' model of the dequantized reference, saved by transformers (in the
    checkpoint's own key layout): its tensors, fp32."""
    from peft import PeftModel

    PeftModel.from_pretrained(_stock(ref), adapter).merge_and_unload().save_pretrained(tmp)
    return {k: v.float() for k, v in _tensors(tmp).items()}


@pytest.mark.parametrize("release", ["deepseek_v3_fp8", "kimi_k2_thinking_int4", "gpt_oss_mxfp4"])
def test_quantized_releases_merge_into_bf16_by_default(release, tmp_path) -> None:
    """FP8 block (DeepSeek-V3), compressed-tensors INT4 (Kimi-K2-Thinking), MXFP4 (gpt-oss): every quantized
    weight is written dequantized in bf16 under its float name and quantization_config leaves the config; the
    merged ones are stock PEFT's merge on transformers' dequantized model rounded once to bf16, the others the
    dequantized release rounded to bf16; transformers loads the result as a float model."""
    from moetune.export import export_merged_checkpoint

    model_dir, ref = _release(release, tmp_path)
    adapter = _trained_adapter(model_dir, tmp_path / "adapter", scale=0.01)
    result = export_merged_checkpoint(model_dir, adapter, tmp_path / "merged", progress=False)
    config = json.loads((tmp_path / "merged/config.json").read_text())
    assert "quantization_config" not in config
    assert config == {
        k: v
        for k, v in json.loads((model_dir / "config.json").read_text()).items()
        if k != "quantization_config"
    }
    merged, floats = _tensors(tmp_path / "merged"), _tensors(ref)
    assert result.dequantized and set(result.dequantized) <= set(merged)
    assert not [
        k for k in merged if k.endswith(("_scale_inv", "_packed", "_blocks", "_scales", "weight_shape"))
    ]
    want = _stock_merged_state(ref, adapter, tmp_path / "stock")
    assert sorted(merged) == sorted(floats) == sorted(want)
    for key in result.dequantized:
        assert merged[key].dtype == torch.bfloat16
        exact = want[key] if key in result.changed else floats[key]
        diff = (merged[key].float() - exact).abs()
        assert (diff <= exact.abs() * 2.0**-8).all(), key  # one rounding to bf16
    for key in set(result.changed) - set(
        result.dequantized
    ):  # float weights of the release (Kimi's attention)
        assert ((merged[key].float() - want[key]).abs() <= want[key].abs() * 2.0**-8 + 1e-30).all(), key
    assert any(".experts." in k for k in result.changed)
    from moetune.loading import load_model

    load_model(tmp_path / "merged", device="cpu", dtype="float32", progress=False)  # a float checkpoint now
    if release != "kimi_k2_thinking_int4":  # Kimi's config names its own modeling code (trust_remote_code)
        _stock(tmp_path / "merged")


@pytest.mark.parametrize("release", ["deepseek_v3_fp8", "kimi_k2_thinking_int4", "gpt_oss_mxfp4"])
def test_quantized_releases_requantize_in_their_own_format(release, tmp_path) -> None:
    """``quantized="requantize"``: the merged checkpoint keeps the format (same keys, dtypes, shapes,
    quantization_config); each merged weight, dequantized, is within half a quantization step of stock PEFT's
    merge on the dequantized release (MXFP4: of the step its block's scale allows, values past 6 steps saturate);
    every other tensor is as stored; the share of the adapter's change kept is what the files show; and moetune
    loads the result."""
    from moetune.export import export_merged_checkpoint
    from moetune.loading import load_model
    from moetune.testing import kimi
    from moetune.testing.fp8_checkpoint import dequantize_reference

    model_dir, ref = _release(release, tmp_path)
    adapter = _trained_adapter(model_dir, tmp_path / "adapter")
    result = export_merged_checkpoint(
        model_dir, adapter, tmp_path / "merged", progress=False, quantized="requantize"
    )
    exact = _stock_merged_state(ref, adapter, tmp_path / "stock")
    floats, before, after = _tensors(ref), _tensors(model_dir), _tensors(tmp_path / "merged")
    assert {k: (v.dtype, v.shape) for k, v in after.items()} == {
        k: (v.dtype, v.shape) for k, v in before.items()
    }
    assert json.loads((tmp_path / "merged/config.json").read_text()) == json.loads(
        (model_dir / "config.json").read_text()
    )
    along = total = 0.0
    quantized = 0
    for key in result.changed:
        want = exact[key]
        name = key.removesuffix(".weight")
        if (
            f"{key}_scale_inv" in after
        ):  # FP8: half an e4m3 step (3 mantissa bits), subnormals 2^-10 of the scale
            scale = after[f"{key}_scale_inv"].float()
            got = dequantize_reference(after[key], scale)
            per = scale.repeat_interleave(128, 0)[: got.shape[0]].repeat_interleave(128, 1)[:, : got.shape[1]]
            bound = want.abs() * 2.0**-4 + per * 2.0**-10
        elif f"{name}.weight_packed" in after:  # INT4: half a group step
            scale = after[f"{name}.weight_scale"]
            got = kimi.dequantize_int4(after[f"{name}.weight_packed"], scale)
            bound = scale.float().repeat_interleave(kimi.INT4_GROUP, dim=1) * 0.5 * (1 + 1e-6)
        elif f"{key}_blocks" in after:  # MXFP4 [E, D, O]: e2m1 steps up to 2 x 2^shared, saturation at 6
            blocks, scales = after[f"{key}_blocks"], after[f"{key}_scales"].float()
            fp4 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
            codes = torch.stack((fp4[(blocks & 15).long()], fp4[(blocks >> 4).long()]), dim=-1).flatten(-3)
            step = torch.pow(2.0, scales - 127).repeat_interleave(32, dim=-1)
            got = (codes * step).transpose(-1, -2)
            bound = 2 * step.transpose(-1, -2)
        else:  # a float weight (Kimi's attention, gpt-oss's router): rounded once to its dtype
            got, bound = after[key].float(), want.abs() * 2.0**-8 + 1e-30
            assert ((got - want).abs() <= bound).all(), key
            continue
        assert ((got - want).abs() <= bound).all(), key
        change = (want - floats[key]).double()
        along += float(((got - floats[key]).double() * change).sum())
        total += float((change * change).sum())
        quantized += 1
    assert quantized > 0 and any(".experts." in k for k in result.changed)
    assert result.kept == pytest.approx(along / total, rel=1e-6)
    touched = {p for k in result.changed for p in after if p == k or p.startswith(k.removesuffix("weight"))}
    touched |= {p for k in result.changed for p in after if p.startswith(k + "_")}
    assert all(torch.equal(after[k], before[k]) for k in before if k not in touched)
    load_model(tmp_path / "merged", device="cpu", dtype="float32", progress=False)


def test_requantizing_a_small_change_reports_what_is_lost(tmp_path, capsys) -> None:
    """An adapter whose change is small beside FP8's step: most of it rounds back to the stored weights, and the
    CLI says how much is kept and how to keep it all."""
    from moetune.cli.main import main

    model_dir, _ = _release("deepseek_v3_fp8", tmp_path)
    adapter = _trained_adapter(model_dir, tmp_path / "adapter", scale=1e-4)
    args = [
        "export",
        "--merge",
        "--model",
        str(model_dir),
        "--adapter",
        str(adapter),
        "--out",
        str(tmp_path / "o"),
    ]
    assert main([*args, "--quantized", "requantize"]) == 0
    out = capsys.readouterr().out
    kept = float(out.split("keep ")[1].split("%")[0]) / 100
    assert kept < 0.5 and "--quantized bfloat16 keeps it all" in out


def test_what_has_no_place_in_a_checkpoint_is_refused_by_name(tmp_path) -> None:
    """moetune's LoRA experts, a whole weight of another shape, an edit to an embedding tied to the output head,
    a disk without room: each refused by name, before anything is written."""
    from moetune.export import export_merged_checkpoint

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "m", tokenizer=False)
    _attach_save(model_dir, tmp_path / "a2", lora_experts=2, rank=4, alpha=8)
    with pytest.raises(AdapterError, match="LoRA experts"):
        export_merged_checkpoint(model_dir, tmp_path / "a2", tmp_path / "o2", progress=False)

    adapter = _trained_adapter(model_dir, tmp_path / "a3")
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
    weights["base_model.model.lm_head.weight"] = torch.zeros(VOCAB + 8, hidden)  # a resized vocabulary
    save_file(weights, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(AdapterError, match="lm_head"):
        export_merged_checkpoint(model_dir, adapter, tmp_path / "o3", progress=False)

    tied = save_tiny_model("qwen3_moe", tmp_path / "tied", tokenizer=False, tie_word_embeddings=True)
    _attach_save(tied, tmp_path / "a4", rank=4, alpha=8, modules_to_save=("embed_tokens",))
    with pytest.raises(AdapterError, match="tie_word_embeddings"):
        export_merged_checkpoint(tied, tmp_path / "a4", tmp_path / "o4", progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("o")]


def test_a_disk_without_room_is_refused_before_writing(tmp_path, monkeypatch) -> None:
    import shutil
    from collections import namedtuple

    from moetune.export import export_merged_checkpoint

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "m", tokenizer=False)
    adapter = _trained_adapter(model_dir, tmp_path / "a")
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(OutputDirError, match="GB free"):
        export_merged_checkpoint(model_dir, adapter, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_stock_peft_adapters_merge_as_stock_peft(tmp_path) -> None:
    """Adapters stock PEFT saves itself: LoRA on lm_head (saved with its base weight, ``lm_head.base_layer``),
    and fused expert LoRA on one projection only (gpt-oss): the merge is stock PEFT's."""
    from peft import LoraConfig, get_peft_model

    from moetune.export import export_merged_checkpoint

    cases = {
        "qwen3_moe": LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]),
        "gpt_oss": LoraConfig(
            r=4, lora_alpha=8, target_modules=[], target_parameters=["mlp.experts.gate_up_proj"]
        ),
    }
    for family, config in cases.items():
        model_dir = save_tiny_model(family, tmp_path / family, tokenizer=False)
        peft = get_peft_model(_stock(model_dir), config)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        peft.save_pretrained(tmp_path / f"{family}-a")
        out = tmp_path / f"{family}-merged"
        export_merged_checkpoint(model_dir, tmp_path / f"{family}-a", out, progress=False)
        _merged_logits_equal_stock_merge(model_dir, tmp_path / f"{family}-a", out)


def test_safetensors_the_checkpoint_does_not_list_are_left_out(tmp_path) -> None:
    """A ``consolidated.safetensors`` beside the shards (Mistral's own format) would hold the base weights
    unmerged: left out and named, with folders (gpt-oss's ``original/``)."""
    from moetune.export import export_merged_checkpoint

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "m", tokenizer=False)
    (model_dir / "consolidated.safetensors").write_bytes((model_dir / "model.safetensors").read_bytes())
    (model_dir / "original").mkdir()
    adapter = _trained_adapter(model_dir, tmp_path / "a")
    result = export_merged_checkpoint(model_dir, adapter, tmp_path / "merged", progress=False)
    assert sorted(result.left_out) == ["consolidated.safetensors", "original/"]
    assert not (tmp_path / "merged/consolidated.safetensors").exists()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rank": 4, "alpha": 8, "modules_to_save": ("lm_head",)},
        {"rank": 4, "alpha": 8, "targets": ("q_proj", "experts", "gate")},
    ],
    ids=["modules_to_save", "router"],
)
def test_whole_weights_and_router_lora_merge_as_stock_peft(kwargs, tmp_path) -> None:
    """What serving engines do not apply merges: a whole weight saved beside the LoRA (``modules_to_save``)
    replaces the checkpoint's, router LoRA adds to the router's weight: stock PEFT's merge again."""
    from moetune.export import export_merged_checkpoint

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "m", tokenizer=False)
    adapter = _attach_save(model_dir, tmp_path / "a", **kwargs)
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    weights = {
        k: torch.randn(v.shape, generator=gen) * 0.1 for k, v in weights.items()
    }  # every tensor counts
    save_file(weights, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    result = export_merged_checkpoint(model_dir, adapter, tmp_path / "merged", progress=False)
    want = "lm_head.weight" if "modules_to_save" in kwargs else ".mlp.gate.weight"
    assert any(k.endswith(want) for k in result.changed)
    _merged_logits_equal_stock_merge(model_dir, adapter, tmp_path / "merged")


def test_out_folder_rules(tmp_path) -> None:
    """New or empty, or with overwrite an earlier merge; never the model's folder, a serving export or a user's
    folder; a refused merge leaves the earlier one in place."""
    from moetune.export import export_merged_checkpoint, export_serving_adapter

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "m", tokenizer=False)
    adapter = _trained_adapter(model_dir, tmp_path / "a")
    with pytest.raises(OutputDirError, match="model folder"):
        export_merged_checkpoint(model_dir, adapter, model_dir, progress=False)
    out = tmp_path / "merged"
    export_merged_checkpoint(model_dir, adapter, out, progress=False)
    first = _tensors(out)
    with pytest.raises(OutputDirError, match="not empty"):
        export_merged_checkpoint(model_dir, adapter, out, progress=False)
    other = _trained_adapter(model_dir, tmp_path / "b", seed=1)
    export_merged_checkpoint(model_dir, other, out, overwrite=True, progress=False)
    assert any(not torch.equal(v, first[k]) for k, v in _tensors(out).items())
    export_serving_adapter(model_dir, adapter, tmp_path / "serve")
    with pytest.raises(OutputDirError, match="not an earlier moetune export"):
        export_merged_checkpoint(model_dir, adapter, tmp_path / "serve", overwrite=True, progress=False)
    # a merge that fails while writing (weights overflowing to Inf) leaves the earlier merge as it was, and nothing
    # staged beside it
    before = _tensors(out)
    huge = _trained_adapter(model_dir, tmp_path / "huge", seed=2)
    weights = {k: v * 1e30 for k, v in load_file(str(huge / "adapter_model.safetensors")).items()}
    save_file(weights, str(huge / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AdapterError, match="NaN or Inf"):
        export_merged_checkpoint(model_dir, huge, out, overwrite=True, progress=False)
    assert all(torch.equal(v, before[k]) for k, v in _tensors(out).items())
    assert sorted(p.name for p in tmp_path.iterdir() if "export" in p.name) == []
    (tmp_path / "user").mkdir()
    (tmp_path / "user/notes.txt").write_text("mine")
    with pytest.raises(OutputDirError, match="not an earlier moetune export"):
        export_merged_checkpoint(model_dir, adapter, tmp_path / "user", overwrite=True, progress=False)
    assert (tmp_path / "user/notes.txt").read_text() == "mine"


def test_llamafactory_merge_yaml_runs_through_the_cli(tmp_path, capsys, caplog) -> None:
    """LLaMA-Factory's merge config (examples/merge_lora's keys: model_name_or_path, adapter_name_or_path,
    template, finetuning_type, trust_remote_code, export_dir, export_size, export_device, export_legacy_format)
    given to ``moetune export``: the merged checkpoint, and the adapter's tokenizer beside it; the keys without
    effect said in a warning each."""
    from moetune.cli.main import main

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "m")
    adapter = _trained_adapter(model_dir, tmp_path / "a")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (adapter / name).write_bytes((model_dir / name).read_bytes())
    config = tmp_path / "merge.yaml"
    config.write_text(
        "### model\n"
        f"model_name_or_path: {model_dir}\n"
        f"adapter_name_or_path: {adapter}\n"
        "template: qwen3\n"
        "finetuning_type: lora\n"
        "trust_remote_code: true\n\n"
        "### export\n"
        f"export_dir: {tmp_path / 'merged'}\n"
        "export_size: 5\n"
        "export_device: cpu  # choices: [cpu, auto]\n"
        "export_legacy_format: false\n"
    )
    with caplog.at_level(logging.WARNING, logger="moetune.config.export"):
        assert main(["export", str(config)]) == 0
    assert "merged" in capsys.readouterr().out and (tmp_path / "merged/tokenizer.json").is_file()
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("export_size: 5 has no effect") for m in said), said
    assert any(m.startswith("template: 'qwen3' has no effect on the merge") for m in said), said
    _merged_logits_equal_stock_merge(model_dir, adapter, tmp_path / "merged")

    config.write_text(config.read_text().replace("export_legacy_format: false", "export_legacy_format: true"))
    assert main(["export", str(config)]) == 2
    assert "export_legacy_format" in capsys.readouterr().err


def test_shipped_merge_example_merges_the_demo_s_run() -> None:
    """examples/merge_lora/demo_lora.yaml (LLaMA-Factory's form) parses and names the demo's model and adapter
    (examples/demo_lora.yaml's model_name_or_path and output_dir)."""
    import yaml

    from moetune.config.export import load_merge_config

    root = Path(__file__).resolve().parents[2]
    config = load_merge_config(root / "examples/merge_lora/demo_lora.yaml")
    demo = yaml.safe_load((root / "examples/demo_lora.yaml").read_text())
    assert config.model_name_or_path == Path(demo["model_name_or_path"])
    assert config.adapter_name_or_path == Path(demo["output_dir"])
    assert config.export_dir == Path("out/demo/merged") and config.finetuning_type == "lora"


def test_merge_config_problems_are_listed_with_their_keys(tmp_path) -> None:
    from moetune.config.export import load_merge_config
    from moetune.errors import ConfigError

    path = tmp_path / "merge.yaml"
    path.write_text(
        "model_name_or_path: m\nadapter_name_or_path: a,b\nfinetuning_type: full\nexport_quantization_bit: 4\n"
        "export_device: gpu\nexport_dri: out\n"
    )
    with pytest.raises(ConfigError) as info:
        load_merge_config(path)
    text = str(info.value)
    for key in (
        "adapter_name_or_path",
        "finetuning_type",
        "export_quantization_bit",
        "export_device",
        "export_dri",
    ):
        assert f"- {key}:" in text, key
    assert "export_dir: is required" in text


def test_fused_experts_stored_transposed_merge_as_stored(tmp_path) -> None:
    """Qwen3-VL-MoE's releases store the fused experts transposed from the module (``gate_up_proj`` [E, H, 2I],
    ``down_proj`` [E, I, H]; transformers transposes them at load): the merged tensors stay in that layout and
    the result is stock PEFT's merge."""
    from moetune.export import export_merged_checkpoint

    model_dir = save_tiny_model("qwen3_vl_moe", tmp_path / "m", tokenizer=False)
    weights = load_file(str(model_dir / "model.safetensors"))
    fused = [k for k in weights if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert fused
    for key in fused:
        weights[key] = weights[key].transpose(1, 2).contiguous()
    save_file(weights, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    adapter = _trained_adapter(model_dir, tmp_path / "adapter")
    export_merged_checkpoint(model_dir, adapter, tmp_path / "merged", progress=False)
    merged = _tensors(tmp_path / "merged")
    assert all(merged[k].shape == weights[k].shape for k in fused)
    _merged_logits_equal_stock_merge(model_dir, adapter, tmp_path / "merged")


def test_embedding_lora_is_refused_by_name(tmp_path) -> None:
    """PEFT's LoRA on an embedding (``lora_embedding_A`` / ``lora_embedding_B``): moetune loads and exports none,
    and says so naming the tensors (not a generic 'not a LoRA adapter')."""
    from peft import LoraConfig, get_peft_model

    from moetune.export import export_merged_checkpoint

    model_dir = save_tiny_model("qwen3_moe", tmp_path / "m", tokenizer=False)
    peft = get_peft_model(
        _stock(model_dir), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"])
    )
    peft.save_pretrained(tmp_path / "a")
    with pytest.raises(AdapterError, match="LoRA on embedding layers.*embed_tokens"):
        export_merged_checkpoint(model_dir, tmp_path / "a", tmp_path / "out", progress=False)
