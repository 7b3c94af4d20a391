"""``BoundedLRU``: a map of at most ``capacity`` entries that forgets the least recently
used first. Not thread-safe: its owners hold their own locks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedLRU(Generic[K, V]):
    """``put`` and ``get`` make an entry the newest; ``peek`` does not. Iteration and
    ``items`` go from the oldest entry to the newest."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._map: OrderedDict[K, V] = OrderedDict()

    def put(self, key: K, value: V) -> list[tuple[K, V]]:
        """Store ``value`` as the newest entry; the entries that made room, oldest first
        (with capacity 0, the entry itself)."""
        self._map[key] = value
        self._map.move_to_end(key)
        gone = []
        while len(self._map) > self.capacity:
            gone.append(self._map.popitem(last=False))
        return gone

    def get(self, key: K) -> V | None:
        value = self._map.get(key)
        if value is not None:
            self._map.move_to_end(key)
        return value

    def peek(self, key: K) -> V | None:
        return self._map.get(key)

    def pop(self, key: K) -> V | None:
        return self._map.pop(key, None)

    def pop_oldest(self) -> tuple[K, V]:
        """The least recently used entry, removed (KeyError when empty)."""
        return self._map.popitem(last=False)

    def items(self) -> list[tuple[K, V]]:
        return list(self._map.items())

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, key: object) -> bool:
        return key in self._map

    def __iter__(self) -> Iterator[K]:
        return iter(self._map)
