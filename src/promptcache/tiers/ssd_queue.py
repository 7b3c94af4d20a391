"""The SSD tier's blocks accepted and not written yet: ``Queued`` (the pending map,
``put``'s admission rules, the drop counters) over a bounded ``WriteQueue`` whose
waits all take a timeout (0: never wait, None: as long as it takes), so a put can
refuse at once on the request path, or apply back-pressure at shutdown."""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..meta import BlockMeta
from . import ssd_files as files
from .base import PayloadSource, as_source
from .ssd_store import Catalog, Status

DROP_REASONS = ("queue_full", "budget", "admission", "degraded", "write_budget", "closed",
                "read_only", "off")


def _wait(cond: threading.Condition, ready: Callable[[], bool], timeout: float | None) -> bool:
    if ready():
        return True
    if timeout is not None and timeout <= 0:
        return False
    return cond.wait_for(ready, timeout)


class WriteQueue:
    """Bounded FIFO with ``task_done`` accounting (like ``queue.Queue``) plus
    ``wait_for_room`` and a ``join`` with a timeout."""

    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._items: deque[Any] = deque()
        self._cond = threading.Condition()
        self._unfinished = 0

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)

    def _has_room(self) -> bool:
        return len(self._items) < self.maxsize

    def put(self, item: Any, timeout: float | None = 0.0, *, force: bool = False) -> bool:
        """Append ``item`` if there is room (waiting up to ``timeout``); ``force``
        appends regardless of the bound (the stop marker). False if still full."""
        with self._cond:
            if not force and not _wait(self._cond, self._has_room, timeout):
                return False
            self._items.append(item)
            self._unfinished += 1
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None) -> tuple[bool, Any]:
        """``(True, item)``, or ``(False, None)`` if nothing came within ``timeout``."""
        with self._cond:
            if not _wait(self._cond, lambda: bool(self._items), timeout):
                return False, None
            item = self._items.popleft()
            self._cond.notify_all()
            return True, item

    def task_done(self) -> None:
        with self._cond:
            if self._unfinished <= 0:
                raise ValueError("task_done() called more times than there were items")
            self._unfinished -= 1
            self._cond.notify_all()

    def wait_for_room(self, timeout: float | None = 0.0) -> bool:
        with self._cond:
            return _wait(self._cond, self._has_room, timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait until every item put was processed (``task_done``). False on timeout."""
        with self._cond:
            return _wait(self._cond, lambda: self._unfinished == 0, timeout)


@dataclass(eq=False)
class Pending:
    """A block accepted by ``put`` and not written yet. ``source`` is encoded by the
    writer thread; ``nbytes`` is its size estimate until then."""

    meta: BlockMeta
    source: PayloadSource
    nbytes: int
    sessions: set[str] = field(default_factory=set)
    had_session: bool = False
    queued: bool = False  # in the write queue (False: a put is waiting for room)
    taken: bool = False  # the writer is writing it
    cancelled: bool = False


class Queued:
    """The pending blocks (visible to reads from ``put`` on) and the write queue; the
    status lock guards the map."""

    def __init__(self, status: Status, catalog: Catalog, queue_size: int) -> None:
        self.status, self.catalog = status, catalog
        self.queue = WriteQueue(queue_size)
        self.pending: dict[bytes, Pending] = {}
        self.bytes = 0
        self.drops: Counter[str] = Counter({r: 0 for r in DROP_REASONS})

    def find(self, h: bytes) -> Pending | None:
        p = self.pending.get(h)
        return p if p is not None and not p.cancelled else None

    def forget(self, p: Pending) -> None:
        h = bytes(p.meta.block_hash)
        if self.pending.get(h) is p:
            del self.pending[h]
            self.bytes -= p.nbytes

    def drop(self, p: Pending, reason: str | None = None, counter: str | None = None) -> None:
        with self.status.lock:
            if reason is not None:
                self.drops[reason] += 1
            if counter is not None:
                self.status.counts[counter] += 1
            self.forget(p)

    def cancel(self, match: Callable[[Pending], bool]) -> set[bytes]:
        out = set()
        for h, p in list(self.pending.items()):
            if not p.cancelled and match(p):
                p.cancelled = True
                self.catalog.pins.pop(h, None)
                out.add(h)
                if not p.taken:
                    self.forget(p)
        return out

    def _refusal(self, meta: BlockMeta, nbytes: int, hits: int | None) -> str | None:
        st, cfg = self.status, self.catalog.config
        if st.closed:
            return "closed"
        if st.mode != "read_write":
            return st.mode
        if meta.end < cfg.admission_min_tokens or (hits or 0) < cfg.admission_min_hits:
            return "admission"
        if nbytes > self.catalog.budget():
            return "budget"
        if st.backing_off():
            return "degraded"
        if cfg.daily_write_budget_bytes is not None and (
                self.catalog.today_bytes() + self.bytes + nbytes > cfg.daily_write_budget_bytes):
            return "write_budget"
        return None

    def put(self, meta: BlockMeta, payload: Any, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        if not isinstance(meta, BlockMeta):
            raise ValueError(f"meta must be a BlockMeta, got {type(meta).__name__}")
        if len(meta.block_hash) != 32 or len(meta.parent_hash) != 32:
            raise ValueError("block and parent hashes must be 32 bytes")
        source = as_source(payload)  # ValueError for anything else
        if isinstance(sessions, str):
            raise ValueError("sessions must be an iterable of session ids, not a string")
        files.block_rel_path(meta.namespace_key, meta.tenant, "00")  # validates folder names
        nbytes = source.nbytes
        sess = {str(s) for s in sessions}
        h = bytes(meta.block_hash)
        with self.status.lock:
            reason = self._refusal(meta, nbytes, hits)
            if reason is not None:
                self.drops[reason] += 1
                return False
            p = self.pending.get(h)
            if p is not None and p.queued and not p.taken and not p.cancelled:
                self.bytes += nbytes - p.nbytes
                p.meta, p.source, p.nbytes = meta, source, nbytes
                p.sessions |= sess
                p.had_session = p.had_session or bool(sess)
                return True
            item = Pending(meta, source, nbytes, set(sess), bool(sess))
            # (the writer takes the lock before it looks at an item: queuing first is safe)
            item.queued = self.queue.put(item, 0.0)
            if not item.queued and timeout is not None and timeout <= 0:
                self.drops["queue_full"] += 1
                return False
            if p is not None:  # an older version (being written, or waiting): superseded
                item.sessions |= p.sessions
                item.had_session = item.had_session or p.had_session
                if not p.taken:
                    p.cancelled = True
                self.forget(p)
            self.pending[h] = item  # visible to get_meta / children / get from now on
            self.bytes += nbytes
            if item.queued:
                return True
        # back-pressure: wait for room outside the lock (the writer needs it)
        queued = self.queue.put(item, timeout)
        with self.status.lock:
            if queued:
                item.queued = True
                return True
            if item.cancelled:  # superseded or deleted while waiting: nothing to write
                return True
            self.forget(item)
            self.drops["queue_full"] += 1
            return False
