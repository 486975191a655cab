"""Training modes (moetune.train.modes) against the unmodified transformers model in float64.

For qwen3_moe, deepseek_v3 and gpt_oss (transposed, interleaved experts with biases): full mode's gradients of
every parameter, routed experts included, equal stock autograd's; freeze trains exactly the chosen modules with
stock's gradients; frozen experts (LoRA not on the experts) hold no trainable tensor and their engine forms only
input and routing gradients; a router that is not an nn.Linear takes LoRA through target_parameters and the saved
adapter loads in stock PEFT; a full-mode model saves a checkpoint plain transformers loads.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from moetune.config.schema import FinetuningType
from moetune.errors import ConfigError
from moetune.testing.inputs import text_inputs
from moetune.testing.tiny import save_tiny_model
from moetune.train.modes import ModeSettings

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss")
TOL = 1e-12  # float64 on both sides; only summation order differs


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, save_tiny_model(request.param, tmp_path_factory.mktemp(request.param) / "m")


def _stock(path: Path):
    from transformers import AutoConfig

    from moetune.testing.tiny import auto_class

    # transformers' grouped_mm experts refuse float64; its eager loop is the reference
    cls = auto_class(AutoConfig.from_pretrained(path))
    return cls.from_pretrained(path, dtype=torch.float64, experts_implementation="eager").train()


def _moetune(path: Path, **mode):
    from moetune.loading import load_model
    from moetune.train.modes import ModeSettings, apply_mode

    model = load_model(path, device="cpu", dtype="float64", progress=False)
    return apply_mode(model, ModeSettings(**mode)).train()


def _backward(model) -> float:
    inputs = text_inputs(0, 2, 14)
    loss = model(**inputs, labels=inputs["input_ids"]).loss
    loss.backward()
    return float(loss.detach())


def _grads_in_stock_layout(model) -> dict[str, torch.Tensor | None]:
    """Every parameter's gradient, the routed experts' turned into the transformers module's layout."""
    from moetune.layer import CpuExperts
    from moetune.layer.runtime_layout import to_runtime

    experts = {p: m for p, m in model.named_modules() if isinstance(m, CpuExperts)}
    out = {}
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        g = p.grad if p.requires_grad else None
        out[name] = to_runtime(leaf, g, experts[module].layout) if module in experts and g is not None else g
    return out


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    return bool((a - b).abs().max() <= TOL * max(float(b.abs().max()), 1.0))


def test_full_mode_gradients_equal_transformers(family) -> None:
    from moetune.engine import TrainMode
    from moetune.layer import CpuExperts

    _, path = family
    stock, model = _stock(path), _moetune(path, method=FinetuningType.FULL)
    engines = [m.engine for m in model.modules() if isinstance(m, CpuExperts)]
    assert engines and all(e.mode is TrainMode.FULL for e in engines)
    assert _backward(model) == pytest.approx(_backward(stock), abs=1e-12)
    ref = dict(stock.named_parameters())
    got = _grads_in_stock_layout(model)
    assert set(got) == set(ref)  # every parameter trains, under its stock name
    for name, g in got.items():
        assert g is not None and _close(g, ref[name].grad), name


