"""Why a request's prompt was not (fully) served from the cache, as data.

``CacheMiss`` and its causes are pure values (no pool, no tier): the matcher makes them,
the engine makes its own (``cache_error``, ``restore_error``), and the stats, the
alert, the advisor, the diagnostics and the request log read them. ``GoneMemory``
remembers the blocks that left RAM or were never stored, to explain a miss.
"""

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
# a save of these blocks failed (``CacheMiss.store_error``: the engine's cause name,
# layout | tier | budget | invariant | other), recorded by ``PromptCache.note_not_stored``
NOT_STORED = "not_stored"
# the engine's: the lookup failed / restoring the blocks failed (both prefill everything)
CACHE_ERROR = "cache_error"
RESTORE_ERROR = "restore_error"

# what the gone-memory remembers of a block: (cause, store_error)
Reason = tuple[str, str | None]


@dataclass(frozen=True, slots=True)
class CacheMiss:
    """Why a request's prompt was not (fully) served from the cache, as data: made by
    the matcher (or the engine), read as it is by the stats, the alert, the advisor,
    the diagnostics, the probe and the request log (never parsed back from text).

    ``kind``: cold | evicted | expired | diverged | not_restorable | promotion_failed
    | not_stored (``store_error`` says why that save failed: layout | tier | budget |
    invariant | other) | cache_error | restore_error; ``cause`` is how the stats count
    it (``not_stored: layout``, else the kind). ``position``: the first prompt token
    not found in any stored block; ``restorable``: where the state can be restored;
    ``message_index``: the chat message ``position`` falls in (``at_message``).
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
    """A bounded memory of blocks that left RAM (evicted or expired) or were never
    stored (a failed save), keyed by the block hash and by its parent hash, used to
    explain misses."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, capacity)
        self._by_hash: BoundedLRU[BlockHash, Reason] = BoundedLRU(self.capacity)
        self._by_parent: BoundedLRU[BlockHash, Reason] = BoundedLRU(self.capacity)

    def record(self, block_hash: BlockHash | None, parent: BlockHash | None, cause: str,
               store_error: str | None = None) -> None:
        """Remember ``cause`` (and a failed save's ``store_error``) for the block
        ``block_hash`` and for the children of ``parent`` (either may be None: not
        recorded under that key)."""
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

