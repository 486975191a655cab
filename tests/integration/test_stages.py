"""The pt, dpo and kto stages end to end on the tiny demo Qwen3-MoE, judged by stock transformers + PEFT.

Each shipped example (examples/{pt,dpo,kto}_lora.yaml, LLaMA-Factory's own form and data forms) trains a few
steps through ``moetune train``; its adapter then loads in stock PEFT on the unmodified transformers model to
moetune's logits, and what the stage optimises moved the right way, measured with those stock models (not with
TRL's logged metrics): pt's text NLL fell, dpo's chosen-vs-rejected log-ratio margin over the reference
(the base model) rose above 0 for most pairs, kto's desirable rows' log-ratio rose above the undesirable
rows'. The reference TRL computes (the adapter disabled, routed-expert LoRA included) equals the base model's
log-probabilities, and a preference trainer's checkpoint appears only when complete.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from moetune.config import load_config, training_arguments_kwargs
from moetune.train.demo import make_demo_model

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> Path:
    return make_demo_model(tmp_path_factory.mktemp("m") / "tiny", ROOT / "examples/data/demo_tokenizer")


def _example(tmp: Path, stage: str, model: Path, **over: Any) -> Path:
    """The shipped example config for ``stage``, shortened to STEPS steps on the tiny model in ``tmp``."""
    cfg = yaml.safe_load((ROOT / f"examples/{stage}_lora.yaml").read_text())
    cfg.pop("warmup_ratio")  # every one of the few steps learns
    cfg.update(
        model_name_or_path=str(model),
        dataset_dir=str(ROOT / "examples/data"),
        output_dir=str(tmp / "out"),
        max_steps=STEPS,
        logging_steps=1,
        save_steps=STEPS // 2,
        learning_rate=1e-2,
        gradient_checkpointing=False,
    )
    cfg.update(over)
    cfg["moetune"]["num_threads"] = 1
    path = tmp / f"{stage}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _stock(model: Path, adapter: Path | None = None) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    return (PeftModel.from_pretrained(base, adapter) if adapter is not None else base).eval()


@torch.no_grad()
def _logps(model: Any, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """log p(completion | prompt) for each (prompt, completion) from the model's logits, in float64; sequences
    of one length run as one batch (no padding)."""
    out = [0.0] * len(pairs)
    lengths = {len(p) + len(c) for p, c in pairs}
    for n in lengths:
        index = [i for i, (p, c) in enumerate(pairs) if len(p) + len(c) == n]
        ids = torch.tensor([pairs[i][0] + pairs[i][1] for i in index])
        logps = model(input_ids=ids).logits[:, :-1].double().log_softmax(-1)
        token_logps = logps.gather(-1, ids[:, 1:, None])[..., 0]
        for row, i in enumerate(index):
            out[i] = token_logps[row, len(pairs[i][0]) - 1 :].sum().item()
    return out


def _log_ratios(policy: Any, base: Any, pairs: list[tuple[list[int], list[int]]]) -> list[float]:
    """log p_policy - log p_base of each completion."""
    return [a - b for a, b in zip(_logps(policy, pairs), _logps(base, pairs))]


def _rows(cfg_path: Path) -> Any:
    """The example's rows as moetune's data path tokenizes them for its stage."""
    from transformers import AutoTokenizer

    from moetune.train.data import prepare_datasets
    from moetune.train.stages import stage_for

    cfg = load_config(cfg_path)
    tok = AutoTokenizer.from_pretrained(cfg.model.model_name_or_path)
    return prepare_datasets(cfg.data, tok, codec=stage_for(cfg).codec).train


def _pt_learned(policy: Any, base: Any, rows: Any, log: list[dict]) -> None:
    texts = [(ids[:1], ids[1:]) for ids in rows["input_ids"][:32]]
    nll, base_nll = (-sum(_logps(model, texts)) for model in (policy, base))
    assert nll < 0.9 * base_nll, (nll, base_nll)  # measured: 558 vs 792 nats


def _dpo_learned(policy: Any, base: Any, rows: Any, log: list[dict]) -> None:
    rows = rows.select(range(32))

    chosen, rejected = (
        _log_ratios(policy, base, [(r["prompt_ids"], r[side]) for r in rows])
        for side in ("chosen_ids", "rejected_ids")
    )
    margins = [c - r for c, r in zip(chosen, rejected)]
    # measured: mean 6.7 nats, 32 of 32 positive
    assert sum(margins) / len(margins) > 2.0 and sum(m > 0 for m in margins) >= 0.9 * len(margins), margins
    # step 1's batch ran with the adapter at its init (B = 0): policy and reference were the same function
    logged = [h for h in log if "rewards/margins" in h]
    assert logged[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-5)
    assert logged[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # log 2: -log sigmoid(0)
    # and then the policy moved away from the reference, the chosen side up (TRL's own metric agrees)
    assert max(h["rewards/margins"] for h in logged[-3:]) > 0.1


def _kto_learned(policy: Any, base: Any, rows: Any, log: list[dict]) -> None:
    rows = rows.select(range(32))
    ratios: dict[bool, list[float]] = {True: [], False: []}
    for r, ratio in zip(
        rows, _log_ratios(policy, base, [(r["prompt_ids"], r["completion_ids"]) for r in rows])
    ):
        ratios[r["label"]].append(ratio)
    good, bad = (sum(v) / len(v) for v in (ratios[True], ratios[False]))
    assert good - bad > 2.0, (good, bad)  # measured: 1.3 vs -6.9 nats


LEARNED = {"pt": _pt_learned, "dpo": _dpo_learned, "kto": _kto_learned}


@pytest.mark.parametrize("stage", ["pt", "dpo", "kto"])
def test_shipped_example_trains_and_its_adapter_loads_in_stock_peft(tmp_path, demo_model, stage) -> None:
    from moetune.adapters.load import load_model
    from moetune.cli.main import main

    cfg = _example(tmp_path, stage, demo_model)
    assert main(["train", str(cfg)]) == 0
    out = tmp_path / "out"
    for name in (
        "adapter_config.json",
        "adapter_model.safetensors",
        "trainer_state.json",
        "run_summary.json",
    ):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == [
        f"checkpoint-{STEPS // 2}",
        f"checkpoint-{STEPS}",
    ]
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == STEPS
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["target_parameters"][-2:] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

    policy, base = _stock(demo_model, out), _stock(demo_model)
    ids = torch.randint(4, 17, (2, 10), generator=torch.Generator().manual_seed(0))
    ours = load_model(demo_model, device="cpu", dtype="float32", progress=False, adapter=out)
    with torch.no_grad():
        want = ours(input_ids=ids).logits
        torch.testing.assert_close(policy(input_ids=ids).logits, want, atol=1e-5, rtol=0)
        assert (want - base(input_ids=ids).logits).abs().max() > 1e-2  # the adapter was trained
    LEARNED[stage](policy, base, _rows(cfg), state["log_history"])


def _randomize(model: Any) -> None:
    """Every LoRA tensor random (experts' included), so an adapter left on could not hide."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_reference_is_the_base_model_with_the_adapter_disabled(tmp_path, demo_model, stage) -> None:
    from moetune.train.recipe import setup
    from moetune.train.stages import stage_for

    cfg = load_config(_example(tmp_path, stage, demo_model))
    model, tok, data = setup(cfg, progress=False)
    _randomize(model)
    args = {**training_arguments_kwargs(cfg), "disable_tqdm": True}
    trainer = stage_for(cfg).build_trainer(cfg, model, tok, data, args, [])
    assert trainer.ref_model is None and list(model.peft_config) == ["default"]  # no copy of the adapter
    rows = [trainer.train_dataset[i] for i in range(4)]
    batch = trainer.data_collator(rows)
    base = _stock(demo_model)
    if stage == "dpo":
        ref = torch.cat(trainer.compute_ref_log_probs(trainer.model, batch))
        sides = ["chosen_ids", "rejected_ids"]
        pairs = [(r["prompt_ids"], r[side]) for side in sides for r in rows]
    else:
        ref, _ = trainer.compute_ref_log_probs(trainer.model, batch)
        pairs = [(r["prompt_ids"], r["completion_ids"]) for r in rows]
    want = torch.tensor(_logps(base, pairs), dtype=ref.dtype)
    torch.testing.assert_close(ref, want, atol=1e-4, rtol=0)
    policy = torch.tensor(_logps(model, pairs), dtype=ref.dtype)
    assert (policy - want).abs().max() > 0.1  # with the adapter on, the log-probabilities differ


def test_a_preference_checkpoint_appears_only_when_complete(tmp_path, demo_model, monkeypatch) -> None:
    from transformers.trainer_utils import get_last_checkpoint

    from moetune.train.recipe import run
    from moetune.train.stages.trl_trainers import MoetuneDPOTrainer

    out = tmp_path / "out"
    seen: dict = {}
    save_rng_state = MoetuneDPOTrainer._save_rng_state

    def fail_at_last_save(
        self, output_dir: str
    ) -> None:  # after adapter, optimizer and scheduler are written
        if self.state.global_step == STEPS:
            seen["visible"] = sorted(p.name for p in out.iterdir())
            seen["staged"] = sorted(os.listdir(output_dir))
            raise OSError("disk full (injected)")
        save_rng_state(self, output_dir)

    monkeypatch.setattr(MoetuneDPOTrainer, "_save_rng_state", fail_at_last_save)
    with pytest.raises(OSError, match="injected"):
        run(load_config(_example(tmp_path, "dpo", demo_model)), progress=False)
    assert f"checkpoint-{STEPS}" not in seen["visible"] and f"tmp-checkpoint-{STEPS}" in seen["visible"]
    assert {"adapter_model.safetensors", "optimizer.pt"} <= set(seen["staged"])
    assert get_last_checkpoint(str(out)) == str(out / f"checkpoint-{STEPS // 2}")
    assert not list(out.glob("tmp-*"))


def _trl_rows(stage: str) -> list[dict]:
    """The stage's shipped demo data as TRL's own conversational rows (TRL tokenizes them)."""

    def turn(role: str, content: str) -> dict:
        return {"role": role, "content": content}

    rows = json.loads((ROOT / f"examples/data/demo_{stage}.json").read_text())[:32]
    if stage == "dpo":
        return [
            {
                "prompt": [turn("user", r["conversations"][0]["value"])],
                "chosen": [turn("assistant", r["chosen"]["value"])],
                "rejected": [turn("assistant", r["rejected"]["value"])],
            }
            for r in rows
        ]
    return [{"prompt": r["messages"][:1], "completion": r["messages"][1:], "label": r["label"]} for r in rows]


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_library_path_trains_trl_rows_with_the_adapter_disabled_reference(
    tmp_path, demo_model, stage
) -> None:
    """load_model -> attach_lora -> MoetuneDPOTrainer / MoetuneKTOTrainer on TRL's own conversational rows (TRL
    tokenizes them): the stock trainers would add a copy of the adapter as their reference, which cannot reach
    the experts."""
    import datasets
    from transformers import AutoTokenizer

    from moetune.adapters import attach_lora
    from moetune.loading import load_model
    from moetune.train.stages.trl_trainers import PREFERENCE_TRAINERS

    trainer_class, config_class = PREFERENCE_TRAINERS[stage]
    torch.manual_seed(0)
    model = attach_lora(
        load_model(demo_model, device="cpu", dtype="float32", progress=False), rank=4, alpha=8
    )
    args = config_class(
        str(tmp_path / "out"),
        max_steps=6,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=3,
        report_to=[],
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    tok = AutoTokenizer.from_pretrained(demo_model)
    ds = datasets.Dataset.from_list(_trl_rows(stage))
    trainer = trainer_class(model=model, args=args, train_dataset=ds, processing_class=tok)
    assert list(model.peft_config) == ["default"] and trainer.ref_model is None
    trainer.train()
    # step 1: policy = reference (B = 0), margins 0; then the desirable / chosen side rose above the other
    margins = [h["rewards/margins"] for h in trainer.state.log_history if "rewards/margins" in h]
    assert margins[0] == pytest.approx(0.0, abs=1e-5) and max(margins[-3:]) > 0.1, margins
    assert (tmp_path / "out" / "checkpoint-6" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("stage", ["dpo", "kto"])
def test_resume_matches_an_uninterrupted_run(tmp_path, demo_model, stage) -> None:
    from moetune.train.recipe import run

    def losses(out: Path) -> list[float]:
        state = json.loads((out / "trainer_state.json").read_text())
        return [h["loss"] for h in state["log_history"] if "loss" in h]

    full = tmp_path / "full"
    full.mkdir()
    run(load_config(_example(full, stage, demo_model)), progress=False)
    part = tmp_path / "part"
    part.mkdir()
    ckpt = full / "out" / f"checkpoint-{STEPS // 2}"
    run(load_config(_example(part, stage, demo_model, resume_from_checkpoint=str(ckpt))), progress=False)
    want, got = losses(full / "out"), losses(part / "out")
    assert len(want) == len(got) == STEPS
    assert got[STEPS // 2 :] == pytest.approx(want[STEPS // 2 :], abs=1e-6)


def test_dpo_with_gradient_checkpointing_trains_the_same(tmp_path, demo_model) -> None:
    """The shipped configs keep gradient checkpointing on (LLaMA-Factory's default); TRL switches it off around
    each reference forward and back on (non-reentrant, so the CPU experts' forward is reused by the recompute)."""
    from moetune.train.recipe import run

    logs = {}
    for on in (True, False):
        tmp = tmp_path / str(on)
        tmp.mkdir()
        cfg = _example(tmp, "dpo", demo_model, max_steps=3, gradient_checkpointing=on)
        result = run(load_config(cfg), progress=False)
        logs[on] = [
            v for h in result.trainer.state.log_history if "loss" in h for v in (h["loss"], h["grad_norm"])
        ]
    assert len(logs[True]) == 6
    assert logs[True] == pytest.approx(logs[False], rel=1e-5, abs=1e-6)


def test_pref_ftx_adds_the_chosen_responses_nll(tmp_path, demo_model) -> None:
    """pref_ftx: step 1 (policy = reference, so the DPO term is log 2) logs log 2 + pref_ftx x the chosen tokens'
    mean NLL under the base model, over the whole batch (all 64 pairs; their chosen responses have equal lengths,
    so TRL's token mean is also LLaMA-Factory's per-response mean here)."""
    import math

    from moetune.train.recipe import run

    cfg = _example(tmp_path, "dpo", demo_model, max_steps=1, pref_ftx=0.5, per_device_train_batch_size=64)
    result = run(load_config(cfg), progress=False)
    loss = next(h["loss"] for h in result.trainer.state.log_history if "loss" in h)
    rows = _rows(cfg)
    assert len(rows) == 64 and len({len(r) for r in rows["chosen_ids"]}) == 1
    nll = -sum(_logps(_stock(demo_model), [(r["prompt_ids"], r["chosen_ids"]) for r in rows]))
    want = math.log(2) + 0.5 * nll / sum(len(c) for c in rows["chosen_ids"])
    assert loss == pytest.approx(want, abs=1e-4)
    assert abs(loss - math.log(2)) > 0.5  # the NLL term is there


def test_ipo_is_llamafactorys_length_normalised_loss(tmp_path, demo_model) -> None:
    """pref_loss ipo with pref_beta: step 1 (policy = reference) logs (1 / (2 beta))^2; step 2's loss equals LLaMA-Factory's IPO
    computed by hand from the step-1 adapter in stock PEFT and the stock base model, the mean over pairs of
    ((c - c_ref) / n_c - (r - r_ref) / n_r - 1 / (2 beta))^2 (log-probabilities summed over each response of n
    tokens); and it fell. One batch holds all 64 pairs, so both steps see the same pairs."""
    from moetune.train.recipe import run

    beta = 0.25  # not TRL's default 0.1: step 1's value shows pref_beta reached TRL
    cfg = _example(
        tmp_path,
        "dpo",
        demo_model,
        max_steps=2,
        save_steps=1,
        pref_loss="ipo",
        pref_beta=beta,
        per_device_train_batch_size=64,
    )
    result = run(load_config(cfg), progress=False)
    losses = [h["loss"] for h in result.trainer.state.log_history if "loss" in h]
    assert losses[0] == pytest.approx((1 / (2 * beta)) ** 2, rel=1e-5)  # 4, where sigmoid would log log 2
    rows = _rows(cfg)
    assert len(rows) == 64
    policy, base = _stock(demo_model, tmp_path / "out" / "checkpoint-1"), _stock(demo_model)
    chosen, rejected = (
        _log_ratios(policy, base, [(r["prompt_ids"], r[side]) for r in rows])
        for side in ("chosen_ids", "rejected_ids")
    )
    terms = [
        (c / len(r["chosen_ids"]) - j / len(r["rejected_ids"]) - 1 / (2 * beta)) ** 2
        for c, j, r in zip(chosen, rejected, rows)
    ]
    assert losses[1] == pytest.approx(sum(terms) / len(terms), rel=1e-4)
    assert losses[1] < losses[0]
