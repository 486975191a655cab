"""NumericalGuard: a non-finite loss or gradient norm stops (or skips exactly) before the update; a collapse
stops; non-finite weights are never saved. Real ``MoetuneTrainer`` runs on a toy regression model."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import TrainingArguments

from moetune.config.schema import DivergenceAction
from moetune.errors import DivergenceError
from moetune.train.guards import (
    COLLAPSE_STEPS,
    MAX_SKIPS_IN_A_ROW,
    NumericalGuard,
    attach_guard,
    last_checkpoint_before,
)
from moetune.train.trainer import MoetuneTrainer


class Toy(nn.Module):
    """y ~ w.x + b, squared error: every step moves every parameter (a skipped step is visible)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": ((self.lin(x).squeeze(-1) - y) ** 2).mean()}


def rows(n: int, bad: int | None = None) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = [{"x": torch.randn(4, generator=g), "y": torch.randn((), generator=g)} for _ in range(n)]
    if bad is not None:  # an inf input: the loss is inf, the gradients inf/NaN
        out.insert(bad, {"x": torch.full((4,), math.inf), "y": torch.zeros(())})
    return out


def run(
    tmp_path,
    data,
    steps: int,
    action=DivergenceAction.STOP,
    save_steps: int | None = None,
    logging_steps: int = 500,
    model_class: type[nn.Module] | None = None,
) -> nn.Module:
    torch.manual_seed(0)
    model = (model_class or Toy)()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        max_steps=steps,
        per_device_train_batch_size=1,
        learning_rate=0.05,
        lr_scheduler_type="constant",  # a skipped step then changes nothing that follows
        train_sampling_strategy="sequential",
        logging_nan_inf_filter=False,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        logging_steps=logging_steps,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        remove_unused_columns=False,
    )
    trainer = MoetuneTrainer(model=model, args=args, train_dataset=data)
    attach_guard(trainer, NumericalGuard(action, None))
    trainer.train()
    model.log_history = trainer.state.log_history  # type: ignore[assignment]
    return model


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_non_finite_loss_stops_before_the_update(tmp_path) -> None:
    model_ok = run(tmp_path / "a", rows(2), steps=2)
    with pytest.raises(DivergenceError, match=r"diverged at step 3: the loss is not finite") as err:
        run(tmp_path / "b", rows(4, bad=2), steps=4, save_steps=1)
    msg = str(err.value)
    assert "Nothing from step 3 was applied or saved" in msg
    assert f"Last good checkpoint: {tmp_path / 'b/out/checkpoint-2'}" in msg
    assert "lin.weight" in msg  # the parameters with non-finite gradients are named
    assert not (tmp_path / "b/out/checkpoint-3").exists()
    # checkpoint-2 holds exactly the weights of an undisturbed 2-step run
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "b/out/checkpoint-2/model.safetensors")
    assert torch.equal(saved["lin.weight"], model_ok.lin.weight.detach())


def test_skip_mode_equals_a_run_without_the_bad_step(tmp_path) -> None:
    skipped = run(tmp_path / "a", rows(4, bad=2), steps=5, action=DivergenceAction.SKIP, logging_steps=2)
    without = run(tmp_path / "b", rows(4), steps=4, logging_steps=1)
    for a, b in zip(params(skipped), params(without), strict=True):
        assert torch.equal(a, b)  # bitwise: no parameter, no optimizer state moved at the skipped step
    # the window of steps 3-4 (3 skipped) logs step 4's loss alone, which is step 3 of the run without it
    logged = {h["step"]: h for h in skipped.log_history if "loss" in h}
    reference = {h["step"]: h["loss"] for h in without.log_history if "loss" in h}
    assert logged[4]["skipped_steps"] == 1 and logged[4]["loss"] == pytest.approx(reference[3], rel=1e-6)
    assert "skipped_steps" not in logged[2]


def test_skip_mode_stops_after_too_many_bad_steps_in_a_row(tmp_path) -> None:
    data = [rows(1, bad=0)[0]] * (MAX_SKIPS_IN_A_ROW + 2)
    with pytest.raises(
        DivergenceError, match=f"step {MAX_SKIPS_IN_A_ROW}: .*{MAX_SKIPS_IN_A_ROW}th step in a row"
    ):
        run(tmp_path, data, steps=MAX_SKIPS_IN_A_ROW + 2, action=DivergenceAction.SKIP)


def test_skipping_is_off_by_default(tmp_path) -> None:
    """The old code trained through an inf batch and exited normally; the default now stops."""
    with pytest.raises(DivergenceError):
        run(tmp_path, rows(3, bad=0), steps=3)


def _judge(guard: NumericalGuard, step: int, loss: float, norm: float | None, model=None) -> None:
    guard.add_loss(torch.tensor(loss))
    guard.check_step(norm, model or Toy(), SimpleNamespace(global_step=step - 1))


def test_a_non_finite_gradient_norm_with_a_finite_loss_stops() -> None:
    guard = NumericalGuard()
    _judge(guard, 1, 2.0, 1.0)
    with pytest.raises(
        DivergenceError, match=r"step 2: the gradient norm is not finite \(loss 2.0, gradient norm inf\)"
    ):
        _judge(guard, 2, 2.0, math.inf)


