"""``moetune export``: a trained adapter in the layout serving engines load, checked against stock PEFT.

The reference is how a serving engine applies a LoRA pair to a checkpoint weight it names: ``W += (alpha / r) B A``
on the tensor of that name in the checkpoint as stored (``[out, in]``). Every tiny family whose checkpoint stores
one matrix per expert is exported, the pairs are added to its safetensors file that way, and transformers' own
model loaded from the result must give the logits of stock PEFT's model with the adapter as trained
(``PeftModel.from_pretrained`` on the unmodified model): names, gate/up split, orientation, scaling and rsLoRA
folding all show there. Families whose checkpoint stores fused experts keep PEFT's fused pairs unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from moetune.errors import AdapterError, OutputDirError
from moetune.testing.tiny import TINY_FAMILIES, VOCAB, auto_class, save_tiny_model

# fused expert LoRA kept: classes vLLM adapts with PEFT's 3-D pairs (gpt-oss, Qwen3.5), or fused on disk (Qwen3-VL)
FUSED = ("gpt_oss", "qwen3_5_moe", "qwen3_vl_moe")
PER_EXPERT = tuple(f for f in TINY_FAMILIES.names() if f not in FUSED)
PREFIX = "base_model.model."
TOL = 2e-5  # fp32 logits: the merged weights and PEFT's (x A^T) B^T sum the same products in other orders


def _trained_adapter(
    path: Path, out: Path, *, use_rslora: bool = False, seed: int = 0, scale: float = 0.1
) -> Path:
    """An adapter of every LoRA target ("all"), each A and B random of std ``scale`` (a wrong row, orientation or
    scale shows)."""
    from moetune.adapters import attach_lora, save_adapter
    from moetune.adapters.load import load_model

    model = attach_lora(
        load_model(path, device="cpu", dtype="float32", progress=False),
        rank=4,
        alpha=8,
        use_rslora=use_rslora,
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    save_adapter(model, out)
    return out


def _served(model_dir: Path, export: Path, dst: Path) -> Path:
    """``model_dir`` with every exported pair added to the checkpoint tensor it names, as an engine applies it."""
    config = json.loads((export / "adapter_config.json").read_text())
    assert not config["use_rslora"] and not config["target_parameters"]
    scale = config["lora_alpha"] / config["r"]
    shutil.copytree(model_dir, dst)
    lora = load_file(str(export / "adapter_model.safetensors"))
    left = {k.removeprefix(PREFIX).rpartition(".lora_")[0] + ".weight" for k in lora}
    for shard in sorted(dst.glob("*.safetensors")):
        weights = load_file(str(shard))
        for key in left & set(weights):
            a, b = (lora[PREFIX + key.removesuffix(".weight") + f".lora_{x}.weight"].double() for x in "AB")
            # kept in fp32 at least: an engine adds the LoRA term to x W^T in its compute dtype, never rounding W
            dtype = torch.promote_types(weights[key].dtype, torch.float32)
            weights[key] = (weights[key].double() + scale * b @ a).to(dtype)
        left -= set(weights)
        save_file(weights, str(shard), metadata={"format": "pt"})
    assert not left, f"pairs naming no tensor of the checkpoint: {sorted(left)}"
    return dst


def _check_served(model_dir: Path, adapter: Path, export: Path, tmp: Path) -> None:
    """transformers' model of ``model_dir`` with ``export`` applied as an engine applies it gives the logits of
    stock PEFT's model with ``adapter``."""
    from peft import PeftModel

    ids = torch.randint(4, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = _stock(model_dir)(input_ids=ids).logits
        want = PeftModel.from_pretrained(_stock(model_dir), adapter).eval()(input_ids=ids).logits
        got = _stock(_served(model_dir, export, tmp / "served"))(input_ids=ids).logits
    assert (want - base).abs().max() > 0.05  # the adapter changes the logits: a dropped pair would show
    assert (got - want).abs().max() <= TOL * want.abs().max()


def _stock(path: Path):
    from transformers import AutoConfig

    return auto_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("use_rslora", [False, True])
@pytest.mark.parametrize("family", PER_EXPERT)
def test_served_per_expert_equals_stock_peft(family, use_rslora, tmp_path) -> None:
    from moetune.export import export_serving_adapter

    model_dir = save_tiny_model(family, tmp_path / "m", tokenizer=False)
    adapter = _trained_adapter(model_dir, tmp_path / "adapter", use_rslora=use_rslora)
    result = export_serving_adapter(model_dir, adapter, tmp_path / "serve")
    assert result.per_expert > 0 and result.fused == 0
    names = load_file(str(tmp_path / "serve/adapter_model.safetensors"))
    assert any(".experts.0." in k for k in names)  # expert pairs per expert, under the checkpoint's names
    _check_served(model_dir, adapter, tmp_path / "serve", tmp_path)


@pytest.mark.parametrize("release", ["deepseek_v3_fp8", "kimi_k2_instruct_fp8", "kimi_k2_thinking_int4"])
def test_quantized_releases_export_under_their_module_names(release, tmp_path) -> None:
    """FP8 block-scaled and compressed-tensors INT4 checkpoints store each expert matrix as codes and scales
    (``weight`` + ``weight_scale_inv``, ``weight_packed`` + ``weight_scale``): the pairs name the module, and
    applied to the dequantized checkpoint they give stock PEFT's logits there."""
    from moetune.export import export_serving_adapter
    from moetune.testing import kimi
    from moetune.testing.fp8_checkpoint import save_fp8_checkpoint

    ref = tmp_path / "dequantized"
    save = {
        "deepseek_v3_fp8": lambda p: save_fp8_checkpoint("deepseek_v3", p, dequantized_path=ref),
        "kimi_k2_instruct_fp8": lambda p: kimi.save_kimi_instruct(p, dequantized_path=ref),
        "kimi_k2_thinking_int4": lambda p: kimi.save_kimi_thinking(p, dequantized_path=ref),
    }[release]
    model_dir = save(tmp_path / "m")
    adapter = _trained_adapter(model_dir, tmp_path / "adapter")
    result = export_serving_adapter(model_dir, adapter, tmp_path / "serve")
    assert result.per_expert > 0 and result.fused == 0
    _check_served(ref, adapter, tmp_path / "serve", tmp_path)


@pytest.mark.parametrize("family", [*FUSED, "gpt_oss_mxfp4"])
def test_fused_checkpoints_keep_peft_fused_pairs(family, tmp_path) -> None:
    from moetune.export import export_serving_adapter
    from moetune.testing.mxfp4_checkpoint import save_mxfp4_checkpoint

    if family == "gpt_oss_mxfp4":  # as the release stores it: fused MXFP4 blocks and scales
        model_dir = save_mxfp4_checkpoint(tmp_path / "m")
    else:
        model_dir = save_tiny_model(family, tmp_path / "m", tokenizer=False)
    adapter = _trained_adapter(model_dir, tmp_path / "adapter")
    result = export_serving_adapter(model_dir, adapter, tmp_path / "serve")
    assert result.fused > 0 and result.per_expert == 0
    trained = load_file(str(adapter / "adapter_model.safetensors"))
    served = load_file(str(tmp_path / "serve/adapter_model.safetensors"))
    stored = {k for shard in model_dir.glob("*.safetensors") for k in load_file(str(shard))}
    experts = {k for k in trained if ".experts." in k}
    assert experts and all(torch.equal(served[k], trained[k]) for k in experts)
    for key in set(served) - experts:  # every other pair names a checkpoint tensor
        assert key.removeprefix(PREFIX).rpartition(".lora_")[0] + ".weight" in stored, key
    config = json.loads((tmp_path / "serve/adapter_config.json").read_text())
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> Path:
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("q") / "m")


