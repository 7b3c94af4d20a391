"""The protocol every lower tier (SSD, Redis) implements, and ``PayloadSource``.

Tiers answer metadata queries without reading payloads; methods naming a block take ``ns=``. Only
``TierError`` leaves a public method (the cache counts a miss). A ``PayloadSource`` encodes on the
tier's writer thread, never under the cache lock."""

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
        """The encoded bytes, memoised and thread-safe; raises whatever encoding raises."""


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
        """``get_meta`` of many blocks in one round trip; None where absent, expired or damaged."""

    def children(self, parent_hash: BlockHash, *, ns: Namespace | None = None
                 ) -> list[BlockMeta]:
        """Metadata of the stored blocks whose parent is ``parent_hash``."""

    def get(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> bytes | None:
        """The payload bytes (checksum verified), or None if absent."""

    # Optional: ``get_many(block_hashes, *, ns=None)``, ``(payload, sessions)`` or None each in one
    # round trip.

    def put(self, meta: BlockMeta, payload: bytes | PayloadSource, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        """Store (possibly asynchronously); False: refused. ``timeout``: wait for queue room (0:
        never; None: no limit)."""

    def has_room(self, timeout: float | None = 0.0) -> bool:
        """True if a non-waiting ``put`` would find queue room (waiting ``timeout``). Optional."""

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every accepted put is stored or failed; True if within ``timeout``."""

    def sessions_of(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> list[str]:
        """The sessions recorded on a stored block."""

    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        """Record more sessions on an already stored block."""

    def discard(self, block_hashes: Iterable[BlockHash], *, ns: Namespace | None = None) -> int:
        """Delete these blocks (e.g. partial tails a longer sibling now covers)."""

    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        """Remove the session from ``tenant``'s blocks (None: all), deleting those left without."""

    def delete_session_blocks(self, session_id: str, tenant: str | None = None
                              ) -> set[bytes]:
        """``delete_session`` returning the deleted hashes. Optional."""

    def delete_tenant(self, tenant: str | None) -> int:
        """Delete every block of a tenant (None: all). Returns the count."""

    def stats(self) -> Mapping[str, Any]:
        """Counters and gauges for /v1/cache/stats and /metrics."""

    def close(self) -> None:
        """Flush pending writes and release resources."""