def test_router_aux_loss_joins_the_loss_as_in_transformers(family) -> None:
    """moe_aux_loss_coef (LLaMA-Factory's key): the load-balancing loss weighted into the loss and its gradient,
    as transformers computes them with output_router_logits; refused where the family has no such loss."""
    from transformers import AutoModelForCausalLM

    from moetune.loading.load import plan_load
    from moetune.loading.options import LoadOptions
    from moetune.train.modes import check_mode

    name, path = family
    settings = {"method": FinetuningType.FULL, "aux_loss_coef": 0.5}
    if name == "deepseek_v3":  # its routing is aux-loss-free
        meta = plan_load(path, LoadOptions.create(device="cpu")).model
        with pytest.raises(
            ConfigError, match="moe_aux_loss_coef: 0.5 is set, but DeepseekV3ForCausalLM computes no"
        ):
            check_mode(meta, ModeSettings(**settings), [], [])
        return
    stock = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=torch.float64,
        experts_implementation="eager",
        output_router_logits=True,
        router_aux_loss_coef=0.5,
    ).train()
    plain = _backward(_stock(path))
    model = _moetune(path, **settings)
    loss = _backward(model)
    assert loss == pytest.approx(_backward(stock), abs=1e-12) and abs(loss - plain) > 1e-3
    ref = dict(stock.named_parameters())
    for n, g in _grads_in_stock_layout(model).items():
        assert _close(g, ref[n].grad), n


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    [
        "mixtral",
        "qwen2_moe",
        "olmoe",
        "deepseek_v2",
        "glm4_moe",
        "ernie4_5_moe",
        "minimax",
        "qwen3_5_moe",
        "qwen3_vl_moe",
    ],
)
def test_full_mode_on_the_other_tiny_families(name, tmp_path) -> None:
    """The full-mode battery on every other tiny family: stock gradients (parameters the text batch does not
    reach, e.g. a vision tower, have none on both sides) and a saved checkpoint with the base checkpoint's keys."""
    from moetune.train.model_save import save_model

    path = save_tiny_model(name, tmp_path / "m")
    stock, model = _stock(path), _moetune(path, method=FinetuningType.FULL)
    _backward(stock), _backward(model)
    ref = dict(stock.named_parameters())
    got = _grads_in_stock_layout(model)
    assert set(got) == set(ref)
    for n, g in got.items():
        assert (g is None) == (ref[n].grad is None), n
        assert g is None or _close(g, ref[n].grad), n
    save_model(model, tmp_path / "out")
    assert _weights(tmp_path / "out").keys() == _weights(path).keys()


def test_full_mode_with_activation_checkpointing_gives_the_same_gradients(family) -> None:
    """The checkpointing memo (one engine forward per layer, reused by the recompute) with trained base weights."""
    from moetune.layer import CpuExperts

    _, path = family
    plain, ckpt = _moetune(path, method=FinetuningType.FULL), _moetune(path, method=FinetuningType.FULL)
    ckpt.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ckpt.train()
    engines = [m.engine for m in ckpt.modules() if isinstance(m, CpuExperts)]
    before = [e._forwards for e in engines]
    _backward(plain), _backward(ckpt)
    assert [e._forwards - b for e, b in zip(engines, before)] == [1] * len(engines)
    want = dict(plain.named_parameters())
    for n, p in ckpt.named_parameters():
        assert _close(p.grad, want[n].grad), n


def test_freeze_trains_the_chosen_modules_with_stock_gradients(family) -> None:
    _, path = family
    stock = _stock(path)
    model = _moetune(
        path,
        method=FinetuningType.FREEZE,
        trainable_layers=-1,
        trainable_modules=("mlp",),
        extra_modules=("norm",),
    )
    _backward(stock), _backward(model)
    ref = dict(stock.named_parameters())
    got = _grads_in_stock_layout(model)
    trained = {n for n, g in got.items() if g is not None}
    # the first layer's MLP (routed experts too where layer 0 is an MoE layer) and the final norm, nothing else
    expected = {n for n in ref if n.startswith("model.layers.0.mlp.") or n == "model.norm.weight"}
    assert trained == expected
    for name in trained:
        assert _close(got[name], ref[name].grad), name


def test_frozen_experts_hold_nothing_trainable_and_lora_gradients_are_exact(family) -> None:
    """LoRA on attention only: no expert tensor trains, every engine is FROZEN (backward forms no weight
    gradient and gathers no inputs), and the LoRA gradients equal stock PEFT's on the transformers model."""
    from peft import LoraConfig, get_peft_model

    from moetune.adapters import attach_lora
    from moetune.engine import TrainMode
    from moetune.layer import CpuExperts
    from moetune.loading import load_model

    _, path = family
    model = attach_lora(
        load_model(path, device="cpu", dtype="float64", progress=False), rank=4, alpha=8, targets=("o_proj",)
    )
    engines = [m.engine for m in model.modules() if isinstance(m, CpuExperts)]
    assert engines and all(e.mode is TrainMode.FROZEN and not e.plan.gather_inputs for e in engines)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".o_proj.lora_" in n for n in trainable)
    stock = get_peft_model(_stock(path), LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1)
    stock.load_state_dict({n: p for n, p in model.named_parameters() if p.requires_grad}, strict=False)
    model.train(), stock.train()
    _backward(model), _backward(stock)
    ref = dict(stock.named_parameters())
    for n in trainable:
        assert _close(dict(model.named_parameters())[n].grad, ref[n].grad), n


