"""LoRA experts (``moetune.adapters.lora_experts``) against independent references: an unmodified transformers model
in float64 with the definition written out per expert (forward and every LoRA-experts gradient), the base model at
step 0 (zero-initialised down projection), stock PEFT on the saved adapter, and ``moetune.load_model(adapter=)``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moetune.testing.tiny import VOCAB, save_tiny_model

FAMILIES = ("qwen3_moe", "deepseek_v3")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {f: save_tiny_model(f, root / f, tokenizer=False) for f in FAMILIES}


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(4, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def _moetune(path: Path, n: int = 3, width: int = 5):
    """A moetune model with LoRA on o_proj and the experts, and LoRA experts (N=n, I'=width)."""
    from moetune.adapters import attach_lora, attach_lora_experts
    from moetune.loading import load_model

    model = attach_lora(
        load_model(path, device="cpu", dtype="float32", progress=False),
        rank=4,
        alpha=8,
        targets=("o_proj", "experts"),
    )
    attach_lora_experts(model, n, width)
    return model


def _randomize(model, seed: int = 3) -> None:
    """Every trained tensor (LoRA and LoRA experts) random, so no path can hide behind a zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _reference_hook(weights: dict[str, torch.Tensor]):
    """The definition, written out expert by expert in float64: output + mean_n D_n(silu(G_n x) * U_n x)."""

    def hook(module, args, output):
        x = args[0]
        g, u, d = weights["gate_proj"], weights["up_proj"], weights["down_proj"]
        extra = sum(F.linear(F.silu(F.linear(x, g[n])) * F.linear(x, u[n]), d[n]) for n in range(len(g)))
        extra = extra / len(g)
        return (output[0] + extra, *output[1:]) if isinstance(output, tuple) else output + extra

    return hook


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_and_gradients_match_float64_transformers(checkpoints, family) -> None:
    """Logits and the gradient of every LoRA-experts tensor equal an unmodified transformers model in float64
    whose MoE blocks get the definition through test-side hooks (the moetune model's other LoRA set to zero)."""
    from transformers import AutoModelForCausalLM

    from moetune.adapters.lora_experts import lora_experts_of

    path = checkpoints[family]
    model = _moetune(path)
    _randomize(model)
    with torch.no_grad():  # only the LoRA experts differ from the base model
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.zero_()
    ids = _ids()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    experts = lora_experts_of(model)
    assert len(experts) >= 1

    # transformers' grouped_mm experts refuse float64; its eager loop is the reference
    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, experts_implementation="eager"
    ).eval()
    ref_weights = {}
    for block, module in experts.items():
        w = {
            k: getattr(module, k).detach().double().requires_grad_(True)
            for k in ("gate_proj", "up_proj", "down_proj")
        }
        ref_weights[block] = w
        ref.get_submodule(block).register_forward_hook(_reference_hook(w))
    want = ref(input_ids=ids, labels=ids)
    want.loss.backward()
    torch.testing.assert_close(out.logits.double(), want.logits, atol=2e-5, rtol=1e-4)
    for block, module in experts.items():
        for k, w in ref_weights[block].items():
            got = getattr(module, k).grad
            assert got is not None and got.abs().max() > 0, (block, k)
            torch.testing.assert_close(got.double(), w.grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_zero_initialised_down_projection_leaves_the_base_model(checkpoints, family) -> None:
    """At step 0 (LoRA B and every D_n zero) the logits are the unmodified transformers model's; only the down
    projections get a gradient then (silu(G x) * U x is not zero)."""
    from transformers import AutoModelForCausalLM

    from moetune.adapters.lora_experts import lora_experts_of

    path = checkpoints[family]
    torch.manual_seed(0)
    model = _moetune(path)
    ids = _ids(2)
    out = model(input_ids=ids, labels=ids)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(out.logits, base, atol=1e-5, rtol=0)
    out.loss.backward()
    for module in lora_experts_of(model).values():
        assert module.down_proj.abs().max() == 0 and module.gate_proj.abs().max() > 0
        assert module.down_proj.grad is not None and module.down_proj.grad.abs().max() > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_disabling_the_adapter_switches_the_lora_experts_off(checkpoints, family) -> None:
    """The LoRA experts belong to the adapter: with PEFT's adapters disabled (``disable_adapter()``, which TRL's
    dpo/kto reference pass uses, or ``disable_adapter_layers()``) the random LoRA experts add nothing and the logits
    are the unmodified transformers model's; enabled again, the adapted logits come back."""
    from transformers import AutoModelForCausalLM

    path = checkpoints[family]
    model = _moetune(path)
    _randomize(model)
    ids = _ids(4)
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want, adapted = base(input_ids=ids).logits, model(input_ids=ids).logits
        assert (adapted - want).abs().max() > 1e-2
        with model.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, atol=0, rtol=0)
        model.base_model.disable_adapter_layers()
        torch.testing.assert_close(model(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        model.base_model.enable_adapter_layers()
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, atol=0, rtol=0)


def test_lora_experts_need_a_peft_adapter(checkpoints) -> None:
    """Attached to a model without PEFT LoRA they would have no adapter switch to follow: refused, named."""
    from moetune.adapters import attach_lora_experts
    from moetune.errors import AdapterError
    from moetune.loading import load_model

    model = load_model(checkpoints["qwen3_moe"], device="cpu", dtype="float32", progress=False)
    with pytest.raises(AdapterError, match="no PEFT LoRA layer; attach them to the PeftModel"):
        attach_lora_experts(model, 2, 4)


def test_saved_adapter_reloads_exactly_and_its_stock_part_loads_in_stock_peft(checkpoints, tmp_path) -> None:
    """save_adapter writes the stock pair plus moetune_lora_experts.safetensors; load_model(adapter=) restores
    both (identical logits, LoRA experts frozen like the LoRA); stock PEFT loads the stock pair alone and computes
    the moetune model with its LoRA experts' down projections zeroed."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import moetune
    from moetune.adapters import save_adapter
    from moetune.adapters.lora_experts import lora_experts_of

    path = checkpoints["qwen3_moe"]
    model = _moetune(path)
    _randomize(model)
    ids = _ids(3)
    want = model.eval()(input_ids=ids).logits
    save_adapter(model, tmp_path / "a")
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == ["adapter_config.json", "adapter_model.safetensors", "moetune_lora_experts.safetensors"]
    stock_keys = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    assert all(".lora_A." in k or ".lora_B." in k for k in stock_keys)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert not config.get("modules_to_save")

    again = moetune.load_model(path, device="cpu", dtype="float32", adapter=tmp_path / "a", progress=False)
    assert torch.equal(again(input_ids=ids).logits, want)
    assert not any(p.requires_grad for p in again.parameters())
    trainable = moetune.load_model(
        path, device="cpu", dtype="float32", adapter=tmp_path / "a", adapter_trainable=True, progress=False
    )
    assert all(p.requires_grad for m in lora_experts_of(trainable).values() for p in m.parameters())

    stock = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), tmp_path / "a"
    )
    with torch.no_grad():
        for module in lora_experts_of(again).values():
            module.down_proj.zero_()
    torch.testing.assert_close(
        stock.eval()(input_ids=ids).logits, again(input_ids=ids).logits, atol=1e-5, rtol=0
    )
    assert (stock(input_ids=ids).logits - want).abs().max() > 1e-2  # the LoRA experts matter


def test_peft_save_pretrained_writes_the_lora_experts_too(checkpoints, tmp_path) -> None:
    """PEFT's own ``save_pretrained`` (a notebook's, or a Trainer's checkpoint) on a model with LoRA experts writes
    moetune_lora_experts.safetensors beside the stock pair, with the same adapter_config.json as save_adapter: the
    folder reloads through load_model(adapter=) to identical logits (before, it lacked the file and reloaded as a
    model without LoRA experts). A loaded adapter saved again the same way keeps them, a deep copy of the model
    saves its own; a config that outlived its model refuses to save instead of dropping them."""
    import copy
    import gc

    import moetune
    from moetune.adapters import save_adapter
    from moetune.adapters.lora_experts import lora_experts_of
    from moetune.errors import SaveError

    path = checkpoints["qwen3_moe"]
    model = _moetune(path)
    _randomize(model)
    twin = copy.deepcopy(model)  # a deep copy saves its own LoRA experts, not the original's (below)
    ids = _ids(4)
    want = model.eval()(input_ids=ids).logits
    model.save_pretrained(tmp_path / "peft")
    save_adapter(model, tmp_path / "moetune")
    files = sorted(p.name for p in (tmp_path / "peft").iterdir())
    assert "moetune_lora_experts.safetensors" in files and "adapter_model.safetensors" in files
    config = {d: json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("peft", "moetune")}
    assert config["peft"] == config["moetune"]
    # in a fixed order whatever the process's string hashing (PEFT holds them as a set)
    assert config["peft"]["target_modules"] == sorted(config["peft"]["target_modules"])
    again = moetune.load_model(path, device="cpu", dtype="float32", adapter=tmp_path / "peft", progress=False)
    assert torch.equal(again(input_ids=ids).logits, want)

    again.save_pretrained(tmp_path / "again")
    third = moetune.load_model(
        path, device="cpu", dtype="float32", adapter=tmp_path / "again", progress=False
    )
    assert torch.equal(third(input_ids=ids).logits, want)

    with torch.no_grad():
        for module in lora_experts_of(twin).values():
            module.down_proj.mul_(-1)
    twin_logits = twin(input_ids=ids).logits
    twin.save_pretrained(tmp_path / "twin")
    loaded = moetune.load_model(
        path, device="cpu", dtype="float32", adapter=tmp_path / "twin", progress=False
    )
    assert torch.equal(loaded(input_ids=ids).logits, twin_logits) and not torch.equal(twin_logits, want)

    orphan = copy.deepcopy(model.peft_config["default"])
    del model, again, third, twin, loaded
    gc.collect()
    with pytest.raises(SaveError, match="LoRA experts it saves is gone"):
        orphan.save_pretrained(str(tmp_path / "orphan"))


def test_a_bad_lora_experts_file_is_refused_before_the_model_loads(
    checkpoints, tmp_path, monkeypatch
) -> None:
    """A LoRA-experts file for other blocks, of the wrong hidden size or not moetune's is an AdapterError naming the
    file, raised before any weight is read (the checkpoint loader is not reached)."""
    from safetensors.torch import save_file

    import moetune
    import moetune.loading
    from moetune.adapters import save_adapter
    from moetune.errors import AdapterError

    path = checkpoints["qwen3_moe"]
    model = _moetune(path, n=2, width=3)
    save_adapter(model, tmp_path / "a")
    file = tmp_path / "a" / "moetune_lora_experts.safetensors"
    good = file.read_bytes()

    def forbidden(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(moetune.loading, "load_model", forbidden)
    from safetensors.torch import load_file

    state = load_file(str(file))
    from moetune.adapters.lora_experts import read_spec

    meta = read_spec(file).metadata()
    cases = {
        "other blocks": ({k.replace("layers.", "layers.9"): v for k, v in state.items()}, meta),
        "hidden size": (state, {**meta, "hidden_size": "7"}),
        "not moetune's": (state, {**meta, "format": "other"}),
        "shape": ({**state, next(iter(state)): torch.zeros(1, 1, 1)}, meta),
    }
    for what, (tensors, metadata) in cases.items():
        save_file(tensors, str(file), metadata=metadata)
        with pytest.raises(AdapterError, match="moetune_lora_experts.safetensors"):
            moetune.load_model(path, device="cpu", dtype="float32", adapter=tmp_path / "a", progress=False)
        file.write_bytes(good)
        assert what


def test_a_new_save_without_lora_experts_removes_the_old_file(checkpoints, tmp_path) -> None:
    """The adapter's files are one commit: saving an adapter without LoRA experts over one with them leaves no
    stale LoRA-experts file to pair with the new adapter; with save_adapter and with PEFT's own save_pretrained
    (which before left it, so the folder reloaded with the old adapter's LoRA experts)."""
    import moetune
    from moetune.adapters import attach_lora, save_adapter
    from moetune.adapters.lora_experts import lora_experts_of
    from moetune.loading import load_model

    path = checkpoints["qwen3_moe"]
    plain = attach_lora(load_model(path, device="cpu", dtype="float32", progress=False), rank=4, alpha=8)
    for save in (save_adapter, lambda model, folder: model.save_pretrained(folder)):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        save_adapter(_moetune(path), folder)
        assert (folder / "moetune_lora_experts.safetensors").is_file()
        save(plain, folder)
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
        assert not (folder / "moetune_lora_experts.safetensors").exists()
        again = moetune.load_model(path, device="cpu", dtype="float32", adapter=folder, progress=False)
        assert not lora_experts_of(again)


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    from moetune.train.demo import make_demo_model

    root = Path(__file__).resolve().parents[2]
    return make_demo_model(tmp_path_factory.mktemp("demo") / "tiny", root / "examples/data/demo_tokenizer")


def test_moetune_train_checkpoints_resumes_and_saves_lora_experts(tmp_path, demo_model) -> None:
    """`moetune train` with lora_experts: every checkpoint holds them beside the adapter, a run resumed from the
    step-2 checkpoint reaches the uninterrupted run's losses and LoRA experts (their trained values are restored,
    not re-initialised), the final adapter reloads through load_model(adapter=) to the trained model's logits, and
    a checkpoint without them is refused before the model loads."""
    import shutil

    from safetensors.torch import load_file

    from moetune.adapters.load import load_model
    from moetune.config import load_config
    from moetune.errors import CheckpointError
    from moetune.train.recipe import run
    from tests.integration.test_train import _config, _losses

    sizes = {"lora_experts": 2, "lora_expert_intermediate_size": 4, "max_steps": 4, "save_steps": 2}
    (tmp_path / "a").mkdir()
    result = run(load_config(_config(tmp_path / "a", demo_model, **sizes)), progress=False)
    out = tmp_path / "a" / "out"
    for folder in (out, out / "checkpoint-2", out / "checkpoint-4"):
        assert (folder / "moetune_lora_experts.safetensors").is_file(), folder
    final = load_file(str(out / "moetune_lora_experts.safetensors"))
    assert all(v.abs().max() > 0 for k, v in final.items() if k.endswith("down_proj"))  # trained away from 0

    ids = torch.randint(4, 17, (2, 10))
    want = result.model.eval()(input_ids=ids).logits
    again = load_model(demo_model, device="cpu", dtype="float32", progress=False, adapter=out)
    torch.testing.assert_close(again(input_ids=ids).logits, want, atol=1e-6, rtol=0)

    resumed = _config(
        tmp_path / "a",
        demo_model,
        **sizes,
        resume_from_checkpoint=str(out / "checkpoint-2"),
        output_dir=str(tmp_path / "b"),
    )
    run(load_config(resumed), progress=False)
    assert _losses(tmp_path / "b")[2:] == pytest.approx(_losses(out)[2:], abs=1e-6)
    got = load_file(str(tmp_path / "b" / "moetune_lora_experts.safetensors"))
    for key, value in final.items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=0)

    shutil.copytree(out / "checkpoint-2", tmp_path / "c" / "checkpoint-2")
    (tmp_path / "c" / "checkpoint-2" / "moetune_lora_experts.safetensors").unlink()
    bad = _config(
        tmp_path / "a",
        demo_model,
        **sizes,
        resume_from_checkpoint=str(tmp_path / "c" / "checkpoint-2"),
        output_dir=str(tmp_path / "c"),
    )
    with pytest.raises(CheckpointError, match="moetune_lora_experts.safetensors is missing"):
        run(load_config(bad), progress=False)


def test_gradient_checkpointing_gives_the_same_steps(tmp_path, demo_model) -> None:
    """The block's forward hook runs again in the checkpointed recompute: the same losses with and without."""
    from moetune.config import load_config
    from moetune.train.recipe import run
    from tests.integration.test_train import _config, _losses

    losses = []
    for checkpointing in (False, True):
        folder = tmp_path / str(checkpointing)
        folder.mkdir()
        cfg = _config(
            folder,
            demo_model,
            lora_experts=2,
            lora_expert_intermediate_size=4,
            max_steps=3,
            save_steps=10,
            gradient_checkpointing=checkpointing,
        )
        run(load_config(cfg), progress=False)
        losses.append(_losses(folder / "out"))
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)
