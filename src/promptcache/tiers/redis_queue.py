"""The Redis tier's write queue: what is queued and how (the request path's side).

Writes are asynchronous: a bounded queue drained by one writer thread that pipelines
whole batches (``redis_writes``). A queued put is *pending* (``tier._pending``,
by hash) until its batch was sent: reads answer from it, a newer put under the same
hash supersedes it (keeping its sessions), a deletion cancels it.

``put(..., timeout=0)`` (the request path) never waits: a full queue refuses it
(counted ``queue_full``; the cache keeps the block in RAM and offers it again when
``has_room``); a positive or None ``timeout`` waits for room (back-pressure). A closed
tier, an open circuit or an oversized block refuses the put (counted by reason).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..meta import BlockMeta, Namespace
from .base import PayloadSource, as_source

if TYPE_CHECKING:
    from .redis import RedisTier

STOP = object()  # the writer thread's end marker
DROP_REASONS = ("queue_full", "circuit_open", "too_large", "closed", "error", "encode")


@dataclass(eq=False)
class Put:
    """A block to write (with the sessions that wrote or reused it)."""

    meta: BlockMeta
    payload: PayloadSource  # encoded (memoised) on the writer thread
    sessions: set[str] = field(default_factory=set)
    had_session: bool = False
    cancelled: bool = False

    def data(self) -> bytes:
        return bytes(self.payload.encode())


@dataclass(eq=False)
class Sessions:
    """Sessions to record on a block already in Redis (if it still is)."""

    block_hash: bytes
    tenant: str
    ns_key: str
    sessions: set[str]


@dataclass(eq=False)
class Discard:
    """A block to delete."""

    block_hash: bytes
    tenant: str
    ns_key: str


def put(tier: RedisTier, meta: BlockMeta, payload: bytes | PayloadSource,
        sessions: Iterable[str], timeout: float | None) -> bool:
    if not isinstance(meta, BlockMeta):
        raise ValueError(f"meta must be a BlockMeta, got {type(meta).__name__}")
    if len(meta.block_hash) != 32 or len(meta.parent_hash) != 32:
        raise ValueError("block and parent hashes must be 32 bytes")
    if isinstance(payload, str):
        raise ValueError("payload must be bytes or a PayloadSource, got str")
    source = as_source(payload)  # ValueError for anything else
    if isinstance(sessions, str):
        raise ValueError("sessions must be an iterable of session ids, not a string")
    h = bytes(meta.block_hash)
    item = Put(meta, source, {str(s) for s in sessions})
    item.had_session = bool(item.sessions)
    with tier._lock:
        reason = None
        if tier._closed:
            reason = "closed"
        elif source.nbytes > tier.config.max_value_bytes:
            reason = "too_large"
        elif not tier.remote.healthy:
            reason = "circuit_open"
        if reason is not None:
            tier._drops[reason] += 1
            return False
        old = tier._pending.get(h)
        tier._pending[h] = item  # before it is queued: the writer forgets it
        try:
            tier._queue.put_nowait(item)
            queued = True
        except queue.Full:
            queued = False
    if not queued and timeout != 0:
        try:
            tier._queue.put(item, timeout=timeout)
            queued = True
        except queue.Full:
            pass
    with tier._lock:
        if not queued and item.cancelled:  # deleted while waiting: nothing to write
            return True
        if not queued:
            forget(tier, item)
            if old is not None and tier._pending.get(h) is None and not old.cancelled:
                tier._pending[h] = old
            tier._drops["queue_full"] += 1
            return False
        if old is not None and old is not item:  # superseded: keep its sessions
            old.cancelled = True
            item.sessions |= old.sessions
            item.had_session = item.had_session or old.had_session
        return True


def has_room(tier: RedisTier, timeout: float | None) -> bool:
    q = tier._queue
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    with q.not_full:
        while q.maxsize > 0 and q._qsize() >= q.maxsize:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            q.not_full.wait(remaining)
        return True


def add_sessions(tier: RedisTier, h: bytes, sessions: Iterable[str], ns: Namespace | None) -> None:
    if isinstance(sessions, str):
        raise ValueError("sessions must be an iterable of session ids, not a string")
    sess = {str(s) for s in sessions}
    if not sess or ns is None:
        return
    with tier._lock:
        p = tier._pending_for(h, ns)
        if p is not None:
            p.sessions |= sess
            p.had_session = True
            return
        if tier._closed:
            return
        try:
            tier._queue.put_nowait(Sessions(h, ns.tenant, ns.key, sess))
        except queue.Full:
            tier._drops["queue_full"] += 1


def discard(tier: RedisTier, hashes: Iterable[bytes], ns: Namespace | None) -> int:
    if ns is None:
        return 0
    n = 0
    with tier._lock:
        for h in hashes:
            p = tier._pending_for(h, ns)
            if p is not None:
                p.cancelled = True
                del tier._pending[h]
            if tier._closed:
                continue
            try:
                tier._queue.put_nowait(Discard(h, ns.tenant, ns.key))
                n += 1
            except queue.Full:
                tier._drops["queue_full"] += 1
    return n


def forget(tier: RedisTier, item: Put) -> None:
    """Drop ``item`` from the pending puts (if it is still the one for its hash);
    the caller holds ``tier._lock``."""
    h = bytes(item.meta.block_hash)
    if tier._pending.get(h) is item:
        del tier._pending[h]


def flush(tier: RedisTier, timeout: float | None) -> bool:
    q = tier._queue
    deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
    with q.all_tasks_done:
        while q.unfinished_tasks:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            q.all_tasks_done.wait(remaining)
    return True
