"""One expert-options object (``moetune.config.experts``) behind ``load_model``'s keywords and the YAML."""

from __future__ import annotations

import re

import pytest

from moetune.config.experts import (
    ExpertOptions,
    ExpertResidency,
    expert_format_names,
    expert_option_problems,
)
from moetune.errors import ConfigError
from moetune.loading import LoadOptions


def test_format_names_come_from_the_format_registry(monkeypatch):
    from moetune.engine.formats import FORMATS

    assert expert_format_names() == ["auto", *FORMATS.names(), "bf16", "fp8"]
    monkeypatch.setitem(FORMATS._items, "int3", object())  # a format registered later is accepted at once
    assert ExpertOptions.create(expert_format="int3").expert_format == "int3"


BAD = [
    ({"expert_format": "int3"}, "expert_format", "got 'int3'; allowed: auto, dense"),
    ({"num_threads": 0}, "num_threads", "got 0; must be a positive integer"),
    (
        {"expert_format": "int8", "int4_group_size": 32},
        "int4_group_size",
        "applies to expert_format int4 only",
    ),
    ({"expert_residency": "disk"}, "expert_residency", "'disk' pages experts from a converted store"),
    ({"expert_path": "s", "expert_residency_budget": "lots"}, "expert_residency_budget", "got 'lots'"),
    ({"activation_policy": "keep"}, "activation_policy", "got 'keep'; allowed: retain, recompute"),
]


@pytest.mark.parametrize(("values", "key", "message"), BAD)
def test_library_and_yaml_report_the_same_problem(values, key, message, tmp_path):
    from moetune.config import parse_config

    assert any(k == key and message in m for k, m in expert_option_problems(values))
    with pytest.raises(ConfigError, match=rf"{key} (\S+ )*?{re.escape(message)}"):
        LoadOptions.create(device="cpu", **values)
    raw = {"model_name_or_path": "m", "dataset": "d", "output_dir": str(tmp_path / "o"), "moetune": values}
    with pytest.raises(ConfigError) as err:
        parse_config(raw, check_model_path=False)
    assert re.search(rf"moetune\.{key}: (\S+ )*?{re.escape(message)}", str(err.value))


def test_every_problem_at_once_and_canonical_values():
    problems = expert_option_problems({"expert_format": "int3", "num_threads": -1, "turbo": 1})
    assert [k for k, _ in problems] == ["turbo", "expert_format", "num_threads"]
    opts = ExpertOptions.create(
        expert_format="bf16", expert_path="~/s", expert_residency="disk", expert_residency_budget="1.5GiB"
    )
    assert opts.expert_format == "dense" and opts.expert_residency is ExpertResidency.DISK
    assert opts.expert_residency_budget == int(1.5 * 2**30) and not str(opts.expert_path).startswith("~")


def test_load_options_take_the_object_whole_or_the_keywords():
    opts = ExpertOptions.create(expert_format="int8", num_threads=2)
    assert LoadOptions.create(device="cpu", experts=opts).experts is opts
    assert LoadOptions.create(device="cpu", expert_format="int8", num_threads=2).experts == opts
    with pytest.raises(ConfigError, match="got experts= and the expert option"):
        LoadOptions.create(device="cpu", experts=opts, num_threads=1)


def test_the_engine_uses_the_configs_activation_policy():
    """One enum: the engine's plan re-exports the config's, so a config value is the engine's own."""
    from moetune.config.experts import ActivationPolicy
    from moetune.engine import ActivationPolicy as EnginePolicy
    from moetune.engine.plan import ActivationPolicy as PlanPolicy

    assert EnginePolicy is PlanPolicy is ActivationPolicy
