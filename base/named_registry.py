"""A registry of one variation point's implementations by name (routing policies, topology kinds).

Items are kept in registration order (the built-ins first, as their registry module lists them); a name already
taken is refused, and so is an unknown one, naming every registered name. Tests register a toy item and forget it
afterwards (`unregister`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, Protocol, TypeVar


class Named(Protocol):
    @property
    def name(self) -> str: ...


Item = TypeVar("Item", bound=Named)


class NamedRegistry(Generic[Item]):
    """`what` names an item in messages (`routing policy`); `error` is what a refusal raises; `built_in` are
    registered first."""

    def __init__(self, what: str, error: type[Exception], built_in: Iterable[Item] = ()) -> None:
        self._what = what
        self._error = error
        self._items: dict[str, Item] = {}
        for item in built_in:
            self.register(item)

    def register(self, item: Item) -> Item:
        """Make `item` known by its name; a name already taken is refused."""
        if item.name in self._items:
            raise self._error(f"{self._what} {item.name!r} is already registered")
        self._items[item.name] = item
        return item

    def unregister(self, name: str) -> None:
        """Forget an item (tests that registered one); unknown names are refused."""
        self.named(name)
        del self._items[name]

    def named(self, name: str) -> Item:
        item = self._items.get(name)
        if item is None:
            raise self._error(f"unknown {self._what} {name!r}; choose one of {sorted(self._items)}")
        return item

    def names(self) -> list[str]:
        return list(self._items)

    def items(self) -> list[Item]:
        return list(self._items.values())
