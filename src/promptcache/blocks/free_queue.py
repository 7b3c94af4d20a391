"""An intrusive doubly linked queue (O(1) append / popleft / remove, no allocation): the pool's LRU.

A node is queued iff its ``prev_free`` is not None."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from ..errors import InvariantError


class FreeNode:
    """Base class of anything that can sit in a ``FreeQueue``."""

    __slots__ = ("prev_free", "next_free")

    def __init__(self) -> None:
        self.prev_free: FreeNode | None = None
        self.next_free: FreeNode | None = None

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free is not None


N = TypeVar("N", bound=FreeNode)


class FreeQueue(Generic[N]):
    """FIFO of nodes with O(1) removal from the middle."""

    __slots__ = ("_head", "_tail", "_len")

    def __init__(self) -> None:
        self._head = FreeNode()
        self._tail = FreeNode()
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def append(self, node: N) -> None:
        """Put ``node`` at the tail (most recently used end)."""
        if node.prev_free is not None or node.next_free is not None:
            raise InvariantError("node is already in a free queue")
        last = self._tail.prev_free
        if last is None:
            raise InvariantError("free queue tail sentinel lost its link")
        node.prev_free = last
        node.next_free = self._tail
        last.next_free = node
        self._tail.prev_free = node
        self._len += 1

    def appendleft(self, node: N) -> None:
        """Put ``node`` at the head (evicted next)."""
        if node.prev_free is not None or node.next_free is not None:
            raise InvariantError("node is already in a free queue")
        first = self._head.next_free
        if first is None:
            raise InvariantError("free queue head sentinel lost its link")
        node.prev_free = self._head
        node.next_free = first
        first.prev_free = node
        self._head.next_free = node
        self._len += 1

    def peekleft(self) -> N | None:
        """The head node (next to be evicted), or None if empty."""
        first = self._head.next_free
        if first is self._tail or first is None:
            return None
        return first  # type: ignore[return-value]

    def popleft(self) -> N:
        """Remove and return the head node. Raises IndexError if empty."""
        first = self.peekleft()
        if first is None:
            raise IndexError("pop from an empty free queue")
        self.remove(first)
        return first

    def remove(self, node: N) -> None:
        """Unlink ``node`` from anywhere in the queue in O(1)."""
        prev, nxt = node.prev_free, node.next_free
        if prev is None or nxt is None:
            raise InvariantError("node is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        node.prev_free = None
        node.next_free = None
        self._len -= 1

    def __iter__(self) -> Iterator[N]:
        """Nodes from head (LRU) to tail (MRU)."""
        node = self._head.next_free
        while node is not None and node is not self._tail:
            nxt = node.next_free
            yield node  # type: ignore[misc]
            node = nxt

    def check(self) -> None:
        """Verify every link both ways and the length; raise InvariantError if broken."""
        count = 0
        prev: FreeNode = self._head
        node = self._head.next_free
        while node is not self._tail:
            if node is None:
                raise InvariantError(f"free queue broken after {count} nodes (None link)")
            if node.prev_free is not prev:
                raise InvariantError(f"free queue node {count} has a wrong prev link")
            count += 1
            if count > self._len:
                raise InvariantError(f"free queue holds more nodes than its length {self._len}")
            prev = node
            node = node.next_free
        if self._tail.prev_free is not prev:
            raise InvariantError("free queue tail sentinel has a wrong prev link")
        if self._head.prev_free is not None or self._tail.next_free is not None:
            raise InvariantError("free queue sentinels have outer links")
        if count != self._len:
            raise InvariantError(f"free queue length {self._len} but {count} nodes linked")
