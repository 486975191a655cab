"""Stage ``dpo``: direct preference optimisation on chosen/rejected pairs, through TRL's ``DPOTrainer``.

LLaMA-Factory's keys map onto TRL's ``DPOConfig``: ``pref_beta`` -> ``beta``; ``pref_loss`` (sigmoid, hinge,
ipo) -> ``loss_type``, each TRL's loss of the same name (IPO on per-token averaged log-ratios, as LLaMA-Factory
computes it); ``pref_ftx`` > 0 adds TRL's ``sft`` loss with that weight: the mean negative log-likelihood of
the chosen responses' tokens. LLaMA-Factory averages that NLL per response before the batch mean, so the two
agree when a batch's chosen responses have equal lengths (or one pair per batch) and otherwise weight long
responses differently (docs/stages.md). The reference policy is the model with its adapters disabled.
"""

from __future__ import annotations

from typing import Any

from moetune.config import MoetuneConfig
from moetune.train.data import PreparedData
from moetune.train.preference import PAIRED
from moetune.train.stages.base import STAGES, TrainingStage


def dpo_arguments(cfg: MoetuneConfig) -> dict[str, Any]:
    """``DPOConfig`` keyword arguments for the preference keys of ``cfg``."""
    f = cfg.finetune
    losses, weights = [f.pref_loss.value], [1.0]
    if f.pref_ftx > 0:
        losses.append("sft")
        weights.append(f.pref_ftx)
    return {"beta": f.pref_beta, "loss_type": losses, "loss_weights": weights}


def build_trainer(
    cfg: MoetuneConfig,
    model: Any,
    tokenizer: Any,
    data: PreparedData,
    args: dict[str, Any],
    callbacks: list[Any],
) -> Any:
    """A ``MoetuneDPOTrainer``; rows are truncated already (``max_length=None``; no router
    auxiliary loss, as in sft and LLaMA-Factory: the collator cuts nothing)."""
    from trl import DPOConfig

    from moetune.train.stages.trl_trainers import MoetuneDPOTrainer

    return MoetuneDPOTrainer(
        model=model,
        args=DPOConfig(**args, **dpo_arguments(cfg), max_length=None, router_aux_loss_coef=0.0),
        train_dataset=data.train,
        eval_dataset=data.eval,
        processing_class=tokenizer,
        callbacks=callbacks,
    )


STAGES.register("dpo")(TrainingStage(PAIRED, build_trainer, requires=("trl",)))
