"""The protocol every lower tier (SSD, Redis, ...) implements, and ``PayloadSource``.

The RAM tier is the block pool itself (``blocks``); lower tiers store encoded
payload bytes (see ``codec``) and answer metadata queries without reading them,
so a lookup never touches the disk to decide whether a block is there.

Namespaces: every method that names a block by hash takes the block's namespace as
``ns=`` (keyword). A tier whose keys carry the namespace (Redis: tenant + namespace
key in every key) needs it; a tier with a local index (SSD) may ignore it.

Payloads handed to ``put`` are ``bytes`` or a ``PayloadSource``: an object that
encodes itself (``encode() -> bytes``, memoised and thread-safe, so several tiers
may share one) and estimates its size (``nbytes``) without encoding. The cache
hands a source over, so the encoding (the block buffer behind its header) runs on the
tier's writer thread, never on the request path under the cache lock.

Write policy: a tier may have ``policy = "write_through"`` (it gets every new block
when it is stored) or anything else / none (it gets a block when the block leaves
RAM, or at shutdown); the cache records per block which tiers hold it, so a block
is never put twice into a tier and ``add_sessions`` / ``discard`` reach exactly the
tiers that hold it.

Error contract: every public method lets only ``TierError`` out (never
``sqlite3.Error``, ``OSError``, ...); the cache policy catches it, counts it, and
treats the block as a miss. ``get`` verifies the checksum and raises
``CorruptBlockError`` (a ``TierError``, after quarantining) on a mismatch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace


@runtime_checkable
class PayloadSource(Protocol):
    """A block payload that is encoded only when a tier needs its bytes."""

    @property
    def nbytes(self) -> int:
        """An estimate of the encoded size (the in-memory size of the arrays)."""

    def encode(self) -> bytes:
        """The encoded bytes. Memoised: every call returns the same object; safe to
        call from several threads at once (one of them encodes, the others wait).
        Raises whatever encoding raises (the tier counts it as a failed write)."""


class LazyPayload:
    """A ``PayloadSource`` over a function that produces the bytes (called once)."""

    __slots__ = ("_make", "_nbytes", "_lock", "_data", "_error")

    def __init__(self, make: Callable[[], bytes], nbytes: int) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        self._make: Callable[[], bytes] | None = make
        self._nbytes = nbytes
        self._lock = threading.Lock()
        self._data: bytes | None = None
        self._error: BaseException | None = None

    @property
    def nbytes(self) -> int:
        return self._nbytes if self._data is None else len(self._data)

    @property
    def encoded(self) -> bool:
        return self._data is not None

    def encode(self) -> bytes:
        data = self._data
        if data is not None:
            return data
        with self._lock:
            if self._data is None:
                if self._error is not None:
                    raise self._error
                make = self._make
                if make is None:  # pragma: no cover - make is cleared only after success
                    raise RuntimeError("payload source has no producer")
                try:
                    out = make()
                except BaseException as e:
                    self._error = e
                    raise
                self._data = bytes(out)
                self._make = None  # drop the references the producer holds (the arrays)
            return self._data


class BytesPayload:
    """A ``PayloadSource`` over bytes that are already encoded."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    @property
    def nbytes(self) -> int:
        return len(self._data)

    def encode(self) -> bytes:
        return self._data


def as_source(payload: bytes | bytearray | memoryview | PayloadSource) -> PayloadSource:
    """``payload`` as a ``PayloadSource`` (bytes are wrapped). ValueError otherwise."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return BytesPayload(bytes(payload))
    if callable(getattr(payload, "encode", None)) and isinstance(getattr(payload, "nbytes", None), int):
        return payload
    raise ValueError(f"payload must be bytes or a PayloadSource, got {type(payload).__name__}")


class Tier(Protocol):
    name: str

    def get_meta(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> BlockMeta | None:
        """Metadata of a stored, unexpired block, or None. No payload read."""

    def get_metas(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                  ) -> list[BlockMeta | None]:
        """``get_meta`` of many blocks at once (a chain: one round trip for a remote
        tier). None where a block is absent, expired or damaged."""

    def children(self, parent_hash: BlockHash, *, ns: Namespace | None = None
                 ) -> list[BlockMeta]:
        """Metadata of the stored blocks whose parent is ``parent_hash``."""

    def get(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> bytes | None:
        """The payload bytes (checksum verified), or None if absent."""

    # Optional (a remote tier): ``get_many(block_hashes, *, ns=None) ->
    # list[tuple[bytes, list[str]] | None]``, the payloads and sessions of many blocks
    # in one round trip (None where absent or damaged; a transport failure raises
    # TierError). The cache reserves RAM for all of them first.

    def put(self, meta: BlockMeta, payload: bytes | PayloadSource, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        """Store (possibly asynchronously). True: accepted (a write queued or done).
        False: refused (queue full, budget, admission rule, degraded, closed).

        ``timeout``: how long to wait for room in a full write queue. 0 (the default,
        the request path) never waits; a number waits up to that many seconds
        (back-pressure: ``persist`` at shutdown and the demotion of an evicted block
        use it); None waits as long as it takes. A tier without a queue ignores it.
        ``hits``: how often the block was reused (for an admission rule). A block
        put again under the same hash replaces the stored copy (e.g. upgraded with a
        snapshot)."""

    def has_room(self, timeout: float | None = 0.0) -> bool:
        """True if a ``put`` that does not wait would find room in the write queue now
        (waiting up to ``timeout`` seconds for it, None: as long as it takes). A put
        refused while there is room was refused for good (admission, budget,
        degraded); one refused without room may be offered again later. A tier
        without a queue returns True. Optional: the cache treats a tier without it
        as one that always has room."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put is stored (or failed). True if done within
        ``timeout`` seconds (None: no limit). Optional for synchronous tiers."""

    def sessions_of(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> list[str]:
        """The sessions recorded on a stored block."""

    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        """Record more sessions on an already stored block."""

    def discard(self, block_hashes: Iterable[BlockHash], *, ns: Namespace | None = None) -> int:
        """Delete these blocks (e.g. partial tails a longer sibling now covers)."""

    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        """Remove the session from the blocks of ``tenant`` (None: of every tenant);
        delete those blocks left with no session that had at least one. A block
        belongs to one tenant (the tenant is in its root hash), so two tenants using
        the same session id never touch each other's blocks. Returns the number of
        blocks deleted."""

    def delete_session_blocks(self, session_id: str, tenant: str | None = None
                              ) -> set[bytes]:
        """``delete_session``, returning the hashes of the blocks deleted (the cache
        counts a block held by several tiers once). Optional: the cache counts a tier
        without it by ``delete_session``'s number."""

    def delete_tenant(self, tenant: str | None) -> int:
        """Delete every block of a tenant (None: all). Returns the count."""

    def stats(self) -> Mapping[str, Any]:
        """Counters and gauges for /v1/cache/stats and /metrics."""

    def close(self) -> None:
        """Flush pending writes and release resources."""
