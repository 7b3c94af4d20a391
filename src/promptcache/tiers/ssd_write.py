"""The SSD tier's writer thread and the crash-safe, multi-process-safe write of a block: temp file
-> fsync -> publish under a free name -> fsync folder -> commit the row; blocks queued together
are written together (files in parallel, each folder fsynced once, one transaction)."""

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
from ..meta import Namespace
from . import ssd_files as files
from .ssd_commit import Committer
from .ssd_queue import Pending, Queued
from .ssd_segments import SegmentWriter
from .ssd_store import Catalog, Status

log = logging.getLogger(__name__)

STOP = object()
BATCH_MAX = 16  # queued blocks written together (see ``Writer._write_batch``)
BATCH_MAX_BYTES = 128 << 20  # ... and their bytes (a batch's blocks stay encoded until its commit)
IO_THREADS = 4  # files encoded, written and fsynced at once within a batch
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class Writer:
    """The writer thread (``run``) over the blocks ``queued``; it calls ``maintain``
    (the periodic sweep) at least every ``poll_s`` seconds."""

    def __init__(self, status: Status, cat: Catalog, queued: Queued, segs: SegmentWriter, *,
                 maintain: Callable[[], object], poll_s: float) -> None:
        self.status, self.cat, self.queued = status, cat, queued
        self.queue = queued.queue
        self.rows = Committer(status, cat, queued)
        self.segs = segs
        self.maintain = maintain
        self.poll_s = poll_s
        self._pool: ThreadPoolExecutor | None = None

    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        if isinstance(sessions, str):
            raise ValueError("sessions must be an iterable of session ids, not a string")
        sess = {str(s) for s in sessions}
        if not sess or not self.status.writable():
            return
        h = bytes(block_hash)
        with self.status.lock:
            p = self.queued.find(h)
            if p is not None:
                p.sessions |= sess
                p.had_session = True
                if not p.taken:
                    return
            try:
                self.cat.index.begin()
                self.cat.index.add_sessions(h, sess)
                self.cat.index.commit()
            except sqlite3.Error as e:
                self.cat.index.rollback()
                self.status.index_error(e)
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
                if batch and self.cat.config.segment_bytes > 0:
                    self._write_segments(batch)
                elif len(batch) == 1:
                    self._write(batch[0])
                elif batch:
                    self._write_batch(batch)
                self.maintain()
            except Exception:  # the writer must survive anything
                log.exception("ssd writer: unexpected error")
                with self.status.lock:
                    for p in batch:
                        if self.queued.pending.get(bytes(p.meta.block_hash)) is p:
                            self.status.counts["write_errors"] += 1
                            self.queued.forget(p)
            finally:
                for _ in range(len(batch) if batch else int(got)):
                    self.queue.task_done()
            if stop:
                self.queue.task_done()
                return

    def close(self) -> None:
        """Stop the I/O threads (after the writer thread has stopped)."""
        self.segs.close()
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
        with self.cat.write_lock:
            todo = self._take(batch)
            fresh: list[Pending] = []
            alone: list[Pending] = []
            try:
                with self.status.lock:
                    for p in todo:
                        if self.cat.index.get(bytes(p.meta.block_hash)) is None:
                            fresh.append(p)
                        else:
                            alone.append(p)
            except sqlite3.Error as e:
                with self.status.lock:
                    self.status.index_error(e)
                    for p in todo:
                        self.queued.forget(p)
                return
            if fresh:
                alone.extend(self._write_fresh(fresh))
        for p in alone:
            self._write(p)

    def _take(self, batch: list[Pending]) -> list[Pending]:
        """The blocks still to write (cancelled ones, and all while degraded, dropped)."""
        todo: list[Pending] = []
        with self.status.lock:
            for p in batch:
                if p.cancelled:
                    self.queued.forget(p)
                    continue
                p.taken = True
                if self.status.backing_off():
                    self.queued.drops["degraded"] += 1
                    self.queued.forget(p)
                    continue
                todo.append(p)
            self.cat.apply_touches()
        return todo

    def _write_segments(self, batch: list[Pending]) -> None:
        """Append the blocks to this process's segment (one write, one fdatasync), then
        commit their rows in one transaction (the budget enforced in it); a block whose
        bytes the index already has commits its sessions only. A crash before the
        commit leaves a torn tail no row names (cut by the next repair)."""
        with self.cat.write_lock:
            todo = self._take(batch)
            fresh: list[tuple[Pending, bytes, str]] = []
            one = len(todo) == 1  # (encoded here, on the writer thread)
            for prepared in map(self._prepare, todo) if one else self._io().map(self._prepare, todo):
                if prepared is None:
                    continue
                p, data, digest = prepared
                try:
                    with self.status.lock:
                        cur = self.cat.index.get(bytes(p.meta.block_hash))
                    if cur is not None and cur.checksum == digest:
                        with self.cat.dirlock.shared():
                            if self.rows.commit(p, len(data), cur.file_name, digest, dedup=True):
                                continue
                except sqlite3.Error as e:
                    self.status.index_error(e)
                    self.queued.drop(p)
                    continue
                fresh.append((p, data, digest))
            if not fresh:
                return
            keep = bytes(fresh[-1][0].meta.block_hash)
            for attempt in (0, 1):
                try:
                    self.segs.max_bytes = self.cat.config.segment_bytes
                    refs = self.segs.append([(d, g) for _, d, g in fresh], self.cat.dirlock)
                    with self.cat.dirlock.shared():
                        self.rows.commit_many([(p, len(d), ref, g) for (p, d, g), ref
                                               in zip(fresh, refs, strict=True)],
                                              dedup=False, evict=True)
                except OSError as e:
                    need = sum(len(d) for _, d, _ in fresh)
                    if attempt == 0 and e.errno in _DISK_FULL and self.cat.make_room(keep, need):
                        continue  # the disk filled up (from outside): room made, once more
                    for p, _, _ in fresh:
                        self.queued.drop(p, reason="degraded", counter="write_errors")
                    self.status.degrade(f"write failed: {e}")
                    return
                break
        self.cat.enforce_capacity(keep=keep)

    def _prepare(self, p: Pending) -> tuple[Pending, bytes, str] | None:
        """Encode and checksum; None: dropped and counted."""
        try:
            data = p.source.encode()
        except Exception as e:
            log.warning("ssd block %s: cannot encode the payload: %s",
                        bytes(p.meta.block_hash).hex()[:16], e)
            self.queued.drop(p, counter="encode_errors")
            return None
        if len(data) > self.cat.budget():
            self.queued.drop(p, reason="budget")
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
        tmp = files.write_temp(self.cat.root / rel.rsplit("/", 1)[0], h + files.SUFFIX, data,
                               fsync=self.cat.config.fsync)
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
            with self.cat.dirlock.shared():
                for i, (p, size, digest) in enumerate(written):
                    tmp = tmps[i]
                    if tmp is None:
                        raise InvariantError(f"ssd batch: block {i} has no temp file to publish")
                    name = files.publish(tmp, files.block_names(bytes(p.meta.block_hash).hex()),
                                         fsync=False)
                    tmps[i] = None
                    folder = str(tmp.parent.relative_to(self.cat.root))
                    published.append((p, size, folder + "/" + name, digest))
                if self.cat.config.fsync:
                    folders = {self.cat.root / rel.rsplit("/", 1)[0] for _, _, rel, _ in published}
                    list(self._io().map(files.fsync_dir, sorted(folders)))
                self.rows.commit_many(published, dedup=False, evict=True)
                published = []
        except OSError as e:
            leftovers = [t for t in tmps if t is not None]
            leftovers += [self.cat.root / rel for _, _, rel, _ in published]  # no row yet
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
            self.cat.enforce_capacity(keep=bytes(written[-1][0].meta.block_hash))
        return []

    def _write(self, p: Pending) -> None:
        h = bytes(p.meta.block_hash)
        with self.cat.write_lock:
            with self.status.lock:
                if p.cancelled:
                    self.queued.forget(p)
                    return
                p.taken = True
                if self.status.backing_off():
                    self.queued.drops["degraded"] += 1
                    self.queued.forget(p)
                    return
                self.cat.apply_touches()
            try:  # the encoding happens here, on the writer thread
                data = p.source.encode()
            except Exception as e:
                log.warning("ssd block %s: cannot encode the payload: %s", h.hex()[:16], e)
                self.queued.drop(p, counter="encode_errors")
                return
            if len(data) > self.cat.budget():
                self.queued.drop(p, reason="budget")
                return
            digest = checksum(data)
            for attempt in (0, 1):
                try:
                    with self.status.lock:
                        existing = self.cat.index.get(h)
                    if existing is not None and existing.checksum == digest:
                        with self.cat.dirlock.shared():  # the same bytes are stored: sessions only
                            if self.rows.commit(p, len(data), existing.file_name, digest, dedup=True):
                                return
                    primary = files.block_rel_path(p.meta.namespace_key, p.meta.tenant, h.hex())
                    folder = self.cat.root / primary.rsplit("/", 1)[0]
                    tmp = files.write_temp(folder, h.hex() + files.SUFFIX, data,
                                           fsync=self.cat.config.fsync)
                    with self.cat.dirlock.shared():
                        name = files.publish(tmp, files.block_names(h.hex()),
                                             fsync=self.cat.config.fsync)
                        rel = primary.rsplit("/", 1)[0] + "/" + name
                        self.rows.commit(p, len(data), rel, digest, dedup=False)
                except sqlite3.Error as e:
                    with self.status.lock:
                        self.status.index_error(e)
                        self.queued.forget(p)
                    return
                except OSError as e:
                    if attempt == 0 and e.errno in _DISK_FULL and self.cat.make_room(h, len(data)):
                        continue  # the disk filled up (from outside): room made, once more
                    self.queued.drop(p, reason="degraded", counter="write_errors")
                    self.status.degrade(f"write failed: {e}")
                    return
                break
            self.cat.enforce_capacity(keep=h)