def test_router_lora_and_full_router_training(tmp_path) -> None:
    """qwen3_moe's router is a TopKRouter (not nn.Linear): lora_target 'gate' gives it LoRA through PEFT's
    target_parameters; gradients equal stock PEFT's on the transformers model and the saved adapter loads there
    with the same logits. additional_target 'gate' trains the router fully (PEFT modules_to_save)."""
    from peft import PeftModel

    from moetune.adapters import attach_lora, save_adapter
    from moetune.loading import load_model

    path = save_tiny_model("qwen3_moe", tmp_path / "m")
    model = attach_lora(
        load_model(path, device="cpu", dtype="float64", progress=False), rank=4, alpha=8, targets=("gate",)
    )
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".mlp.gate." in n and ".lora_" in n for n in trainable)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.1)
    save_adapter(model, tmp_path / "adapter")
    stock = PeftModel.from_pretrained(_stock(path), tmp_path / "adapter", is_trainable=True)
    model.train()
    inputs = text_inputs(0, 2, 14)
    ours, theirs = model(**inputs).logits, stock(**inputs).logits
    assert _close(ours, theirs)
    _backward(model), _backward(stock)
    ref = dict(stock.named_parameters())
    for n in trainable:
        assert _close(dict(model.named_parameters())[n].grad, ref[n].grad), n

    full = attach_lora(
        load_model(path, device="cpu", dtype="float64", progress=False),
        rank=4,
        alpha=8,
        targets=("q_proj",),
        modules_to_save=("gate",),
    )
    routers = [n for n, p in full.named_parameters() if p.requires_grad and ".mlp.gate." in n]
    assert routers and all("modules_to_save" in n for n in routers)
    _backward(full)
    assert all(dict(full.named_parameters())[n].grad.abs().sum() > 0 for n in routers)
    with (
        torch.no_grad()
    ):  # a trained router (and LoRA) saved in the adapter: stock PEFT gives the same logits
        for p in full.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.1)
    save_adapter(full, tmp_path / "hybrid")
    stock = PeftModel.from_pretrained(_stock(path), tmp_path / "hybrid").eval()
    with torch.no_grad():
        assert _close(full.eval()(**inputs).logits, stock(**inputs).logits)
    _loads_back_as_stock_peft(path, tmp_path / "hybrid", inputs)
    _loads_back_as_stock_peft(path, tmp_path / "adapter", inputs)


def _loads_back_as_stock_peft(path: Path, adapter: Path, inputs: dict) -> None:
    """moetune's own loader (``moetune.load_model(adapter=...)``, what generate and chat use) takes ``adapter``
    and gives stock PEFT's logits on the transformers model: it refused router LoRA and modules_to_save before."""
    from peft import PeftModel

    from moetune import load_model

    ours = load_model(path, device="cpu", dtype="float64", adapter=adapter, progress=False)
    stock = PeftModel.from_pretrained(_stock(path), adapter).eval()
    assert not any(p.requires_grad for p in ours.parameters())
    with torch.no_grad():
        assert _close(ours(**inputs).logits, stock(**inputs).logits)


def test_an_lm_head_adapter_loads_back(tmp_path) -> None:
    """LoRA on lm_head: PEFT may save the layer's base weight beside it (save_embedding_layers); moetune's loader
    takes the adapter either way, with stock PEFT's logits."""
    from moetune.adapters import attach_lora, save_adapter
    from moetune.loading import load_model

    path = save_tiny_model("qwen3_moe", tmp_path / "m")
    model = attach_lora(
        load_model(path, device="cpu", dtype="float64", progress=False), rank=4, alpha=8, targets=("lm_head",)
    )
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(std=0.1)
    save_adapter(model, tmp_path / "adapter")
    _loads_back_as_stock_peft(path, tmp_path / "adapter", text_inputs(0, 2, 14))
    from transformers import AutoConfig

    from moetune.adapters.check import check_adapter_folder
    from moetune.tensorfile import read_header

    assert "base_model.model.lm_head.base_layer.weight" in read_header(
        tmp_path / "adapter" / "adapter_model.safetensors"
    )
    tied = AutoConfig.from_pretrained(path)
    tied.tie_word_embeddings = (
        True  # lm_head's weight is then the embedding's: its name is checked all the same
    )
    check_adapter_folder(tmp_path / "adapter", tied)


