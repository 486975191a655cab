"""Property: any YAML handed to the config loader either loads or raises ``ConfigError``, never another
exception (hypothesis generates the documents: arbitrary text, and mappings over moetune's own keys with
values of every YAML type)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moetune.config import known_keys, load_config
from moetune.config.schema import ENGINE_KEYS
from moetune.errors import ConfigError

SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.sampled_from(
        ["all", "cpu", "true", "1e-4", "-1", "steps", "skip", "~", "/", ".", "q_proj,experts", "\x00"]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=8,
)
keys = st.sampled_from(sorted(known_keys())) | st.text(max_size=15)
engine = st.dictionaries(st.sampled_from(sorted(ENGINE_KEYS)) | st.text(max_size=8), values, max_size=4)
documents = st.dictionaries(keys, values, max_size=10).flatmap(
    lambda d: st.just(d) | engine.map(lambda e: {**d, "moetune": e})
)


def loads_or_config_error(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_bytes(data)
    with contextlib.suppress(ConfigError):  # anything else fails the test
        load_config(path)


@SETTINGS
@given(doc=documents)
@example(doc={"moetune": {"activation_policy": None}})  # found by this test: a ValueError from the enum
@example(doc={"moetune": {"check_finite": None, "expert_format": None}})
def test_any_mapping_loads_or_raises_config_error(tmp_path, doc) -> None:
    loads_or_config_error(tmp_path, yaml.safe_dump(doc, allow_unicode=True).encode("utf-8", "surrogatepass"))


@SETTINGS
@given(text=st.text(max_size=200))
def test_any_text_loads_or_raises_config_error(tmp_path, text) -> None:
    loads_or_config_error(tmp_path, text.encode("utf-8", "surrogatepass"))


@SETTINGS
@given(data=st.binary(max_size=100))
@example(data=b"lora_rank: 4\n# caf\xe9\n")  # found by this test: a UnicodeDecodeError from read_text
def test_any_bytes_load_or_raise_config_error(tmp_path, data) -> None:
    loads_or_config_error(tmp_path, data)
