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

Blocks queued together (up to ``BATCH_MAX``: a shutdown's persist, a burst of
demotions) are written together (``Writer._write_batch``) in the same order of
steps: files encoded, written and fsynced by ``IO_THREADS`` threads, published,
their folders fsynced once each, then every row in one transaction. A clean
shutdown then runs at the disk's speed instead of paying three serial fsyncs a block
(bench/bench_shutdown.py).
"""

from __future__ import annotations

import errno
import logging
import sqlite3
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..codec import checksum
from ..errors import InvariantError, TierError
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from . import ssd_files as files
from .base import PayloadSource, as_source
from .ssd_queue import WriteQueue
from .ssd_schema import IndexRow
from .ssd_store import Pending, SSDState

log = logging.getLogger(__name__)

STOP = object()
BATCH_MAX = 16  # queued blocks written together (see ``Writer._write_batch``)
BATCH_MAX_BYTES = 128 << 20  # ... and their bytes (a batch's blocks stay encoded until its commit)
IO_THREADS = 4  # files encoded, written and fsynced at once within a batch
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class Writer:
    """The write half of ``SSDTier`` (see the module docstring) over its ``SSDState``:
    ``put`` queues on ``queue``; ``run`` is the writer thread, which calls
    ``maintain`` (the periodic sweep) at least every ``poll_s`` seconds."""

    def __init__(self, st: SSDState, queue: WriteQueue, *, maintain: Callable[[], object],
                 poll_s: float) -> None:
        self.st = st
        self.queue = queue
        self.maintain = maintain
        self.poll_s = poll_s
        self._pool: ThreadPoolExecutor | None = None

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
        cfg = self.st.config
        h = bytes(meta.block_hash)
        with self.st.lock:
            reason = None
            if self.st.closed:
                reason = "closed"
            elif self.st.mode != "read_write":
                reason = self.st.mode
            elif meta.end < cfg.admission_min_tokens or (hits or 0) < cfg.admission_min_hits:
                reason = "admission"
            elif nbytes > self.st.budget():
                reason = "budget"
            elif self.st.degraded_reason is not None and self.st.clock() < self.st.retry_at:
                reason = "degraded"
            elif cfg.daily_write_budget_bytes is not None and (
                self.st.today_bytes() + self.st.pending_bytes + nbytes
                > cfg.daily_write_budget_bytes
            ):
                reason = "write_budget"
            if reason is not None:
                self.st.drops[reason] += 1
                return False
            p = self.st.pending.get(h)
            if p is not None and p.queued and not p.taken and not p.cancelled:
                self.st.pending_bytes += nbytes - p.nbytes
                p.meta, p.source, p.nbytes = meta, source, nbytes
                p.sessions |= sess
                p.had_session = p.had_session or bool(sess)
                return True
            item = Pending(meta, source, nbytes, set(sess), bool(sess))
            # (the writer takes the lock before it looks at an item: queuing first is safe)
            item.queued = self.queue.put(item, 0.0)
            if not item.queued and timeout is not None and timeout <= 0:
                self.st.drops["queue_full"] += 1
                return False
            if p is not None:  # an older version (being written, or waiting): superseded
                item.sessions |= p.sessions
                item.had_session = item.had_session or p.had_session
                if not p.taken:
                    p.cancelled = True
                self.st.forget(p)
            self.st.pending[h] = item  # visible to get_meta / children / get from now on
            self.st.pending_bytes += nbytes
            if item.queued:
                return True
        # back-pressure: wait for room outside the lock (the writer needs it)
        queued = self.queue.put(item, timeout)
        with self.st.lock:
            if queued:
                item.queued = True
                return True
            if item.cancelled:  # superseded or deleted while waiting: nothing to write
                return True
            self.st.forget(item)
            self.st.drops["queue_full"] += 1
            return False

    def has_room(self, timeout: float | None = 0.0) -> bool:
        """True if a put that does not wait would find room in the write queue."""
        return self.queue.wait_for_room(timeout)

    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        if isinstance(sessions, str):
            raise ValueError("sessions must be an iterable of session ids, not a string")
        sess = {str(s) for s in sessions}
        if not sess or not self.st.writable():
            return
        h = bytes(block_hash)
        with self.st.lock:
            p = self.st.pending.get(h)
            if p is not None and not p.cancelled:
                p.sessions |= sess
                p.had_session = True
                if not p.taken:
                    return
            try:
                self.st.index.begin()
                self.st.index.add_sessions(h, sess)
                self.st.index.commit()
            except sqlite3.Error as e:
                self.st.index.rollback()
                self.st.index_error(e)
                raise TierError(f"ssd add_sessions failed: {e}") from e

    def run(self) -> None:
        while True:
            got, item = self.queue.get(timeout=self.poll_s)
            if item is STOP:
                self.queue.task_done()
                return
            batch = [item] if isinstance(item, Pending) else []
            size = item.nbytes if isinstance(item, Pending) else 0
            stop = False
            while batch and len(batch) < BATCH_MAX and size < BATCH_MAX_BYTES:
                # what else is queued joins the write
                more, nxt = self.queue.get(timeout=0)
                if not more:
                    break
                if nxt is STOP:
                    stop = True
                    break
                batch.append(nxt)
                size += nxt.nbytes
            try:
                if len(batch) == 1:
                    self._write(batch[0])
                elif batch:
                    self._write_batch(batch)
                self.maintain()
            except Exception:  # the writer must survive anything
                log.exception("ssd writer: unexpected error")
                with self.st.lock:
                    for p in batch:
                        if self.st.pending.get(bytes(p.meta.block_hash)) is p:
                            self.st.counts["write_errors"] += 1
                            self.st.forget(p)
            finally:
                for _ in range(len(batch) if batch else int(got)):
                    self.queue.task_done()
            if stop:
                self.queue.task_done()
                return

    def close(self) -> None:
        """Stop the I/O threads (after the writer thread has stopped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _io(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=IO_THREADS,
                                            thread_name_prefix="promptcache-ssd-io")
        return self._pool

    def _write_batch(self, batch: list[Pending]) -> None:
        """Write several queued blocks together (a shutdown's persist, a burst of
        demotions) with the guarantees of ``_write``: every file is written and fsynced
        (``IO_THREADS`` at a time), published, and its folder fsynced (each folder once)
        before the one transaction that commits all their rows; a crash at any point
        leaves either every row of the batch or none, and never a row without its
        complete file. A block the index already has (a rewrite, a dedup), and every
        block of a batch that meets a write error, goes through ``_write`` alone."""
        with self.st.write_lock:
            todo: list[Pending] = []
            with self.st.lock:
                for p in batch:
                    if p.cancelled:
                        self.st.forget(p)
                        continue
                    p.taken = True
                    if (self.st.degraded_reason is not None
                            and self.st.clock() < self.st.retry_at):
                        self.st.drops["degraded"] += 1
                        self.st.forget(p)
                        continue
                    todo.append(p)
                self.st.apply_touches()
            fresh: list[Pending] = []
            alone: list[Pending] = []
            try:
                with self.st.lock:
                    for p in todo:
                        if self.st.index.get(bytes(p.meta.block_hash)) is None:
                            fresh.append(p)
                        else:
                            alone.append(p)
            except sqlite3.Error as e:
                with self.st.lock:
                    self.st.index_error(e)
                    for p in todo:
                        self.st.forget(p)
                return
            if fresh:
                alone.extend(self._write_fresh(fresh))
        for p in alone:
            self._write(p)

    def _prepare(self, p: Pending) -> tuple[Pending, bytes, str] | None:
        """Encode and checksum; None: dropped and counted."""
        try:
            data = p.source.encode()
        except Exception as e:
            log.warning("ssd block %s: cannot encode the payload: %s",
                        bytes(p.meta.block_hash).hex()[:16], e)
            self._drop(p, counter="encode_errors")
            return None
        if len(data) > self.st.budget():
            self._drop(p, reason="budget")
            return None
        return p, data, checksum(data)

    def _temp_file(self, p: Pending) -> tuple[int, str, Path] | None:
        """Encode (memoised), checksum, write and fsync the temp file of a block (an I/O
        thread: one block's encoding overlaps another's disk write). Returns (size,
        checksum, temp file); None: dropped and counted; raises OSError."""
        prepared = self._prepare(p)
        if prepared is None:
            return None
        _, data, digest = prepared
        h = bytes(p.meta.block_hash).hex()
        rel = files.block_rel_path(p.meta.namespace_key, p.meta.tenant, h)
        tmp = files.write_temp(self.st.root / rel.rsplit("/", 1)[0], h + files.SUFFIX, data,
                               fsync=self.st.config.fsync)
        return len(data), digest, tmp

    def _write_fresh(self, fresh: list[Pending]) -> list[Pending]:
        """Files, then rows, of blocks the index lacked (see ``_write_batch``). Returns
        the blocks to write alone (a write error: each meets it again by itself, and
        the disk-full and degraded rules of ``_write`` apply)."""
        futures = [self._io().submit(self._temp_file, p) for p in fresh]
        written: list[tuple[Pending, int, str]] = []
        tmps: list[Path | None] = []
        retry: list[Pending] = []
        error: OSError | None = None
        for p, f in zip(fresh, futures, strict=True):
            try:
                r = f.result()
            except OSError as e:
                error = error or e
                retry.append(p)
                continue
            if r is not None:
                written.append((p, r[0], r[1]))
                tmps.append(r[2])
        published: list[tuple[Pending, int, str, str]] = []
        try:
            if error is not None:
                raise error
            with self.st.dirlock.shared():
                for i, (p, size, digest) in enumerate(written):
                    tmp = tmps[i]
                    if tmp is None:
                        raise InvariantError(f"ssd batch: block {i} has no temp file to publish")
                    name = files.publish(tmp, files.block_names(bytes(p.meta.block_hash).hex()),
                                         fsync=False)
                    tmps[i] = None
                    folder = str(tmp.parent.relative_to(self.st.root))
                    published.append((p, size, folder + "/" + name, digest))
                if self.st.config.fsync:
                    folders = {self.st.root / rel.rsplit("/", 1)[0] for _, _, rel, _ in published}
                    list(self._io().map(files.fsync_dir, sorted(folders)))
                self._commit_many(published, dedup=False, evict=True)
                published = []
        except OSError as e:
            leftovers = [t for t in tmps if t is not None]
            leftovers += [self.st.root / rel for _, _, rel, _ in published]  # no row yet
            for path in leftovers:
                try:
                    files.remove_file(path)
                except OSError as err:  # left for reconcile (a temp, or an orphan)
                    log.warning("cannot remove %s: %s", path, err)
            retry += [p for p, _, _ in written]
            log.info("ssd batch write failed (%s): writing its %d block(s) one by one", e,
                     len(retry))
            return [p for p in fresh if p in retry]
        if written:
            self.st.enforce_capacity(keep=bytes(written[-1][0].meta.block_hash))
        return []

    def _drop(self, p: Pending, reason: str | None = None, counter: str | None = None) -> None:
        with self.st.lock:
            if reason is not None:
                self.st.drops[reason] += 1
            if counter is not None:
                self.st.counts[counter] += 1
            self.st.forget(p)

    def _write(self, p: Pending) -> None:
        h = bytes(p.meta.block_hash)
        with self.st.write_lock:
            with self.st.lock:
                if p.cancelled:
                    self.st.forget(p)
                    return
                p.taken = True
                if self.st.degraded_reason is not None and self.st.clock() < self.st.retry_at:
                    self.st.drops["degraded"] += 1
                    self.st.forget(p)
                    return
                self.st.apply_touches()
            try:  # the encoding happens here, on the writer thread
                data = p.source.encode()
            except Exception as e:
                log.warning("ssd block %s: cannot encode the payload: %s", h.hex()[:16], e)
                self._drop(p, counter="encode_errors")
                return
            if len(data) > self.st.budget():
                self._drop(p, reason="budget")
                return
            digest = checksum(data)
            for attempt in (0, 1):
                try:
                    with self.st.lock:
                        existing = self.st.index.get(h)
                    if existing is not None and existing.checksum == digest:
                        with self.st.dirlock.shared():  # the same bytes are stored: sessions only
                            if self._commit(p, len(data), existing.file_name, digest, dedup=True):
                                return
                    primary = files.block_rel_path(p.meta.namespace_key, p.meta.tenant, h.hex())
                    folder = self.st.root / primary.rsplit("/", 1)[0]
                    tmp = files.write_temp(folder, h.hex() + files.SUFFIX, data,
                                           fsync=self.st.config.fsync)
                    with self.st.dirlock.shared():
                        name = files.publish(tmp, files.block_names(h.hex()),
                                             fsync=self.st.config.fsync)
                        rel = primary.rsplit("/", 1)[0] + "/" + name
                        self._commit(p, len(data), rel, digest, dedup=False)
                except sqlite3.Error as e:
                    with self.st.lock:
                        self.st.index_error(e)
                        self.st.forget(p)
                    return
                except OSError as e:
                    if attempt == 0 and e.errno in _DISK_FULL and self.make_room(h, len(data)):
                        continue  # the disk filled up (from outside): room made, once more
                    self._drop(p, reason="degraded", counter="write_errors")
                    self.st.degrade(f"write failed: {e}")
                    return
                break
            self.st.enforce_capacity(keep=h)

    def make_room(self, keep: bytes, need: int) -> bool:
        """A write found the disk full (ENOSPC / EDQUOT, counted ``disk_full``): re-read
        the disk's free space (the budget in use shrinks to what the disk holds) and,
        if the disk really lacks the bytes, evict least recently used blocks until this
        block's ``need`` bytes fit (``evictions_disk``). True if something was evicted
        (worth one more try); False leaves the tier to degrade as for any write error."""
        with self.st.lock:
            self.st.counts["disk_full"] += 1
            try:
                self.st.blocks, self.st.bytes_stored = self.st.index.totals()
            except sqlite3.Error as e:
                self.st.index_error(e)
                return False
            self.st.refresh_disk_cap()
            free = self.st.disk_free
            if free is None or free >= need + self.st.disk_reserve:
                return False  # the disk has the bytes (inodes, quota?): evicting won't help
            target = max(0, min(self.st.budget(), self.st.bytes_stored - need))
        evicted = self.st.enforce_capacity(keep=keep, budget=target)
        log.warning("ssd disk full: %d block(s) evicted to make room for %d bytes",
                    evicted, need)
        return evicted > 0

    def _commit(self, p: Pending, size: int, rel: str, digest: str, *, dedup: bool) -> bool:
        """Commit the row of a published file ``rel`` (or, ``dedup``, of the file the
        current row already names). The row is re-read inside the transaction: a
        dedup whose row changed meanwhile (another process) returns False (the caller
        writes the file after all); a new file replaces whatever row is there and
        the file that row named is removed after the commit. Caller holds the
        shared ``DirLock``. Raises nothing but what the caller handles (no: never)."""
        return self._commit_many([(p, size, rel, digest)], dedup=dedup)

    def _commit_many(self, entries: list[tuple[Pending, int, str, str]], *,
                     dedup: bool, evict: bool = False) -> bool:
        """``_commit`` of several published files in one transaction (all rows or
        none); ``dedup`` with one entry only. ``evict``: the same transaction deletes
        the least recently used other blocks past the byte budget (their files are
        unlinked after it), so a crash right after a batch leaves the folder over its
        budget by no more than one block, as after a single write."""
        now = self.st.clock()
        ttl = self.st.config.ttl_seconds
        replaced: list[str] = []
        victims: list[tuple[bytes, str, int]] = []
        pinned = 0
        with self.st.lock:
            live = []
            for p, size, rel, digest in entries:
                if p.cancelled:
                    self.st.forget(p)
                    if not dedup:
                        files.remove_file(self.st.root / rel)
                else:
                    live.append((p, size, rel, digest))
            if not live:
                return True
            done: list[tuple[Pending, IndexRow | None, str]] = []
            try:
                self.st.index.begin()
                for p, size, rel, digest in live:
                    h = bytes(p.meta.block_hash)
                    cur = self.st.index.get(h)
                    if dedup and (cur is None or cur.file_name != rel or cur.checksum != digest):
                        self.st.index.rollback()
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
                    self.st.index.upsert(row)
                    pin = max(self.st.pins.get(h, 0.0),
                              cur.pinned_until if cur is not None and cur.pinned_until else 0.0)
                    if pin > now:  # a pin asked before the row existed, or the row's own
                        self.st.index.pin([h], pin)
                    self.st.index.add_sessions(h, p.sessions)
                    if not dedup:
                        self.st.bytes_written, self.st.day_bytes = self.st.index.add_written(
                            size, self.st.today())
                        self.st.day = self.st.today()
                    done.append((p, cur, rel))
                if evict:
                    keep = {bytes(p.meta.block_hash) for p, _, _ in done}
                    excess = self.st.index.totals()[1] - self.st.budget()
                    if excess > 0:
                        for h, old, size, is_pinned in self.st.index.lru(len(keep) + 256, now):
                            if excess <= 0:
                                break
                            if h not in keep:
                                victims.append((h, old, size))
                                excess -= size
                                pinned += is_pinned
                        self.st.index.delete(h for h, _, _ in victims)
                self.st.index.commit()
            except sqlite3.Error as e:
                self.st.index.rollback()
                self.st.index_error(e)
                for p, _, rel, _ in live:
                    self.st.forget(p)
                    if not dedup:
                        files.remove_file(self.st.root / rel)
                return True
            for p, cur, rel in done:
                self.st.forget(p)
                self.st.pins.pop(bytes(p.meta.block_hash), None)
                self.st.counts["dedup" if dedup else "spills"] += 1
                if cur is not None and cur.file_name != rel:
                    replaced.append(cur.file_name)
            if victims:
                self.st.counts["evictions_capacity"
                               if self.st.budget() >= self.st.config.budget_bytes
                               else "evictions_disk"] += len(victims)
                self.st.counts["evictions_pinned"] += pinned
                replaced.extend(rel for _, rel, _ in victims)
            self.st.blocks, self.st.bytes_stored = self.st.index.totals()
            if self.st.degraded_reason is not None and self.st.retry_at != float("inf"):
                log.info("ssd tier recovered (was: %s)", self.st.degraded_reason)
                self.st.degraded_reason = None
        for old in replaced:  # still under the shared DirLock: no repair in between
            try:
                files.remove_file(self.st.root / old)
            except OSError as e:  # left for reconcile as an orphan
                log.warning("cannot remove %s: %s", old, e)
        return True
