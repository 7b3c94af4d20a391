"""The Redis tier's write queue. A queued put is *pending* until sent: reads answer from it, a newer
put supersedes it, a deletion cancels it. ``put(timeout=0)`` never waits."""

from __future__ import annotations

import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..config import RedisConfig
from ..meta import BlockMeta, Namespace
from .base import PayloadSource, as_source

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


class WriteQueue:
    """The bounded queue, the pending puts and the drop counters, under the tier's ``lock``."""

    def __init__(self, config: RedisConfig, lock: threading.RLock,
                 healthy: Callable[[], bool]) -> None:
        self.config = config
        self.lock = lock
        self.healthy = healthy
        self.queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self.pending: dict[bytes, Put] = {}  # queued puts by hash (under lock)
        self.drops: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self.closed = False

    def close(self) -> bool:
        """Refuse new items from now on; False if already closed."""
        with self.lock:
            was, self.closed = self.closed, True
        return not was

    def drop(self, reason: str, n: int = 1) -> None:
        with self.lock:
            self.drops[reason] += n

    def pending_for(self, h: bytes, ns: Namespace) -> Put | None:
        """The live pending put of ``h`` in namespace ``ns`` (caller holds ``lock``)."""
        p = self.pending.get(h)
        if p is None or p.cancelled or p.meta.namespace_key != ns.key or p.meta.tenant != ns.tenant:
            return None
        return p

    def put(self, meta: BlockMeta, payload: bytes | PayloadSource,
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
        with self.lock:
            reason = None
            if self.closed:
                reason = "closed"
            elif source.nbytes > self.config.max_value_bytes:
                reason = "too_large"
            elif not self.healthy():
                reason = "circuit_open"
            if reason is not None:
                self.drops[reason] += 1
                return False
            old = self.pending.get(h)
            self.pending[h] = item  # before it is queued: the writer forgets it
            try:
                self.queue.put_nowait(item)
                queued = True
            except queue.Full:
                queued = False
        if not queued and timeout != 0:
            try:
                self.queue.put(item, timeout=timeout)
                queued = True
            except queue.Full:
                pass
        with self.lock:
            if not queued and item.cancelled:  # deleted while waiting: nothing to write
                return True
            if not queued:
                self.forget(item)
                if old is not None and self.pending.get(h) is None and not old.cancelled:
                    self.pending[h] = old
                self.drops["queue_full"] += 1
                return False
            if old is not None and old is not item:  # superseded: keep its sessions
                old.cancelled = True
                item.sessions |= old.sessions
                item.had_session = item.had_session or old.had_session
            return True

    def has_room(self, timeout: float | None) -> bool:
        q = self.queue
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with q.not_full:
            while q.maxsize > 0 and len(q.queue) >= q.maxsize:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                q.not_full.wait(remaining)
            return True

    def add_sessions(self, h: bytes, sessions: Iterable[str], ns: Namespace | None) -> None:
        if isinstance(sessions, str):
            raise ValueError("sessions must be an iterable of session ids, not a string")
        sess = {str(s) for s in sessions}
        if not sess or ns is None:
            return
        with self.lock:
            p = self.pending_for(h, ns)
            if p is not None:
                p.sessions |= sess
                p.had_session = True
                return
            if self.closed:
                return
            try:
                self.queue.put_nowait(Sessions(h, ns.tenant, ns.key, sess))
            except queue.Full:
                self.drops["queue_full"] += 1

    def discard(self, hashes: Iterable[bytes], ns: Namespace | None) -> int:
        if ns is None:
            return 0
        n = 0
        with self.lock:
            for h in hashes:
                p = self.pending_for(h, ns)
                if p is not None:
                    p.cancelled = True
                    del self.pending[h]
                if self.closed:
                    continue
                try:
                    self.queue.put_nowait(Discard(h, ns.tenant, ns.key))
                    n += 1
                except queue.Full:
                    self.drops["queue_full"] += 1
        return n

    def forget(self, item: Put) -> None:
        """Drop ``item`` from the pending puts if still current; the caller holds ``lock``."""
        h = bytes(item.meta.block_hash)
        if self.pending.get(h) is item:
            del self.pending[h]

    def flush(self, timeout: float | None) -> bool:
        q = self.queue
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        with q.all_tasks_done:
            while q.unfinished_tasks:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                q.all_tasks_done.wait(remaining)
        return True
