"""The protocol every lower tier (SSD, and later shared ones) implements.

The RAM tier is the block pool itself (``blocks``); lower tiers store encoded
payload bytes (see ``codec``) and answer metadata queries without reading them,
so a lookup never touches the disk to decide whether a block is there.

Namespaces: every method that names a block by hash takes the block's namespace as
``ns=`` (keyword). A tier whose keys carry the namespace (Redis: tenant + namespace
key in every key) needs it; a tier with a local index (SSD) may ignore it.

Error contract: methods may raise ``TierError``; the cache policy catches it,
counts it, and treats the block as a miss. ``get`` verifies the checksum and
raises ``CorruptBlockError`` (after quarantining) on a mismatch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace


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

    # Optional (a remote tier): ``get_many(block_hashes, *, ns=None) -> list[bytes | None]``,
    # the payloads of many blocks in one round trip (None where absent or damaged; a
    # transport failure raises TierError). The cache reserves RAM for all of them first.

    def put(self, meta: BlockMeta, payload: bytes, sessions: Iterable[str] = (),
            hits: int | None = None) -> bool:
        """Store (possibly asynchronously). False if dropped (queue full, budget,
        admission rule, degraded). ``hits``: how often the block was reused (for an
        admission rule). A block put again under the same hash replaces the stored
        copy (e.g. upgraded with a snapshot). Never blocks a request for long."""

    def sessions_of(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> list[str]:
        """The sessions recorded on a stored block."""

    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        """Record more sessions on an already stored block."""

    def discard(self, block_hashes: Iterable[BlockHash], *, ns: Namespace | None = None) -> int:
        """Delete these blocks (e.g. partial tails a longer sibling now covers)."""

    def delete_session(self, session_id: str) -> int:
        """Remove the session from every block; delete blocks left with no session
        that had at least one. Returns the number of blocks deleted."""

    def delete_tenant(self, tenant: str | None) -> int:
        """Delete every block of a tenant (None: all). Returns the count."""

    def stats(self) -> Mapping[str, Any]:
        """Counters and gauges for /v1/cache/stats and /metrics."""

    def close(self) -> None:
        """Flush pending writes and release resources."""