def _attach_save(path: Path, out: Path, lora_experts: int = 0, **kwargs) -> Path:
    from moetune.adapters import attach_lora, save_adapter
    from moetune.adapters.load import load_model
    from moetune.adapters.lora_experts import attach_lora_experts

    model = attach_lora(load_model(path, device="cpu", dtype="float32", progress=False), **kwargs)
    if lora_experts:
        attach_lora_experts(model, lora_experts, 8)
    save_adapter(model, out)
    return out


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"rank": 4, "alpha": 8, "modules_to_save": ("lm_head",)}, "whole weights beside the LoRA"),
        ({"rank": 4, "alpha": 8, "targets": ("q_proj", "experts", "gate")}, "LoRA on the router"),
        ({"rank": 4, "alpha": 8, "lora_experts": 2}, "LoRA experts"),
    ],
)
def test_what_no_engine_applies_is_refused_before_writing(qwen, tmp_path, kwargs, named) -> None:
    from moetune.export import export_serving_adapter

    adapter = _attach_save(qwen, tmp_path / "adapter", **kwargs)
    (tmp_path / "serve").mkdir()
    with pytest.raises(AdapterError, match=named):
        export_serving_adapter(qwen, adapter, tmp_path / "serve")
    assert list((tmp_path / "serve").iterdir()) == []


