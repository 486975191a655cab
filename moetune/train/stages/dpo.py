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
from moetune.train.preference import PAIRED
from moetune.train.stages.base import STAGES, TrainingStage, preference_builder


def dpo_arguments(cfg: MoetuneConfig) -> dict[str, Any]:
    """``DPOConfig`` keyword arguments for the preference keys of ``cfg``."""
    f = cfg.finetune
    losses, weights = [f.pref_loss.value], [1.0]
    if f.pref_ftx > 0:
        losses.append("sft")
        weights.append(f.pref_ftx)
    return {"beta": f.pref_beta, "loss_type": losses, "loss_weights": weights}


STAGES.register("dpo")(TrainingStage(PAIRED, preference_builder("dpo", dpo_arguments), requires=("trl",)))