def test_full_model_saves_a_checkpoint_plain_transformers_loads(family, tmp_path) -> None:
    """After every expert weight changed in place, the saved checkpoint has the base checkpoint's own keys
    (qwen3_moe, deepseek_v3: per expert; gpt_oss: fused, transposed and interleaved) and loads in plain
    transformers with the same logits."""
    from moetune.train.model_save import save_model

    _, path = family
    model = _moetune(path, method=FinetuningType.FULL).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.add_(torch.randn_like(p) * 0.05)
    save_model(model, tmp_path / "out")
    assert not list((tmp_path / "out").glob(".model.tmp-*"))
    assert _weights(tmp_path / "out").keys() == _weights(path).keys()
    reloaded = _stock(tmp_path / "out").eval()
    inputs = text_inputs(0, 2, 14)
    with torch.no_grad():
        assert _close(model(**inputs).logits, reloaded(**inputs).logits)


ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    from moetune.train.demo import make_demo_model

    return make_demo_model(tmp_path_factory.mktemp("demo") / "tiny", ROOT / "examples/data/demo_tokenizer")


def _run(tmp: Path, model: Path, **over):
    import yaml

    from moetune.config import load_config
    from moetune.train.recipe import run

    cfg = {
        "model_name_or_path": str(model),
        "finetuning_type": "full",
        "dataset": "demo_train",
        "eval_dataset": "demo_heldout",
        "dataset_dir": str(ROOT / "examples/data"),
        "max_samples": 64,
        "cutoff_len": 32,
        "output_dir": str(tmp / "out"),
        "per_device_train_batch_size": 8,
        "per_device_eval_batch_size": 16,
        "learning_rate": 3e-3,
        "max_steps": 6,
        "logging_steps": 1,
        "save_steps": 3,
        "eval_strategy": "steps",
        "eval_steps": 6,
        "seed": 0,
        "gradient_checkpointing": False,
        "report_to": "none",
        "moetune": {"device": "cpu", "num_threads": 1},
        **over,
    }
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return run(load_config(tmp / "cfg.yaml"), progress=False)


def _eval_loss(model, trainer) -> float:
    return float(trainer.evaluate()["eval_loss"])