def test_output_folder_rules_and_the_command(qwen, tmp_path, capsys) -> None:
    from moetune.cli.main import main

    adapter = _attach_save(qwen, tmp_path / "adapter", rank=4, alpha=8)
    shutil.copy(qwen / "tokenizer.json", adapter)  # as moetune train's output holds it: it travels along
    out = tmp_path / "serve"
    for target in (adapter, qwen):
        assert main(["export", "--model", str(qwen), "--adapter", str(adapter), "--out", str(target)]) == 2
        assert "give a new folder" in capsys.readouterr().err
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy/notes.txt").write_text("mine")
    args = ["export", "--model", str(qwen), "--adapter", str(adapter), "--out"]
    assert main([*args, str(tmp_path / "busy"), "--overwrite"]) == 2
    assert "not an earlier moetune export" in capsys.readouterr().err
    assert (tmp_path / "busy/notes.txt").read_text() == "mine"
    # a trained adapter has the very file names an export writes: --overwrite must not take it for one
    assert main([*args, str(adapter), "--overwrite"]) == 2
    assert main([*args, str(shutil.copytree(adapter, tmp_path / "copy")), "--overwrite"]) == 2
    assert "not an earlier moetune export" in capsys.readouterr().err
    assert (
        load_file(str(tmp_path / "copy/adapter_model.safetensors")).keys()
        == load_file(str(adapter / "adapter_model.safetensors")).keys()
    )
    assert main([*args, str(out)]) == 0
    printed = capsys.readouterr().out
    assert "per expert" in printed and str(out) in printed
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    first = load_file(str(out / "adapter_model.safetensors"))
    assert main([*args, str(out)]) == 2  # an earlier export is replaced only when asked
    assert "--overwrite an earlier export" in capsys.readouterr().err
    assert main([*args, str(out), "--overwrite"]) == 0
    again = load_file(str(out / "adapter_model.safetensors"))
    assert again.keys() == first.keys() and all(torch.equal(again[k], first[k]) for k in first)
    assert not list(tmp_path.glob("serve.export-*"))


def test_output_paths_a_link_dot_and_a_killed_export(qwen, tmp_path, monkeypatch) -> None:
    """``--out`` through a symlink writes into its target (the link stays); ``.`` is the working folder by its
    name; an export killed between its two renames leaves the previous export, which the next run puts back."""
    from moetune.export import export_serving_adapter

    adapter = _attach_save(qwen, tmp_path / "adapter", rank=4, alpha=8)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    export_serving_adapter(qwen, adapter, tmp_path / "link")
    export_serving_adapter(qwen, adapter, tmp_path / "link", overwrite=True)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "real/adapter_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "link", "real"]
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    export_serving_adapter(qwen, adapter, ".")
    assert (tmp_path / "here/adapter_config.json").is_file()
    # killed between the renames: the previous export aside, nothing in place
    (tmp_path / "real").rename(tmp_path / "real.export-old")
    with pytest.raises(OutputDirError, match="not empty"):
        export_serving_adapter(qwen, adapter, tmp_path / "link")  # the previous export is back, not replaced
    assert (tmp_path / "real/adapter_model.safetensors").is_file()


