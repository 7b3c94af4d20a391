"""The SSD tier's write path: ``put`` (never waits unless asked to), the writer
thread, and the crash-safe, multi-process-safe write of one block.

One write: encode the payload (here, on the writer thread) -> temp file in the
destination folder -> fsync -> publish under a name no one else holds
(``ssd_files.publish``: never replaces a file) -> fsync folder -> commit the index
row (in one transaction that also re-reads the row, so a concurrent writer of the
same block in another process is seen) -> remove the file the replaced row named.
Publishing and committing hold the folder's shared ``DirLock``, so a repair in any
process (exclusive) never sees a published file without its row. After a crash,
every row names a complete file; reconcile removes what a crash left behind.
"""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from collections.abc import Iterable

from ..codec import checksum
from ..errors import TierError
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from . import ssd_files as files
from .base import PayloadSource, as_source
from .ssd_index import IndexRow
from .ssd_store import SSDStore, _Pending, tier_errors

log = logging.getLogger(__name__)

STOP = object()
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class SSDWriter(SSDStore):
    """The write half of ``SSDTier`` (see the module docstring)."""

    _sweep_interval: float
    _closed: bool

    @tier_errors
    def put(
        self,
        meta: BlockMeta,
        payload: bytes | PayloadSource,
        sessions: Iterable[str] = (),
        hits: int | None = None,
        *,
        timeout: float | None = 0.0,
    ) -> bool:
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
        cfg = self.config
        h = bytes(meta.block_hash)
        with self._lock:
            reason = None
            if self._closed:
                reason = "closed"
            elif self._mode != "read_write":
                reason = self._mode
            elif meta.end < cfg.admission_min_tokens or (hits or 0) < cfg.admission_min_hits:
                reason = "admission"
            elif nbytes > self.budget():
                reason = "budget"
            elif self._degraded_reason is not None and self._clock() < self._retry_at:
                reason = "degraded"
            elif cfg.daily_write_budget_bytes is not None and (
                self._today_bytes() + self._pending_bytes + nbytes
                > cfg.daily_write_budget_bytes
            ):
                reason = "write_budget"
            if reason is not None:
                self._drops[reason] += 1
                return False
            p = self._pending.get(h)
            if p is not None and p.queued and not p.taken and not p.cancelled:
                self._pending_bytes += nbytes - p.nbytes
                p.meta, p.source, p.nbytes = meta, source, nbytes
                p.sessions |= sess
                p.had_session = p.had_session or bool(sess)
                return True
            item = _Pending(meta, source, nbytes, set(sess), bool(sess))
            # (the writer takes the lock before it looks at an item: queuing first is safe)
            item.queued = self._queue.put(item, 0.0)
            if not item.queued and timeout is not None and timeout <= 0:
                self._drops["queue_full"] += 1
                return False
            if p is not None:  # an older version (being written, or waiting): superseded
                item.sessions |= p.sessions
                item.had_session = item.had_session or p.had_session
                if not p.taken:
                    p.cancelled = True
                self._forget(p)
            self._pending[h] = item  # visible to get_meta / children / get from now on
            self._pending_bytes += nbytes
            if item.queued:
                return True
        # back-pressure: wait for room outside the lock (the writer needs it)
        queued = self._queue.put(item, timeout)
        with self._lock:
            if queued:
                item.queued = True
                return True
            if item.cancelled:  # superseded or deleted while waiting: nothing to write
                return True
            self._forget(item)
            self._drops["queue_full"] += 1
            return False

    @tier_errors
    def has_room(self, timeout: float | None = 0.0) -> bool:
        """True if a put that does not wait would find room in the write queue."""
        return self._queue.wait_for_room(timeout)

    @tier_errors
    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        if isinstance(sessions, str):
            raise ValueError("sessions must be an iterable of session ids, not a string")
        sess = {str(s) for s in sessions}
        if not sess or not self._writable():
            return
        h = bytes(block_hash)
        with self._lock:
            p = self._pending.get(h)
            if p is not None and not p.cancelled:
                p.sessions |= sess
                p.had_session = True
                if not p.taken:
                    return
            try:
                self._index.begin()
                self._index.add_sessions(h, sess)
                self._index.commit()
            except sqlite3.Error as e:
                self._index.rollback()
                self._index_error(e)
                raise TierError(f"ssd add_sessions failed: {e}") from e

    def _run(self) -> None:
        while True:
            got, item = self._queue.get(timeout=max(0.05, self._sweep_interval / 4))
            if item is STOP:
                self._queue.task_done()
                return
            try:
                if item is not None:
                    self._write(item)
                if time.monotonic() - self._last_sweep >= self._sweep_interval:
                    self.sweep()
            except Exception:  # the writer must survive anything
                log.exception("ssd writer: unexpected error")
                if isinstance(item, _Pending):
                    with self._lock:
                        self._counts["write_errors"] += 1
                        self._forget(item)
            finally:
                if got:
                    self._queue.task_done()

    def _drop(self, p: _Pending, reason: str | None = None, counter: str | None = None) -> None:
        with self._lock:
            if reason is not None:
                self._drops[reason] += 1
            if counter is not None:
                self._counts[counter] += 1
            self._forget(p)

    def _write(self, p: _Pending) -> None:
        h = bytes(p.meta.block_hash)
        with self._write_lock:
            with self._lock:
                if p.cancelled:
                    self._forget(p)
                    return
                p.taken = True
                if self._degraded_reason is not None and self._clock() < self._retry_at:
                    self._drops["degraded"] += 1
                    self._forget(p)
                    return
                self._apply_touches()
            try:  # the encoding happens here, on the writer thread
                data = p.source.encode()
            except Exception as e:
                log.warning("ssd block %s: cannot encode the payload: %s", h.hex()[:16], e)
                self._drop(p, counter="encode_errors")
                return
            if len(data) > self.budget():
                self._drop(p, reason="budget")
                return
            digest = checksum(data)
            for attempt in (0, 1):
                try:
                    with self._lock:
                        existing = self._index.get(h)
                    if existing is not None and existing.checksum == digest:
                        with self._dirlock.shared():  # the same bytes are stored: sessions only
                            if self._commit(p, len(data), existing.file_name, digest, dedup=True):
                                return
                    primary = files.block_rel_path(p.meta.namespace_key, p.meta.tenant, h.hex())
                    folder = self.root / primary.rsplit("/", 1)[0]
                    tmp = files.write_temp(folder, h.hex() + files.SUFFIX, data,
                                           fsync=self.config.fsync)
                    with self._dirlock.shared():
                        name = files.publish(tmp, files.block_names(h.hex()),
                                             fsync=self.config.fsync)
                        rel = primary.rsplit("/", 1)[0] + "/" + name
                        self._commit(p, len(data), rel, digest, dedup=False)
                except sqlite3.Error as e:
                    with self._lock:
                        self._index_error(e)
                        self._forget(p)
                    return
                except OSError as e:
                    if attempt == 0 and e.errno in _DISK_FULL and self._make_room(h, len(data)):
                        continue  # the disk filled up (from outside): room made, once more
                    self._drop(p, reason="degraded", counter="write_errors")
                    self._degrade(f"write failed: {e}")
                    return
                break
            self._enforce_capacity(keep=h)

    def _make_room(self, keep: bytes, need: int) -> bool:
        """A write found the disk full (ENOSPC / EDQUOT, counted ``disk_full``): re-read
        the disk's free space (the budget in use shrinks to what the disk holds) and,
        if the disk really lacks the bytes, evict least recently used blocks until this
        block's ``need`` bytes fit (``evictions_disk``). True if something was evicted
        (worth one more try); False leaves the tier to degrade as for any write error."""
        with self._lock:
            self._counts["disk_full"] += 1
            try:
                self._blocks, self._bytes = self._index.totals()
            except sqlite3.Error as e:
                self._index_error(e)
                return False
            self._refresh_disk_cap()
            free = self._disk_free
            if free is None or free >= need + self._disk_reserve:
                return False  # the disk has the bytes (inodes, quota?): evicting won't help
            target = max(0, min(self.budget(), self._bytes - need))
        evicted = self._enforce_capacity(keep=keep, budget=target)
        log.warning("ssd disk full: %d block(s) evicted to make room for %d bytes",
                    evicted, need)
        return evicted > 0

    def _commit(self, p: _Pending, size: int, rel: str, digest: str, *, dedup: bool) -> bool:
        """Commit the row of a published file ``rel`` (or, ``dedup``, of the file the
        current row already names). The row is re-read inside the transaction: a
        dedup whose row changed meanwhile (another process) returns False (the caller
        writes the file after all); a new file replaces whatever row is there and
        the file that row named is removed after the commit. Caller holds the
        shared ``DirLock``. Raises nothing but what the caller handles (no: never)."""
        h = bytes(p.meta.block_hash)
        now = self._clock()
        ttl = self.config.ttl_seconds
        with self._lock:
            if p.cancelled:
                self._forget(p)
                if not dedup:
                    files.remove_file(self.root / rel)
                return True
            try:
                self._index.begin()
                cur = self._index.get(h)
                if dedup and (cur is None or cur.file_name != rel or cur.checksum != digest):
                    self._index.rollback()
                    return False
                row = IndexRow(
                    meta=p.meta,
                    file_name=rel,
                    file_bytes=size,
                    checksum=digest,
                    created=cur.created if cur is not None else now,
                    last_access=now,
                    expiry=None if ttl is None else now + ttl,
                    hits=cur.hits if cur is not None else 0,
                    had_session=p.had_session or (cur is not None and cur.had_session),
                )
                self._index.upsert(row)
                pin = max(self._pins.get(h, 0.0),
                          cur.pinned_until if cur is not None and cur.pinned_until else 0.0)
                if pin > now:  # a pin asked before the row existed, or the row's own
                    self._index.pin([h], pin)
                self._index.add_sessions(h, p.sessions)
                if not dedup:
                    self._bytes_written, self._day_bytes = self._index.add_written(
                        size, self._today())
                    self._day = self._today()
                self._index.commit()
            except sqlite3.Error as e:
                self._index.rollback()
                self._index_error(e)
                self._forget(p)
                if not dedup:
                    files.remove_file(self.root / rel)
                return True
            self._forget(p)
            self._pins.pop(h, None)
            self._blocks, self._bytes = self._index.totals()
            self._counts["dedup" if dedup else "spills"] += 1
            if self._degraded_reason is not None and self._retry_at != float("inf"):
                log.info("ssd tier recovered (was: %s)", self._degraded_reason)
                self._degraded_reason = None
            replaced = cur.file_name if cur is not None and cur.file_name != rel else None
        if replaced is not None:  # still under the shared DirLock: no repair in between
            try:
                files.remove_file(self.root / replaced)
            except OSError as e:  # left for reconcile as an orphan
                log.warning("cannot remove %s: %s", replaced, e)
        return True
