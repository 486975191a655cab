"""A small named registry: variants register themselves; lookup of an unknown name lists the known ones."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from moetune.errors import RegistryError

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps a name to a variant. ``kind`` names what is registered, for error messages."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")`` on a class or function."""

        def add(item: T) -> T:
            if name in self._items:
                raise RegistryError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = item
            return item

        return add

    def get(self, name: str) -> T:
        """The variant called ``name``; an unknown name raises listing the supported ones."""
        try:
            return self._items[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} {name!r}; supported: {', '.join(sorted(self._items))}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._items))
