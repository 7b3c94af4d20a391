"""Why a request's prompt was not (fully) served from the cache, as data: ``CacheMiss``
(pure values, made by the matcher or the engine, read by stats, alert, advisor,
diagnostics and request log) and ``GoneMemory`` (blocks that left RAM or were never
stored)."""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..hashing import BlockHash
from ..lru import BoundedLRU

# Causes of a short match (CacheMiss.cause)
COLD = "cold"
EVICTED = "evicted"
EXPIRED = "expired"
DIVERGED = "diverged"
NOT_RESTORABLE = "not_restorable"
PROMOTION_FAILED = "promotion_failed"
# a save failed (``store_error``: layout | tier | budget | invariant | other)
NOT_STORED = "not_stored"
# the engine's: the lookup failed / restoring the blocks failed (both prefill everything)
CACHE_ERROR = "cache_error"
RESTORE_ERROR = "restore_error"

# what the gone-memory remembers of a block: (cause, store_error)
Reason = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class CacheMiss:
    """A miss as data (never parsed back from text).

    ``kind``: one of the constants above (``store_error``: why a ``not_stored`` save
    failed). ``position``: the first prompt token in no stored block; ``restorable``:
    where the state can be restored; ``message_index``: the chat message of ``position``.
    """

    kind: str
    position: int
    restorable: int
    num_tokens: int
    store_error: str | None = None
    message_index: int | None = None

    @property
    def cause(self) -> str:
        """The cause as the stats count it: ``not_stored: layout``, else the kind."""
        return self.kind if self.store_error is None else f"{self.kind}: {self.store_error}"

    @classmethod
    def of(cls, kind: str, position: int, restorable: int, num_tokens: int,
           message_starts: Sequence[int] = ()) -> CacheMiss:
        """A miss at ``position`` with the chat message it falls in."""
        return cls(kind, position, restorable, num_tokens).at_message(message_starts)

    def at_message(self, message_starts: Sequence[int]) -> CacheMiss:
        """This miss with the chat message its position falls in."""
        if not message_starts:
            return self
        found = bisect.bisect_right(message_starts, self.position) - 1
        return replace(self, message_index=found if found >= 0 else None)

    def describe(self) -> str:
        """The log line: cause, first divergent token, chat message, restorable point."""
        text = f"{self.cause}: first uncached token at position {self.position}"
        if self.message_index is not None:
            text += f" (chat message {self.message_index})"
        if self.restorable != self.position:
            text += f"; state restorable at {self.restorable}"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"cause": self.cause, "position": self.position,
                "restorable": self.restorable, "num_tokens": self.num_tokens,
                "message_index": self.message_index}


class GoneMemory:
    """A bounded memory, by block and parent hash, of blocks gone from RAM or never stored."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._by_hash: BoundedLRU[BlockHash, Reason] = BoundedLRU(self.capacity)
        self._by_parent: BoundedLRU[BlockHash, Reason] = BoundedLRU(self.capacity)

    def record(self, block_hash: BlockHash | None, parent: BlockHash | None, cause: str,
               store_error: str | None = None) -> None:
        """Remember ``cause`` for ``block_hash`` and ``parent``'s children (either may be None)."""
        if not self.capacity:
            return
        for mem, key in ((self._by_hash, block_hash), (self._by_parent, parent)):
            if key is None:
                continue
            mem.put(key, (cause, store_error))

    def forget(self, block_hash: BlockHash) -> None:
        self._by_hash.pop(block_hash)

    def by_hash(self, block_hash: BlockHash) -> Reason | None:
        return self._by_hash.peek(block_hash)

    def by_parent(self, parent: BlockHash) -> Reason | None:
        return self._by_parent.peek(parent)