def test_full_training_lowers_held_out_loss_resumes_exactly_and_saves_a_transformers_checkpoint(
    tmp_path, demo_model
) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    whole = _run(tmp_path / "whole", demo_model)
    out = tmp_path / "whole" / "out"
    logs = whole.trainer.state.log_history
    assert whole.summary["memory"]["trainable_host_params"] > 0  # the routed experts trained on the host
    assert whole.summary["final_eval_loss"] < _eval_loss(None, _untrained_trainer(whole, demo_model))
    ckpt = out / "checkpoint-3"  # written layer by layer, indexes last (moetune.train.layered)
    assert not (ckpt / "optimizer.pt").exists()
    assert {
        "model-model.layers.0.safetensors",
        "optimizer-model.layers.2.safetensors",
        "optimizer-other.safetensors",
    } <= {p.name for p in ckpt.iterdir()}
    index = json.loads((ckpt / "optimizer.index.json").read_text())
    assert (
        index["files"]["model.layers.0.mlp.experts.gate_up_proj/exp_avg"]
        == "optimizer-model.layers.0.safetensors"
    )
    # resumed from checkpoint-3 of the same run: the same losses and the same final weights
    _run(
        tmp_path / "resumed",
        demo_model,
        resume_from_checkpoint=str(out / "checkpoint-3"),
    )
    want = [h["loss"] for h in logs if "loss" in h]
    got = [h["loss"] for h in _log(tmp_path / "resumed" / "out") if "loss" in h]
    assert len(want) == 6 and got[3:] == pytest.approx(want[3:], abs=1e-6)
    a, b = _weights(out), _weights(tmp_path / "resumed" / "out")
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    # the final output is a plain transformers checkpoint with the trained experts
    stock = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(4, 17, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(stock(input_ids=ids).logits, whole.model.eval()(input_ids=ids).logits)
    base = load_file(next(demo_model.glob("*.safetensors")))
    assert a.keys() == base.keys()  # the base checkpoint's own keys
    assert any(".experts." in k and not torch.equal(a[k], base[k]) for k in a)  # the experts trained


@pytest.mark.parametrize(
    ("over", "state"),
    [
        ({"optim": "adamw_torch", "max_grad_norm": 0.5}, "fp32"),
        (
            {
                "optim": "adamw_torch",
                "max_grad_norm": 0.0,
                "gradient_accumulation_steps": 2,
                "gradient_checkpointing": True,
            },
            "fp32",
        ),
        (
            {"optim": "adamw_anyprecision", "optim_args": "momentum_dtype=bfloat16,variance_dtype=bfloat16"},
            "bf16",
        ),
        ({"optim": "adamw_8bit", "expert_update": "lazy"}, "8bit"),
    ],
    ids=["fp32-clip", "fp32-overlap-accum-checkpointing", "bf16", "8bit-lazy"],
)
def test_expert_optimizer_state_is_saved_by_layer_and_resumes_exactly(
    over, state, tmp_path, demo_model
) -> None:
    """Each state format of the experts' optimizer (moetune.train.expert_optim) is written layer by layer in its
    own dtype and a resume from the mid-run checkpoint ends with the very same weights."""
    from safetensors import safe_open

    from moetune.train.expert_optim import unwrap

    over = {
        "max_steps": 4,
        "save_steps": 2,
        "eval_strategy": "no",
        "eval_dataset": None,
        "eval_steps": None,
        **over,
    }
    whole = _run(tmp_path / "whole", demo_model, **over)
    assert whole.summary["memory"]["expert_optim_state"] == state
    assert whole.summary["memory"]["host_expert_grads_peak_gb"] > 0
    early = unwrap(whole.trainer.optimizer).early_updates
    assert (early > 0) == (over.get("max_grad_norm", 1.0) == 0)  # overlap only without clipping
    ckpt = tmp_path / "whole" / "out" / "checkpoint-2"
    index = json.loads((ckpt / "optimizer.index.json").read_text())
    key = "model.layers.0.mlp.experts.gate_up_proj/" + ("exp_avg_q" if state == "8bit" else "exp_avg")
    with safe_open(str(ckpt / index["files"][key]), "pt") as f:
        want = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.int8}[state]
        assert f.get_tensor(key).dtype == want
    _run(tmp_path / "resumed", demo_model, resume_from_checkpoint=str(ckpt), **over)
    a, b = _weights(tmp_path / "whole" / "out"), _weights(tmp_path / "resumed" / "out")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _untrained_trainer(run, demo_model):
    """The same trainer's eval on the untrained model (a fresh load)."""
    from moetune.loading import load_model
    from moetune.train.trainer import MoetuneTrainer

    model = load_model(demo_model, device="cpu", dtype="float32", progress=False)
    return MoetuneTrainer(
        model=model,
        args=run.trainer.args,
        eval_dataset=run.trainer.eval_dataset,
        data_collator=run.trainer.data_collator,
    )


def _log(out: Path) -> list[dict]:
    import json

    return json.loads((out / "trainer_state.json").read_text())["log_history"]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}


def _trainable(model) -> set[str]:
    return {n.removeprefix("base_model.model.") for n, p in model.named_parameters() if p.requires_grad}


def _check_full(run, out: Path) -> None:
    from moetune.layer import CpuExperts

    experts = sum(p.numel() for m in run.model.modules() if isinstance(m, CpuExperts) for p in m.parameters())
    assert experts and run.summary["memory"]["trainable_host_params"] == experts
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()


def _check_freeze(run, out: Path) -> None:
    assert _trainable(run.model) == {
        n
        for n, _ in run.model.named_parameters()
        if n.startswith("model.layers.2.") or n == "model.norm.weight"
    }
    assert any(".experts." in n for n in _trainable(run.model))


def _check_frozen_experts(run, out: Path) -> None:
    from moetune.engine import TrainMode
    from moetune.layer import CpuExperts

    assert not any(".experts." in n for n in _trainable(run.model))
    assert all(m.engine.mode is TrainMode.FROZEN for m in run.model.modules() if isinstance(m, CpuExperts))
    assert run.summary["memory"]["trainable_host_params"] == 0


