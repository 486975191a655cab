"""The mechanics of the schema: typed fields, value coercion, range checks and the problem collector.

Every config section is a frozen dataclass whose field names are the YAML keys. ``option(...)`` attaches
a range check and, for modes, the values a later version adds. ``coerce`` turns a raw YAML value into the
annotated type, accepting what LLaMA-Factory's argument parser accepts (``"1e-4"`` for a float, ``"true"``
for a bool, a comma-separated string for a list). ``Problems`` collects every problem of a config so the
user sees them all at once.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from moetune.errors import ConfigError

Check = Callable[[Any], "str | None"]  # returns what is wrong with a parsed value, or None


class Problems:
    """Collects ``(key, message)`` problems and raises them together as one ``ConfigError``."""

    def __init__(self, source: str) -> None:
        self.source = source  # the config file (or "config") the problems are reported against
        self._items: list[tuple[str, str]] = []

    def add(self, key: str, message: str) -> None:
        """Record that ``key`` has a problem; ``message`` says what is wrong, what is allowed and the fix."""
        self._items.append((key, message))

    def has(self, *keys: str) -> bool:
        """True if any of ``keys`` already has a problem (cross-field checks skip such keys)."""
        return any(k in keys for k, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)

    def raise_if_any(self) -> None:
        """Raise one ``ConfigError`` listing every problem, or return if there is none."""
        if not self._items:
            return
        n = len(self._items)
        lines = [f"{self.source}: {n} problem{'s' if n > 1 else ''}:"]
        lines += [f"  - {key}: {message}" for key, message in self._items]
        raise ConfigError("\n".join(lines))


def option(
    default: Any,
    *,
    check: Check | None = None,
    later: Mapping[str, str] | None = None,
    required: bool = False,
) -> Any:
    """A schema field: ``default``, an optional range ``check``, and ``later``: values of a mode that
    LLaMA-Factory knows and a later moetune version adds (value -> what it is), reported as such.
    A ``required`` field has no usable default: a config without the key is reported."""
    metadata = {"check": check, "later": dict(later or {}), "required": required}
    return dataclasses.field(default=default, metadata=metadata)


def required(check: Check | None = None) -> Any:
    """A schema field the YAML must set (its placeholder default is None)."""
    return option(None, check=check, required=True)


def derived(default: Any) -> Any:
    """A field computed during validation (never read from the YAML)."""
    return dataclasses.field(default=default, metadata={"derived": True})


def yaml_fields(cls: type) -> dict[str, dataclasses.Field]:
    """The fields of a section that come from YAML keys, by key name."""
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("derived")}


class _BadValue(ValueError):
    """Raised by ``coerce``; the message says what was expected."""


_BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def describe(tp: Any) -> str:
    """Words for a type, used in messages: 'an integer', 'true or false', 'one of: a, b'."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        parts = [describe(a) for a in args if a is not type(None)]
        return " or ".join(parts) + (" or null" if type(None) in args else "")
    if origin is tuple:
        return "a list of strings or a comma-separated string"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of: " + ", ".join(str(m.value) for m in tp)
    return {
        bool: "true or false",
        int: "an integer",
        float: "a number",
        str: "a string",
        Path: "a path",
        dict: "a mapping",
    }.get(tp, str(tp))


def coerce(value: Any, tp: Any) -> Any:
    """``value`` converted to ``tp``; raises ``_BadValue`` saying what was expected."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg)
            except _BadValue:
                continue
        raise _BadValue(f"expected {describe(tp)}")
    if value is None:
        raise _BadValue(f"expected {describe(tp)}, not null")
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise _BadValue(f"expected {describe(tp)}")
        stripped = tuple(i.strip() for i in items)
        if not stripped or not all(stripped):
            raise _BadValue("expected a non-empty list with no empty names")
        return stripped
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if value is False:  # YAML 1.1 (PyYAML, OmegaConf) reads an unquoted `no` as false
            value = "no"
        if isinstance(value, str):
            for member in tp:
                if value.lower() == str(member.value):
                    return member
        raise _BadValue(f"expected {describe(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.lower()]
        raise _BadValue("expected true or false")
    if tp is int:
        number = _number(value)
        if number is None or not float(number).is_integer():
            raise _BadValue("expected an integer")
        return int(number)
    if tp is float:
        number = _number(value)
        if number is None:
            raise _BadValue("expected a number")
        return float(number)
    if tp is str:
        if not isinstance(value, str):
            raise _BadValue("expected a string")
        return value
    if tp is Path:
        if not isinstance(value, str) or not value:
            raise _BadValue("expected a path")
        return Path(value).expanduser()
    if tp is dict:
        if not isinstance(value, dict):
            raise _BadValue("expected a mapping")
        return dict(value)
    raise AssertionError(f"schema uses a type coerce does not handle: {tp!r}")


def _number(value: Any) -> int | float | None:
    """An int or float from a YAML number or a numeric string (PyYAML reads ``1e-4`` as a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


def parse_section(cls: type, raw: Mapping[str, Any], problems: Problems, prefix: str = "") -> Any:
    """Build section ``cls`` from the keys of ``raw`` it owns; bad values are reported (as
    ``prefix + key``) and left at their defaults so that parsing goes on and every problem is found."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for name, f in yaml_fields(cls).items():
        if name not in raw:
            if f.metadata["required"]:
                problems.add(prefix + name, "is required and missing; add it to the config")
            continue
        value = raw[name]
        later: dict[str, str] = f.metadata["later"]
        if isinstance(value, str) and value.lower() in later:
            problems.add(
                prefix + name,
                f"{value!r} ({later[value.lower()]}) is not supported yet; a later moetune version adds it. "
                f"Supported: {describe(hints[name]).removeprefix('one of: ')}",
            )
            continue
        try:
            parsed = coerce(value, hints[name])
        except _BadValue as err:
            problems.add(prefix + name, f"got {value!r}; {err}")
            continue
        check: Check | None = f.metadata["check"]
        message = check(parsed) if check is not None and parsed is not None else None
        if message:
            problems.add(prefix + name, f"got {value!r}; {message}")
            continue
        values[name] = parsed
    return cls(**values)


# Range checks. Each returns the allowed range in words when the value is outside it.


def positive(value: float) -> str | None:
    """``value > 0``."""
    return None if value > 0 else "must be > 0"


def non_negative(value: float) -> str | None:
    """``value >= 0``."""
    return None if value >= 0 else "must be >= 0"


def unit_interval(value: float) -> str | None:
    """``0 <= value < 1`` (probabilities such as dropout, ratios such as warmup)."""
    return None if 0 <= value < 1 else "must be in [0, 1)"


def steps_or_ratio(value: float) -> str | None:
    """A whole number of steps >= 1, or a ratio of the total steps in (0, 1), as transformers reads it."""
    if 0 < value < 1 or (value >= 1 and float(value).is_integer()):
        return None
    return "must be a whole number of steps >= 1, or a ratio of the total steps in (0, 1)"
