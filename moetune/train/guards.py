"""The numerical guard: no optimizer step, checkpoint or adapter is ever made from a diverged state.

transformers' ``Trainer`` replaces a NaN/Inf loss by the running average (``logging_nan_inf_filter``), so
a diverged run logs a plausible loss, exits 0 and saves NaN weights. moetune turns that filter off (the
logged loss is what the steps computed) and :class:`NumericalGuard` looks at every optimizer step:

- each micro-batch's loss, as ``MoetuneTrainer.training_step`` returns it (summed over the accumulation
  steps: the value the Trainer's logged average is made of);
- the gradient norm, after clipping computed it and before ``optimizer.step()`` (``MoetuneTrainer._get_grad_norm``);
- the trained weights before every checkpoint and before the final adapter (``on_step_end`` when a save is
  due, ``on_train_end``): a finite loss and gradient can still overflow in the update.

Causes, and what happens (``on_divergence`` in the config):

- a NaN/Inf loss or gradient norm: ``stop`` (default) raises :class:`~moetune.errors.DivergenceError` before
  the update, naming the step, the cause, the parameters with non-finite gradients and the last good
  checkpoint; ``skip`` drops that step's gradients (``zero_grad(set_to_none=True)``: torch's optimizers then
  leave every parameter and its optimizer state untouched) and logs a warning; ``MAX_SKIPS_IN_A_ROW``
  skipped steps in a row stop the run;
- a collapse: the gradient norm exactly 0.0 for ``COLLAPSE_STEPS`` steps in a row while the loss sits at
  ln(vocab_size), the loss of a uniform guess over the vocabulary (what an exploded learning rate leaves):
  stops in both modes, naming the last checkpoint saved before the collapse began (and any written from the
  update that made it, which no step can see coming). A checkpoint due while such a run of zero-gradient steps
  lasts is held back and written at the first step with a gradient again (so a collapse leaves no checkpoint of
  its own, and ``save_total_limit`` does not rotate the good ones away for it);
- non-finite trained weights when a checkpoint or the adapter is due: stops in both modes (the update is
  already applied), before anything is written.

At the run's first optimizer step it also names, in one warning, the trainable tensors no gradient reached
(:func:`untrained_parameters`): LoRA on a module the forward never calls, or whose weight the model reads directly,
trains nothing and would otherwise pass unseen.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from moetune.config.schema import DivergenceAction
from moetune.errors import DivergenceError, listing
from moetune.layer.cpu_experts import drop_base_grads, non_finite_base_grads

logger = logging.getLogger(__name__)

COLLAPSE_STEPS = 5  # zero-gradient steps at ln(vocab) before a collapse is called (one or two can be chance)
# |loss - ln V| within this fraction of ln V reads as "at ln V": a router's aux loss adds a little on top
COLLAPSE_LOSS_TOLERANCE = 0.02
MAX_SKIPS_IN_A_ROW = 10  # skipped steps in a row that mean the run itself is broken, not one bad batch
_CHECKPOINT = re.compile(r"checkpoint-(\d+)")


def non_finite_parameters(model: Any, *, grads: bool) -> list[str]:
    """Names of ``model``'s trainable parameters holding a NaN/Inf (their gradients with ``grads``)."""
    out = []
    for name, p in model.named_parameters():
        t = p.grad if grads else (p if p.requires_grad else None)
        if t is not None and not bool(torch.isfinite(t).all()):
            out.append(name)
    # full mode's routed experts keep their gradients sparse, beside .grad (moetune.engine.base_grads)
    return out + (non_finite_base_grads(model) if grads else [])