def _check_router_lora(run, out: Path) -> None:
    import json

    conf = json.loads((out / "adapter_config.json").read_text())
    assert "gate.weight" in conf["target_parameters"]
    assert any(".mlp.gate." in n and ".lora_A." in n for n in _trainable(run.model))


def _check_lora_full_router(run, out: Path) -> None:
    import json

    from safetensors.torch import load_file

    assert json.loads((out / "adapter_config.json").read_text())["modules_to_save"] == ["gate"]
    assert any(k.endswith("mlp.gate.weight") for k in load_file(out / "adapter_model.safetensors"))


def _check_gpu_experts(run, out: Path) -> None:
    from moetune.layer import CpuExperts

    experts = [m for m in run.model.modules() if isinstance(m, CpuExperts)]
    assert experts and all(m.hot is not None and m.hot.ids.tolist() == [0, 1] for m in experts)
    assert any(".experts." in n for n in _trainable(run.model))  # expert LoRA, hot rows included
    assert run.summary["memory"]["hot_experts_device_gb"] > 0


def _check_lora_experts(run, out: Path) -> None:
    assert (out / "moetune_lora_experts.safetensors").is_file()
    assert any(".extra_experts.down_proj" in n for n in _trainable(run.model))


EXAMPLES = {
    "demo_full.yaml": _check_full,
    "demo_gpu_experts.yaml": _check_gpu_experts,
    "demo_lora_experts.yaml": _check_lora_experts,
    "demo_freeze.yaml": _check_freeze,
    "demo_frozen_experts.yaml": _check_frozen_experts,
    "demo_router_lora.yaml": _check_router_lora,
    "demo_lora_full_router.yaml": _check_lora_full_router,
}


def _one_step_example(example: str, tmp_path: Path, demo_model: Path) -> dict:
    """examples/``example`` on the demo model for one step, written to ``tmp_path/cfg.yaml``; returns it."""
    import yaml

    cfg = yaml.safe_load((ROOT / "examples" / example).read_text())
    cfg.update(
        model_name_or_path=str(demo_model),
        output_dir=str(tmp_path / "out"),
        dataset_dir=str(ROOT / "examples/data"),
        max_samples=8,
        max_steps=1,
        per_device_train_batch_size=4,
        plot_loss=False,
    )
    cfg["moetune"] = {**cfg["moetune"], "num_threads": 1}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    return cfg


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_mode_example_trains_what_it_says(example, tmp_path, demo_model) -> None:
    """Every shipped mode example, run for one step on the demo model, trains exactly its mode's tensors."""
    from moetune.config import load_config
    from moetune.train.recipe import run

    cfg = _one_step_example(example, tmp_path, demo_model)
    result = run(load_config(tmp_path / "cfg.yaml"), progress=False)
    assert result.summary["finetuning_type"] == cfg["finetuning_type"]
    EXAMPLES[example](result, tmp_path / "out")


def test_every_mode_example_is_covered() -> None:
    shipped = {p.name for p in (ROOT / "examples").glob("demo_*.yaml")} - {"demo_lora.yaml"}
    assert shipped == set(EXAMPLES)


def test_pure_bf16_keeps_the_trained_experts_in_bf16(tmp_path, demo_model) -> None:
    """bf16 upcasts trainable weights to fp32 (as LLaMA-Factory); pure_bf16 keeps them, grads and moments bf16."""
    from moetune.layer import CpuExperts

    def expert_dtypes(run) -> set[torch.dtype]:
        return {p.dtype for m in run.model.modules() if isinstance(m, CpuExperts) for p in m.parameters()}

    over = {"max_steps": 1, "eval_strategy": "no", "eval_dataset": None, "eval_steps": None, "bf16": True}
    upcast = _run(tmp_path / "a", demo_model, **over)
    pure = _run(tmp_path / "b", demo_model, pure_bf16=True, **over)
    assert expert_dtypes(upcast) == {torch.float32} and expert_dtypes(pure) == {torch.bfloat16}
    state = pure.trainer.optimizer.state
    assert all(s["exp_avg"].dtype == torch.bfloat16 for s in state.values() if "exp_avg" in s)
    # the experts' moments follow the weights' dtype (optim adamw_torch, as torch's zeros_like); their sparse
    # gradients are fp32 either way (summed over micro-batches)
    assert pure.summary["memory"]["host_expert_state_gb"] == pytest.approx(
        upcast.summary["memory"]["host_expert_state_gb"] / 2, rel=0.01
    )
    assert pure.summary["memory"]["host_expert_grads_peak_gb"] > 0


