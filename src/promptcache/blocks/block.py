"""One cached block in RAM: identity, payload, the pool's bookkeeping, flags and eviction levels."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import InvariantError
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from .free_queue import FreeNode

TRUNCATABLE = 1
SNAPSHOT = 2
PERSISTED = 4  # a copy is known to be in the lower tiers: no demotion needed

# Eviction levels: idle first, then an active session's latest chain; protected (a breakpoint)
# never.
IDLE = 0
ACTIVE = 1
PROTECTED = 2
LEVELS = (IDLE, ACTIVE, PROTECTED)

EMPTY_SESSIONS: tuple[str, ...] = ()
MAX_AGENTS_PER_BLOCK = 16  # the first agents recorded on a block; later ones are not


def pack_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes (the compact form blocks keep)."""
    return np.asarray(token_ids, dtype="<u4").tobytes()


def unpack_tokens(data: bytes) -> tuple[int, ...]:
    return tuple(np.frombuffer(data, dtype="<u4").tolist())


class Block(FreeNode):
    """One cached block in RAM. Token ids are kept packed (4 bytes each)."""

    __slots__ = (
        "block_hash",
        "parent_hash",
        "tokens",
        "start",
        "extra_keys",
        "flags",
        "ns",
        "payload",
        "nbytes",
        "ref_cnt",
        "last_access",
        "sessions",
        "agents",
        "hits",
        "kids",
        "level",
    )

    def __init__(
        self,
        block_hash: BlockHash | None,
        parent_hash: BlockHash,
        tokens: bytes,
        start: int,
        extra_keys: tuple[bytes, ...],
        flags: int,
        ns: Namespace,
        payload: Any,
        nbytes: int,
        last_access: float,
    ) -> None:
        self.prev_free: FreeNode | None = None
        self.next_free: FreeNode | None = None
        self.block_hash = block_hash
        self.parent_hash = parent_hash
        self.tokens = tokens
        self.start = start
        self.extra_keys = extra_keys
        self.flags = flags
        self.ns = ns
        self.payload = payload
        self.nbytes = nbytes
        self.ref_cnt = 0
        self.last_access = last_access
        self.sessions = EMPTY_SESSIONS
        # the (sub)agents that stored or reused it (RAM only: lower tiers keep sessions)
        self.agents = EMPTY_SESSIONS
        self.hits = 0  # times a lookup reused it (SSD admission rule)
        # children index (pool-managed): None, the one child, or a list of children
        self.kids: Block | list[Block] | None = None
        self.level = IDLE  # eviction level (pool-managed through set_level)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) >> 2

    @property
    def end(self) -> int:
        return self.start + (len(self.tokens) >> 2)

    @property
    def truncatable(self) -> bool:
        return bool(self.flags & TRUNCATABLE)

    @property
    def snapshot(self) -> bool:
        return bool(self.flags & SNAPSHOT)

    @property
    def persisted(self) -> bool:
        return bool(self.flags & PERSISTED)

    def restorable_at_end(self) -> bool:
        return bool(self.flags & (TRUNCATABLE | SNAPSHOT))

    def add_session(self, session_id: str) -> bool:
        """Record a session; True if it was new."""
        if session_id in self.sessions:
            return False
        self.sessions = (*self.sessions, session_id)
        return True

    def add_agent(self, agent_id: str) -> bool:
        """Record an agent (at most ``MAX_AGENTS_PER_BLOCK``); True if it was new."""
        if agent_id in self.agents or len(self.agents) >= MAX_AGENTS_PER_BLOCK:
            return False
        self.agents = (*self.agents, agent_id)
        return True

    def meta(self) -> BlockMeta:
        if self.block_hash is None:
            raise InvariantError(f"block {self!r} is private and has no hash")
        return BlockMeta(
            block_hash=self.block_hash,
            parent_hash=self.parent_hash,
            token_ids=unpack_tokens(self.tokens),
            start=self.start,
            extra_keys=self.extra_keys,
            nbytes=self.nbytes,
            truncatable=self.truncatable,
            snapshot=self.snapshot,
            namespace_key=self.ns.key,
            tenant=self.ns.tenant,
        )

    def __repr__(self) -> str:
        return (
            f"Block({self.block_hash.hex()[:12] if self.block_hash is not None else 'private'}, "
            f"start={self.start}, n={self.num_tokens}, "
            f"ref={self.ref_cnt}, nbytes={self.nbytes})"
        )