def untrained_parameters(model: Any) -> list[str]:
    """Names of ``model``'s trainable parameters without a gradient (``.grad`` None) after a backward: none of
    the step's work reached them. Full mode's routed-expert weights are left out: their gradients are sparse,
    beside ``.grad`` (``moetune.engine.base_grads``)."""
    from moetune.layer import CpuExperts

    engine_owned = {
        id(p) for m in model.modules() if isinstance(m, CpuExperts) for p in m.parameters(recurse=False)
    }
    return [
        name
        for name, p in model.named_parameters()
        if p.requires_grad and p.grad is None and id(p) not in engine_owned
    ]


def checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """``(N, folder)`` for every ``checkpoint-N`` folder in ``output_dir`` (complete ones only: they are renamed
    into place when written, ``moetune.train.trainer``)."""
    root = Path(output_dir)
    return [
        (int(m.group(1)), p)
        for p in (root.iterdir() if root.is_dir() else ())
        if (m := _CHECKPOINT.fullmatch(p.name)) and p.is_dir()
    ]


def last_checkpoint_before(output_dir: str | Path, step: int) -> Path | None:
    """The newest ``checkpoint-N`` in ``output_dir`` with N < ``step`` (the guard stops before a diverged
    checkpoint is written: these are good)."""
    found = [(n, p) for n, p in checkpoints(output_dir) if n < step]
    return max(found)[1] if found else None


