"""Stage ``kto``: Kahneman-Tversky optimisation on responses tagged desirable or not, through TRL's
``KTOTrainer``.

LLaMA-Factory's keys map onto TRL's ``KTOConfig``: ``pref_beta`` -> ``beta``, ``kto_chosen_weight`` ->
``desirable_weight``, ``kto_rejected_weight`` -> ``undesirable_weight``. ``pref_ftx`` is refused for kto (TRL's
KTOTrainer has no SFT term). The KL term is estimated from mismatched prompt/completion pairs within each
batch, so batches hold at least 2 rows and are drawn in order (TRL's sequential sampler). The reference
policy is the model with its adapters disabled.
"""

from __future__ import annotations

from typing import Any

from moetune.config import MoetuneConfig
from moetune.train.preference import UNPAIRED
from moetune.train.stages.base import STAGES, TrainingStage, preference_builder


def kto_arguments(cfg: MoetuneConfig) -> dict[str, Any]:
    """``KTOConfig`` keyword arguments for the preference keys of ``cfg``."""
    f = cfg.finetune
    return {
        "beta": f.pref_beta,
        "desirable_weight": f.kto_chosen_weight,
        "undesirable_weight": f.kto_rejected_weight,
        "loss_type": "kto",
    }


STAGES.register("kto")(TrainingStage(UNPAIRED, preference_builder("kto", kto_arguments), requires=("trl",)))
