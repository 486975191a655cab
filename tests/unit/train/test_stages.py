"""The stage registry: every ``stage`` the config accepts has a trainer and a codec for the rows it declares,
and LLaMA-Factory's preference keys become TRL's arguments."""

from __future__ import annotations

from typing import Any

import pytest

from moetune.config import Stage, parse_config
from moetune.config.stage_rules import STAGE_ROWS
from moetune.train.stages import STAGES
from moetune.train.stages.dpo import dpo_arguments
from moetune.train.stages.kto import kto_arguments


def test_every_accepted_stage_is_registered_with_the_rows_the_config_checks() -> None:
    assert STAGES.names() == sorted(s.value for s in Stage)
    for stage in Stage:
        assert STAGES.get(stage.value).codec.kind is STAGE_ROWS[stage], stage


def _cfg(tmp_path, monkeypatch, **keys: Any) -> Any:
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "p.json").write_text("[]")
    info = {
        "p": {"file_name": "p.json", "ranking": True},
        "k": {"file_name": "p.json", "columns": {"kto_tag": "t"}},
    }
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps(info))
    raw = {"model_name_or_path": "m", "output_dir": "out", "per_device_train_batch_size": 2, **keys}
    return parse_config(raw, check_model_path=False)


@pytest.mark.parametrize(
    ("keys", "want"),
    [
        ({}, {"beta": 0.1, "loss_type": ["sigmoid"], "loss_weights": [1.0]}),
        ({"pref_beta": 0.3, "pref_loss": "ipo"}, {"beta": 0.3, "loss_type": ["ipo"], "loss_weights": [1.0]}),
        # pref_ftx: TRL's `sft` loss on the chosen responses, weighted
        (
            {"pref_ftx": 0.5, "pref_loss": "hinge"},
            {"beta": 0.1, "loss_type": ["hinge", "sft"], "loss_weights": [1.0, 0.5]},
        ),
    ],
)
def test_dpo_keys_become_dpo_config_arguments(tmp_path, monkeypatch, keys, want) -> None:
    from trl import DPOConfig

    cfg = _cfg(tmp_path, monkeypatch, stage="dpo", dataset="p", **keys)
    assert dpo_arguments(cfg) == want
    DPOConfig(str(tmp_path / "o"), **want, bf16=False, use_cpu=True)  # TRL accepts them


def test_kto_keys_become_kto_config_arguments(tmp_path, monkeypatch) -> None:
    from trl import KTOConfig

    cfg = _cfg(tmp_path, monkeypatch, stage="kto", dataset="k", pref_beta=0.2, kto_rejected_weight=1.5)
    want = {"beta": 0.2, "desirable_weight": 1.0, "undesirable_weight": 1.5, "loss_type": "kto"}
    assert kto_arguments(cfg) == want
    KTOConfig(str(tmp_path / "o"), **want, bf16=False, use_cpu=True)