def test_collapse_stops_after_zero_gradients_at_ln_vocab(tmp_path) -> None:
    (tmp_path / "checkpoint-1").mkdir()
    (tmp_path / "checkpoint-3").mkdir()  # saved inside the collapse: not offered
    (tmp_path / "checkpoint-50").mkdir()  # an earlier run's, left by overwrite_output_dir: not this run's
    guard = NumericalGuard(vocab_size=50)
    guard.on_train_begin(SimpleNamespace(output_dir=str(tmp_path)), None, None)
    flat = math.log(50)
    _judge(guard, 1, 3.0, 1.0)
    _judge(guard, 2, 3.0, 0.5)
    for step in range(3, 3 + COLLAPSE_STEPS - 1):
        _judge(guard, step, flat, 0.0)
    with pytest.raises(DivergenceError, match="collapsed to a uniform guess") as err:
        _judge(guard, 3 + COLLAPSE_STEPS - 1, flat, 0.0)
    assert f"exactly 0.0 for the last {COLLAPSE_STEPS} steps" in str(err.value)
    assert f"Last good checkpoint: {tmp_path / 'checkpoint-1'}" in str(err.value)
    assert "checkpoint-3 holds weights from the diverged update: do not resume from it" in str(err.value)
    assert "checkpoint-50" not in str(err.value)


def test_saves_are_held_while_the_gradient_norm_sits_at_zero(tmp_path) -> None:
    """A collapse takes COLLAPSE_STEPS steps to call; the checkpoints due meanwhile held collapsed weights (and,
    with save_total_limit, rotated the good ones away). They are held back, and written at the first step with a
    gradient again."""
    guard = NumericalGuard(vocab_size=50)
    guard.on_train_begin(SimpleNamespace(output_dir=str(tmp_path)), None, None)
    flat, saves = math.log(50), []

    def step(n: int, loss: float, norm: float, due: bool) -> None:
        _judge(guard, n, loss, norm)
        control = SimpleNamespace(should_save=due)
        guard.on_step_end(None, SimpleNamespace(global_step=n), control, model=Toy())
        if control.should_save:
            saves.append(n)

    step(1, 3.0, 1.0, True)
    step(2, flat, 0.0, True)  # held
    step(3, flat, 0.0, False)
    step(4, flat, 0.0, True)  # held
    step(5, 2.0, 0.5, False)  # a gradient again: the held save is written now
    step(6, 2.0, 0.5, True)
    assert saves == [1, 5, 6]
    step(7, flat, 0.0, True)
    for n in range(8, 7 + COLLAPSE_STEPS - 1):
        step(n, flat, 0.0, True)
    with pytest.raises(DivergenceError, match="collapsed"):
        step(7 + COLLAPSE_STEPS - 1, flat, 0.0, True)
    assert saves == [1, 5, 6]  # nothing saved from the collapse


@pytest.mark.parametrize(
    "losses_norms",
    [
        [(math.log(50), 0.0)] * (COLLAPSE_STEPS - 1),  # not yet several steps
        [(1.0, 0.0)] * (COLLAPSE_STEPS + 2),  # zero gradient but a loss far from ln V (e.g. a solved task)
        [(math.log(50), 0.0)] * 3 + [(math.log(50), 1e-3)] + [(math.log(50), 0.0)] * 3,  # interrupted
    ],
)
def test_no_collapse_without_the_whole_pattern(losses_norms) -> None:
    guard = NumericalGuard(vocab_size=50)
    for step, (loss, norm) in enumerate(losses_norms, start=1):
        _judge(guard, step, loss, norm)


def test_non_finite_weights_are_never_saved() -> None:
    guard = NumericalGuard()
    model = Toy()
    state = SimpleNamespace(global_step=4)
    guard.on_step_end(None, state, SimpleNamespace(should_save=True), model=model)  # finite: fine
    with torch.no_grad():
        model.lin.bias.fill_(math.inf)
    guard.on_step_end(None, state, SimpleNamespace(should_save=False), model=model)  # no save due: no scan
    with pytest.raises(DivergenceError, match=r"(?s)before checkpoint-4 was written.*lin\.bias"):
        guard.on_step_end(None, state, SimpleNamespace(should_save=True), model=model)
    with pytest.raises(DivergenceError, match="before the final adapter was written"):
        guard.on_train_end(None, state, None, model=model)


def test_last_checkpoint_before(tmp_path) -> None:
    for name in ("checkpoint-2", "checkpoint-10", "tmp-checkpoint-12", "checkpoint-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-8").write_text("")  # a file, not a checkpoint
    assert last_checkpoint_before(tmp_path, 12) == tmp_path / "checkpoint-10"
    assert last_checkpoint_before(tmp_path, 10) == tmp_path / "checkpoint-2"
    assert last_checkpoint_before(tmp_path, 2) is None
    assert last_checkpoint_before(tmp_path / "missing", 5) is None


class ToyWithIdle(Toy):
    """Toy plus a trainable Linear the forward never calls (a vision tower on text rows, a weight read directly)."""

    def __init__(self) -> None:
        super().__init__()
        self.idle = nn.Linear(4, 1)


def test_trainable_tensors_no_gradient_reaches_are_named_once(tmp_path, caplog) -> None:
    """After the first step's backward: trainable tensors without a gradient are named in one warning (they
    would not train); a model whose every tensor gets one says nothing."""
    from moetune.train import guards

    with caplog.at_level("WARNING", logger=guards.__name__):
        run(tmp_path / "a", rows(3), steps=3)
        assert not [r for r in caplog.records if "received no gradient" in r.getMessage()]
        run(tmp_path / "b", rows(3), steps=3, model_class=ToyWithIdle)
    said = [r.getMessage() for r in caplog.records if "received no gradient" in r.getMessage()]
    assert (
        len(said) == 1 and "idle.weight" in said[0] and "idle.bias" in said[0] and "lin.weight" not in said[0]
    )