class NumericalGuard(TrainerCallback):
    """Checks every optimizer step's loss and gradient norm, and the weights before every save (see the module
    docstring). ``vocab_size``: the model's, for the collapse test (None: no collapse test)."""

    def __init__(
        self, action: DivergenceAction = DivergenceAction.STOP, vocab_size: int | None = None
    ) -> None:
        self.action = action
        self.uniform_loss = math.log(vocab_size) if vocab_size and vocab_size > 1 else None
        self.skipped: list[int] = []  # the steps skipped (numbered as the Trainer logs them, from 1)
        self._loss: torch.Tensor | None = None  # this optimizer step's loss so far, summed over micro-batches
        self._zero_since: int | None = None  # first step of the current run of zero-gradient steps at ln V
        self._held_save: int | None = None  # the step whose checkpoint such a run held back
        self._skips_in_a_row = 0
        self._output_dir = "."
        # since the last logged loss: finite step losses, and how many steps were skipped
        self._window: list[float] = []
        self._window_skipped = 0
        self._grads_seen = False  # the first step's gradients were looked at (trainable tensors none reached)

    def add_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Record one micro-batch's loss (a 0-d tensor, as ``Trainer.training_step`` returns it); returns the
        loss the Trainer should add to its running sum: ``loss``, or in ``skip`` mode 0 for a non-finite one
        (the Trainer resets that sum by subtracting it from itself, so one NaN would make every later logged
        loss NaN; :meth:`window_logs` then logs the mean of the finite steps instead)."""
        loss = loss.detach()
        self._loss = loss if self._loss is None else self._loss + loss
        if self.action is DivergenceAction.SKIP and not bool(torch.isfinite(loss)):
            return torch.zeros_like(loss)
        return loss

    def window_logs(self) -> dict[str, float]:
        """Called when the Trainer logs a training loss: with steps skipped since the last log, the loss to log
        instead (the mean of the window's finite step losses; NaN if none) and ``skipped_steps``; else nothing
        (the Trainer's own mean is exact)."""
        window, skipped = self._window, self._window_skipped
        self._window, self._window_skipped = [], 0
        if not skipped:
            return {}
        return {"loss": sum(window) / len(window) if window else math.nan, "skipped_steps": skipped}

    def check_step(self, grad_norm: Any, model: Any, state: Any) -> None:
        """Before ``optimizer.step()``: judge the step that is about to be applied (``state.global_step + 1``).

        Raises ``DivergenceError``, or in ``skip`` mode drops the step's gradients; returns normally otherwise.
        """
        step = state.global_step + 1
        if not self._grads_seen:
            self._grads_seen = True
            idle = untrained_parameters(model)
            if idle:
                logger.warning(
                    "moetune: %d trainable tensor(s) received no gradient in this run's first step: %s. Their "
                    "modules did not run on this data, or the model reads their weight directly (Jamba's dt_proj, "
                    "a vision tower on text rows), so they will not train; leave them out of lora_target or of the "
                    "trained modules",
                    len(idle),
                    listing(idle[:6], inline=True) + (", ..." if len(idle) > 6 else ""),
                )
        assert self._loss is not None, "add_loss runs for every micro-batch (MoetuneTrainer.training_step)"
        loss = float(self._loss)  # one host sync per optimizer step
        self._loss = None
        norm = None if grad_norm is None else float(grad_norm)
        if math.isfinite(loss):
            self._window.append(loss)
        if not math.isfinite(loss) or (norm is not None and not math.isfinite(norm)):
            self._non_finite(step, loss, norm, model)
            return
        self._skips_in_a_row = 0
        self._collapse(step, loss, norm)

    def _non_finite(self, step: int, loss: float, norm: float | None, model: Any) -> None:
        bad = non_finite_parameters(model, grads=True)
        where = f" Non-finite gradients in {len(bad)} parameter(s):{listing(bad)}" if bad else ""
        cause = f"the {'loss' if not math.isfinite(loss) else 'gradient norm'} is not finite (loss {loss}, gradient norm {norm})."
        if self.action is DivergenceAction.SKIP and self._skips_in_a_row + 1 < MAX_SKIPS_IN_A_ROW:
            self._skips_in_a_row += 1
            self.skipped.append(step)
            self._window_skipped += 1
            model.zero_grad(set_to_none=True)  # torch optimizers skip parameters without a gradient
            drop_base_grads(model)  # and the routed experts' sparse ones (full mode)
            logger.warning(
                "moetune: step %d skipped (on_divergence: skip): %s Its gradients were dropped; the optimizer "
                "did not update the weights (the learning-rate schedule still advances).",
                step,
                cause,
            )
            return
        if self.action is DivergenceAction.SKIP:
            cause += f" This is the {MAX_SKIPS_IN_A_ROW}th step in a row with a non-finite value (on_divergence: skip)."
        hint = (
            "At the first step this comes from the weights or the inputs, not the learning rate: a NaN/Inf in the "
            "model's checkpoint (`moetune: {check_finite: true}` makes the expert engine name the tensor and expert)."
            if step == 1 and not self.skipped
            else "Lower learning_rate, add warmup (warmup_ratio) or keep max_grad_norm > 0"
            + (
                ", or set on_divergence: skip to skip such steps."
                if self.action is DivergenceAction.STOP
                else "."
            )
        )
        self._stop(step, step, f"{cause} {hint}{where}")

    def _collapse(self, step: int, loss: float, norm: float | None) -> None:
        uniform = self.uniform_loss
        at_uniform = uniform is not None and abs(loss - uniform) <= COLLAPSE_LOSS_TOLERANCE * uniform
        if norm != 0.0 or not at_uniform:
            self._zero_since = None
            return
        if self._zero_since is None:
            self._zero_since = step
        if step - self._zero_since + 1 >= COLLAPSE_STEPS:
            # checkpoint-N holds N updates, and the update of step zero_since - 1 made the collapsed weights
            began = self._zero_since - 1
            self._stop(
                step,
                began,
                f"the model collapsed to a uniform guess: the gradient norm was exactly 0.0 for the last "
                f"{step - self._zero_since + 1} steps ({self._zero_since}..{step}) while the loss sat at "
                f"ln(vocab_size) = {uniform:.4f} (loss {loss:.4f}); the output no longer depends on the input. "
                "This follows a learning rate that blew the weights up: lower learning_rate or add warmup.",
            )

    def _stop(self, step: int, bad_from: int, message: str, *, applied: bool = False) -> None:
        good = last_checkpoint_before(self._output_dir, bad_from)
        kept = (
            f"Nothing from step {step} was saved."
            if applied
            else f"Nothing from step {step} was applied or saved."
        )
        resume = (
            f"Last good checkpoint: {good} (continue from it with resume_from_checkpoint: {good})."
            if good is not None
            else f"No checkpoint from before step {bad_from} is in {self._output_dir}."
        )
        # saved by this run from the update that diverged, before any step could see it (a collapse: that update
        # comes before the first zero-gradient step); older runs' higher checkpoints are not this run's
        after = [p.name for n, p in sorted(checkpoints(self._output_dir)) if bad_from <= n <= step]
        if after:
            one = len(after) == 1
            resume += (
                f" {', '.join(after)} hold{'s' if one else ''} weights from the diverged update: do not resume "
                f"from {'it' if one else 'them'}."
            )
        raise DivergenceError(f"training diverged at step {step}: {message}\n{kept} {resume}")

    def _check_weights(self, model: Any, state: Any, what: str) -> None:
        bad = non_finite_parameters(model, grads=False)
        if bad:
            step = state.global_step
            self._stop(
                step,
                step,
                f"{len(bad)} trained parameter(s) hold NaN/Inf after the optimizer step, before {what} was "
                f"written (its loss and gradient norm were finite: the update overflowed; lower learning_rate):"
                f"{listing(bad)}",
                applied=True,
            )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._output_dir = args.output_dir

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        # runs after DefaultFlowCallback has decided whether this step saves, and before the save
        if self._zero_since is not None and control.should_save:  # a collapse may be under way: hold it
            control.should_save = False
            if self._held_save is None:
                logger.warning(
                    "moetune: checkpoint-%d held back: the gradient norm has been exactly 0.0 since step %d with "
                    "the loss at ln(vocab_size) (a collapse, if it lasts %d steps); it is written at the first "
                    "step with a gradient again",
                    state.global_step,
                    self._zero_since,
                    COLLAPSE_STEPS,
                )
            self._held_save = state.global_step
        elif self._zero_since is None and self._held_save is not None:  # the run ended: write what it held
            control.should_save = True
            self._held_save = None
        if control.should_save and model is not None:
            self._check_weights(model, state, f"checkpoint-{state.global_step}")

    on_epoch_end = on_step_end  # save_strategy: epoch decides there, and saves right after

    def on_train_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self._check_weights(model, state, "the final adapter")
        if self.skipped:
            logger.warning(
                "moetune: %d step(s) were skipped for non-finite values (on_divergence: skip): %s",
                len(self.skipped),
                ", ".join(map(str, self.skipped)),
            )


class GuardedSteps:
    """Mixin for a transformers ``Trainer`` subclass (before the trainer class in the bases, as
    ``AtomicCheckpoints``): every micro-batch's loss and every step's gradient norm reach ``guard`` (set with
    :func:`attach_guard`) before ``optimizer.step()``. Without a guard the trainer behaves as its base."""

    guard: NumericalGuard | None = None

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        return self.guard.add_loss(loss) if self.guard is not None else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.guard is not None and "loss" in logs:
            logs = {**logs, **self.guard.window_logs()}  # a window with skipped steps: its finite steps' mean
        super().log(logs, start_time)  # type: ignore[misc]

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        # called once per optimizer step, after clipping and right before optimizer.step()
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)  # type: ignore[misc]
        if self.guard is not None:
            self.guard.check_step(grad_norm, model, self.state)  # type: ignore[attr-defined]
        return grad_norm


def attach_guard(trainer: Any, guard: NumericalGuard) -> None:
    """Give a :class:`GuardedSteps` trainer its guard (also registered as a callback: weights before saves)."""
    if not isinstance(trainer, GuardedSteps):
        raise TypeError(f"{type(trainer).__name__} does not mix in GuardedSteps; the guard would see nothing")
    trainer.guard = guard
    trainer.add_callback(guard)  # type: ignore[attr-defined]  # a Trainer (GuardedSteps is its mixin)