def test_moetune_train_prints_the_modes_memory(tmp_path, demo_model, capsys) -> None:
    """`moetune train` on the freeze example: the printed summary names the mode and its host/device memory."""
    from moetune.cli.main import main

    _one_step_example("demo_freeze.yaml", tmp_path, demo_model)
    assert main(["train", str(tmp_path / "cfg.yaml")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    start = lines.index("{")  # the printed summary (the progress lines before it are dict reprs)
    summary = json.loads("\n".join(lines[start : lines.index("}", start) + 1]))
    assert summary["finetuning_type"] == "freeze"
    memory = summary["memory"]
    assert memory["trainable_host_params"] > 0 and memory["trainable_device_params"] > 0
    assert memory["host_train_state_gb"] > 0 and memory["device_train_state_gb"] > 0
    assert f"model written to {tmp_path / 'out'}" in out


def test_an_optim_that_is_no_adamw_trains_the_experts_itself(tmp_path, demo_model, caplog) -> None:
    # sgd: no moetune expert optimizer; the Trainer's SGD updates the routed experts from dense gradients (said)
    from safetensors.torch import load_file

    from moetune.layer import CpuExperts
    from moetune.train.expert_optim import unwrap

    with caplog.at_level(logging.WARNING, logger="moetune.train.expert_optim"):
        done = _run(
            tmp_path,
            demo_model,
            optim="sgd",
            max_steps=2,
            eval_strategy="no",
            eval_dataset=None,
            eval_steps=None,
        )
    assert (
        "optim sgd is no AdamW: it trains the routed experts itself, on dense fp32 gradients" in caplog.text
    )
    assert unwrap(done.trainer.optimizer) is None
    assert isinstance(getattr(done.trainer.optimizer, "optimizer", done.trainer.optimizer), torch.optim.SGD)
    experts = [m for m in done.model.modules() if isinstance(m, CpuExperts)]
    assert experts and all(m.base_grads is None for m in experts)
    base, trained = (load_file(str(d / "model.safetensors")) for d in (demo_model, tmp_path / "out"))
    keys = [k for k in base if ".experts." in k]
    assert keys and all(k in trained for k in keys)
    assert any(not torch.equal(trained[k].float(), base[k].float()) for k in keys), "the experts did not move"


@pytest.mark.parametrize(
    "over",
    [{"pure_bf16": True}, {"finetuning_type": "lora", "lora_target": "all", "optim": "sgd"}],
    ids=["full-pure-bf16", "lora-sgd"],
)
def test_padded_expert_rows_train_and_save_as_contiguous_ones(
    over, tmp_path, demo_model, monkeypatch
) -> None:
    """bf16 expert weights loaded with their rows padded (``formats/dense.py``'s layout, here forced on the tiny
    rows: every bf16 row whose bytes are a multiple of 16) train to the same losses, bit for bit, and save the same
    weights or adapter as the same run on contiguous rows (full mode: the expert optimizer updates padded rows in
    place; its saved checkpoint is what transformers loads)."""
    from moetune.engine.formats import dense
    from moetune.layer import CpuExperts

    common = {"max_steps": 3, "eval_strategy": "no", "eval_dataset": None, "eval_steps": None, "bf16": True}
    runs = {}
    for name, alias in (("contiguous", dense.ALIAS_BYTES), ("padded", 16)):
        monkeypatch.setattr(dense, "ALIAS_BYTES", alias)
        done = _run(tmp_path / name, demo_model, **common, **over)
        engines = [m.engine for m in done.model.modules() if isinstance(m, CpuExperts)]
        strides = {(w.stride(1) - w.shape[2]) for e in engines for w in (e.weights.gate_up, e.weights.down)}
        assert engines and strides == {0 if name == "contiguous" else 32}, (name, strides)  # one 64-byte line
        runs[name] = tmp_path / name / "out"
    losses = [[h["loss"] for h in _log(out) if "loss" in h] for out in runs.values()]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    a, b = (_weights(out) for out in runs.values())
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
