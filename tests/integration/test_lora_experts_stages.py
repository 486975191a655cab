"""LoRA experts (``moetune.adapters.lora_experts``) under the dpo and kto stages, judged by stock transformers.

The reference policy TRL computes is the model with its adapter disabled; the LoRA experts belong to the adapter, so
with them present (and random, so that leaving them on could not hide) the reference log-probabilities are the
unmodified transformers base model's. A dpo and a kto run with LoRA experts train, checkpoint them, and
``moetune.load_model(adapter=)`` reproduces the trained logits; the trainer's loss on a batch after training then
equals the stage's loss computed by hand from the log-probabilities of the reloaded model (policy) and the stock base
model (reference), and a run resumed from a checkpoint ends where the uninterrupted one did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from moetune.config import load_config, training_arguments_kwargs
from tests.integration.test_stages import _example, _logps, _stock
from tests.integration.test_train import _losses

SIZES = {"lora_experts": 2, "lora_expert_intermediate_size": 4}
SHORT = {"max_steps": 4, "save_steps": 2, **SIZES}


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    from moetune.train.demo import make_demo_model

    root = Path(__file__).resolve().parents[2]
    return make_demo_model(tmp_path_factory.mktemp("m") / "tiny", root / "examples/data/demo_tokenizer")


def _randomize(model: Any, lora: bool) -> None:
    """The LoRA experts random (their down projection too, so they change the output); the ordinary LoRA random
    with ``lora``, zero otherwise (then only the LoRA experts differ from the base model)."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".extra_experts." in n or (lora and ".lora_" in n):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif ".lora_" in n:
                p.zero_()


def _pairs(stage: str, rows: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt, completion) of every scored sequence, in the order TRL's reference returns them."""
    if stage == "dpo":
        return [(r["prompt_ids"], r[side]) for side in ("chosen_ids", "rejected_ids") for r in rows]
    return [(r["prompt_ids"], r["completion_ids"]) for r in rows]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_reference_with_lora_experts_is_the_base_model(tmp_path, demo_model, stage, lora) -> None:
    from moetune.train.recipe import setup
    from moetune.train.stages import stage_for

    cfg = load_config(_example(tmp_path, stage, demo_model, **SIZES))
    model, tok, data = setup(cfg, progress=False)
    _randomize(model, lora)
    args = {**training_arguments_kwargs(cfg), "disable_tqdm": True}
    trainer = stage_for(cfg).build_trainer(cfg, model, tok, data, args, [])
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    ref = trainer.compute_ref_log_probs(trainer.model, batch)
    ref = torch.cat(ref) if stage == "dpo" else ref[0]
    pairs = _pairs(stage, rows)
    want = torch.tensor(_logps(_stock(demo_model), pairs), dtype=ref.dtype)
    torch.testing.assert_close(ref, want, atol=1e-4, rtol=0)
    policy = torch.tensor(_logps(model, pairs), dtype=ref.dtype)
    assert (
        policy - want
    ).abs().max() > 0.05  # with the adapter on, the LoRA experts change the log-probabilities
    # and after the reference pass they are on again
    torch.testing.assert_close(torch.tensor(_logps(model, pairs), dtype=ref.dtype), policy, atol=0, rtol=0)


def _dpo_loss(policy: Any, base: Any, rows: list[dict], beta: float) -> torch.Tensor:
    """TRL's sigmoid DPO loss, by hand: mean over pairs of -log sigmoid(beta * (chosen - rejected log-ratios))."""
    ratios = [
        torch.tensor(_logps(policy, p)) - torch.tensor(_logps(base, p))
        for p in ([(r["prompt_ids"], r[s]) for r in rows] for s in ("chosen_ids", "rejected_ids"))
    ]
    return -F.logsigmoid(beta * (ratios[0] - ratios[1])).mean()


def _kto_loss(policy: Any, base: Any, rows: list[dict], beta: float) -> torch.Tensor:
    """TRL's KTO loss, by hand (desirable and undesirable weights 1): the KL estimate is the batch mean of
    policy - reference log-probability of each prompt with the mismatched completion TRL pairs it with (clamped at
    0, no gradient); desirable rows lose 1 - sigmoid(beta (ratio - KL)), undesirable ones 1 - sigmoid(beta (KL -
    ratio)); the loss is the mean over rows."""

    def ratio(pairs: list[tuple[list[int], list[int]]]) -> torch.Tensor:
        return torch.tensor(_logps(policy, pairs)) - torch.tensor(_logps(base, pairs))

    kl = ratio([(r["prompt_ids"], r["KL_completion_ids"]) for r in rows]).mean().clamp(min=0)
    r = ratio([(r["prompt_ids"], r["completion_ids"]) for r in rows])
    good = torch.tensor([row["label"] for row in rows])
    losses = torch.cat([1 - torch.sigmoid(beta * (r[good] - kl)), 1 - torch.sigmoid(beta * (kl - r[~good]))])
    return losses.mean()


HAND_LOSS = {"dpo": _dpo_loss, "kto": _kto_loss}


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_dpo_and_kto_train_save_and_reload_lora_experts(tmp_path, demo_model, stage) -> None:
    from safetensors.torch import load_file

    from moetune.adapters.load import load_model
    from moetune.train.recipe import run

    cfg = load_config(_example(tmp_path, stage, demo_model, **SHORT))
    result = run(cfg, progress=False)
    out = tmp_path / "out"
    for folder in (out, out / "checkpoint-2", out / "checkpoint-4"):
        assert (folder / "moetune_lora_experts.safetensors").is_file(), folder
    final = load_file(str(out / "moetune_lora_experts.safetensors"))
    assert all(v.abs().max() > 0 for k, v in final.items() if k.endswith("down_proj"))  # trained away from 0
    for key, value in load_file(str(out / "checkpoint-4" / "moetune_lora_experts.safetensors")).items():
        torch.testing.assert_close(value, final[key], atol=0, rtol=0)

    trained = result.model.eval()
    loaded = load_model(demo_model, device="cpu", dtype="float32", progress=False, adapter=out).eval()
    ids = torch.randint(4, 17, (2, 10), generator=torch.Generator().manual_seed(0))
    base = _stock(demo_model)
    with torch.no_grad():
        want = trained(input_ids=ids).logits
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        assert (want - base(input_ids=ids).logits).abs().max() > 1e-2  # the adapter was trained

    trainer = result.trainer
    rows = [trainer.train_dataset[i] for i in range(cfg.training.per_device_train_batch_size)]
    with torch.no_grad():
        loss = trainer.compute_loss(trained, trainer.data_collator(rows))
    hand = HAND_LOSS[stage](loaded, base, rows, cfg.finetune.pref_beta)
    torch.testing.assert_close(loss.double(), hand.double(), atol=1e-5, rtol=0)

    # resumed from checkpoint-2, the run restores the trained LoRA experts (not fresh ones): the same last losses
    # and the same final LoRA experts as the uninterrupted run
    (tmp_path / "b").mkdir()
    ckpt = str(out / "checkpoint-2")
    run(
        load_config(_example(tmp_path / "b", stage, demo_model, resume_from_checkpoint=ckpt, **SHORT)),
        progress=False,
    )
    assert _losses(tmp_path / "b" / "out")[2:] == pytest.approx(_losses(out)[2:], abs=1e-6)
    for key, value in load_file(str(tmp_path / "b" / "out" / "moetune_lora_experts.safetensors")).items():
        torch.testing.assert_close(value, final[key], atol=1e-6, rtol=0)