def test_a_non_finite_adapter_is_refused(qwen, tmp_path) -> None:
    from moetune.export import export_serving_adapter

    adapter = _attach_save(qwen, tmp_path / "adapter", rank=4, alpha=8)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = next(k for k in tensors if ".experts." in k and "lora_B" in k)
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(AdapterError, match="NaN"):
        export_serving_adapter(qwen, adapter, tmp_path / "serve")
    assert not (tmp_path / "serve").exists()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.parametrize("only", ["gate_up_proj", "down_proj", "attention"])
def test_one_projection_or_attention_only(family, only, tmp_path) -> None:
    """An adapter with LoRA on one expert projection (its config edited to target one) or on attention alone:
    per expert, exactly that projection's pairs, equal to stock PEFT's logits applied as an engine does; fused
    (gpt-oss), one projection is refused by name (vLLM asserts both are there)."""
    from moetune.export import export_serving_adapter

    model_dir = save_tiny_model(family, tmp_path / "m", tokenizer=False)
    adapter = _trained_adapter(model_dir, tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    keep = {"gate_up_proj": ".experts.base_layer.lora_", "down_proj": ".experts.lora_"}
    if only == "attention":
        config["target_parameters"] = [e for e in config["target_parameters"] if "experts" not in e]
        tensors = {k: v for k, v in tensors.items() if ".experts." not in k}
    else:
        config["target_parameters"] = [
            e for e in config["target_parameters"] if "experts" not in e or only in e
        ]
        ours = {k: v for k, v in tensors.items() if keep[only] in k}
        tensors = {k: v for k, v in tensors.items() if ".experts." not in k}
        tensors |= {k.replace(".base_layer.", "."): v for k, v in ours.items()}  # one wrapper: no nesting
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    if family == "gpt_oss" and only != "attention":
        with pytest.raises(AdapterError, match="vLLM reads fused expert LoRA with both"):
            export_serving_adapter(model_dir, adapter, tmp_path / "serve")
        return
    result = export_serving_adapter(model_dir, adapter, tmp_path / "serve")
    served = load_file(str(tmp_path / "serve/adapter_model.safetensors"))
    expert_keys = {k for k in served if ".experts." in k}
    if only == "attention" or family == "gpt_oss":
        assert not expert_keys and result.per_expert == 0
    else:
        projections = {k.split(".experts.")[1].split(".")[1] for k in expert_keys}
        want = {"gate_up_proj": {"gate_proj", "up_proj", "w1", "w3"}, "down_proj": {"down_proj", "w2"}}[only]
        assert projections and projections <= want
    if family != "gpt_oss":
        _check_served(model_dir, adapter, tmp_path / "serve", tmp_path)


def test_experts_named_in_target_modules(qwen, tmp_path) -> None:
    """PEFT's other way to put LoRA on the experts (``add_adapter(LoraConfig(target_modules=[..., "experts"]))``):
    the same pairs, so the same export as with target_parameters (it once wrote no expert pair at all)."""
    from moetune.export import serving_adapter

    adapter = _trained_adapter(qwen, tmp_path / "adapter")
    want = serving_adapter(qwen, adapter).tensors
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_parameters"] = [e for e in config["target_parameters"] if "experts" not in e]
    config["target_modules"] = [*config["target_modules"], "experts"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    got = serving_adapter(qwen, adapter).tensors
    assert any(".experts.0." in k for k in got)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_fused_experts_named_in_target_modules_keep_their_entries(tmp_path) -> None:
    """gpt-oss (fused pairs kept) with its experts named in target_modules: the serving config still lists the
    fused parameters in target_parameters, as attach_lora writes them, and the pairs are the trained ones."""
    from moetune.export import serving_adapter

    model_dir = save_tiny_model("gpt_oss", tmp_path / "m", tokenizer=False)
    adapter = _trained_adapter(model_dir, tmp_path / "adapter")
    want = serving_adapter(model_dir, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["target_parameters"] = [e for e in config["target_parameters"] if "experts" not in e]
    config["target_modules"] = [*config["target_modules"], "experts"]
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    got = serving_adapter(model_dir, adapter)
    assert got.config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]
    assert got.tensors.keys() == want.tensors.keys()
    assert all(torch.equal(got.tensors[k], want.tensors[k]) for k in want.tensors)
