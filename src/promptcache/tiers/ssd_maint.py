"""The SSD tier's maintenance: the periodic sweep (batched
accesses, TTL, capacity, segment compaction, the index check), pins, and deletion by block, session,
tenant and age. Locking rules: see ``ssd.py``."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterable

from ..errors import TierError
from ..hashing import BlockHash
from . import ssd_files as files
from . import ssd_segments as segments
from .ssd_index import SSDIndex
from .ssd_queue import Queued
from .ssd_schema import IndexCorruptError, IndexOpenError
from .ssd_store import Catalog, Status

log = logging.getLogger(__name__)


class Maintenance:
    """Sweeps every ``sweep_interval_s`` (the writer thread asks ``sweep_due``) and
    verifies the index file every ``index_check_interval_s``."""

    def __init__(self, status: Status, cat: Catalog, queued: Queued, *,
                 sweep_interval_s: float, index_check_interval_s: float,
                 segs: segments.SegmentWriter | None = None) -> None:
        self.status, self.cat, self.queued, self.segs = status, cat, queued, segs
        self.sweep_interval = sweep_interval_s
        self.index_check_interval = index_check_interval_s
        self.last_sweep = self.last_index_check = time.monotonic()

    def sweep_due(self) -> bool:
        return time.monotonic() - self.last_sweep >= self.sweep_interval

    def verify_index(self) -> bool:
        """``PRAGMA quick_check`` of the index file on a connection of its own (so no
        lock of the request path is held while it reads the whole file): a running
        server notices an index damaged under it. False (and the tier read-only,
        ``index_errors`` counted) if it is damaged. Never raises."""
        self.last_index_check = time.monotonic()
        if self.status.mode == "off" or self.status.closed:
            return True
        path = self.cat.root / files.INDEX_NAME
        try:
            SSDIndex(path, durable=False, read_only=True).close()
        except IndexCorruptError as e:
            with self.status.lock:
                self.status.counts["index_errors"] += 1
            self.status.index_corrupted(str(e))
            return False
        except IndexOpenError as e:
            with self.status.lock:
                self.status.counts["index_errors"] += 1
            self.status.degrade(f"index check failed: {e}")
            return False
        return True

    def sweep(self, verify: Callable[[], bool]) -> int:
        """Apply batched accesses, delete expired blocks, enforce the byte limit; every
        ``index_check_interval_s``, verify the index file (``verify``)."""
        self.last_sweep = time.monotonic()
        if self.last_sweep - self.last_index_check >= self.index_check_interval:
            verify()
        if not self.status.writable():
            with self.status.lock:
                self.cat.touches.clear()
            return 0
        try:
            with self.cat.write_lock, self.cat.dirlock.shared(), self.status.lock:
                self.cat.apply_touches()
                expired = self.cat.delete_where(lambda: self.cat.index.expired(self.status.clock()))
                self.status.counts["evictions_ttl"] += len(expired)
                self.cat.refresh_totals()
                self.cat.refresh_disk_cap()
            return len(expired) + self.cat.enforce_capacity() + self.compact()
        except sqlite3.Error as e:
            with self.status.lock:
                self.status.index_error(e)
            return 0

    def compact(self) -> int:
        """Segments no writer holds whose rows name at most half their bytes: their
        blocks (verified) are appended to this process's segment and the rows that
        still name the old bytes moved in one transaction, so the segment goes.
        Returns the blocks moved; raises sqlite3.Error."""
        if self.segs is None or self.cat.config.segment_bytes <= 0 or not self.status.writable():
            return 0
        moved = 0
        with self.cat.write_lock:
            with self.status.lock:
                use = self.cat.index.segment_use()
            for seg, live in use:
                path = self.cat.root / seg
                try:
                    if (live * 2 > path.stat().st_size or seg == self.segs.rel
                            or segments.in_use(path)):
                        continue
                    with self.status.lock:
                        rows = list(self.cat.index.iter_rows(
                            "WHERE file_name >= ? AND file_name < ?", (seg + "@", seg + "A")))
                    got = segments.read_many(self.cat.root, [
                        (i, r.file_name, r.file_bytes, r.checksum) for i, r in enumerate(rows)], None)
                    good = [(rows[i], d) for i, d in sorted(got.items()) if isinstance(d, (bytes, memoryview))]
                    if not good:
                        continue
                    refs = self.segs.append([(d, r.checksum) for r, d in good], self.cat.dirlock)
                except OSError as e:
                    log.warning("ssd: cannot compact %s: %s", seg, e)
                    continue
                with self.cat.dirlock.shared(), self.status.lock:
                    self.cat.index.begin()
                    try:
                        self.cat.index.move([(bytes(r.meta.block_hash), r.file_name, ref)
                                             for (r, _), ref in zip(good, refs, strict=True)])
                        self.cat.index.commit()
                    except BaseException:
                        self.cat.index.rollback()
                        raise
                    self.cat.remove_files([r.file_name for r in rows])
                moved += len(good)
                self.status.counts["compacted_blocks"] += len(good)
        return moved

    def pin(self, block_hashes: Iterable[BlockHash], seconds: float) -> int:
        """Retain these blocks for ``seconds`` from now (``prompt_cache_retention:
        24h``): ``pinned_until`` in the index (shared by every process, kept across
        restarts) only grows; until then the TTL does not remove them and the byte
        limit evicts them only after every unpinned block. A block not stored yet
        (queued, or still on its way from RAM) gets the pin when its row is
        committed. Deletion (session, tenant, purge, discard) still deletes pinned
        blocks. Returns the number of stored blocks pinned now."""
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"seconds must be a positive number, got {seconds!r}")
        hs = list(dict.fromkeys(bytes(h) for h in block_hashes))
        if not hs or not self.status.writable():
            return 0
        with self.status.lock:
            until = self.status.clock() + float(seconds)
            try:
                self.cat.index.begin()
                found = self.cat.index.pin(hs, until)
                self.cat.index.commit()
            except sqlite3.Error as e:
                self.cat.index.rollback()
                self.status.index_error(e)
                raise TierError(f"ssd pin failed: {e}") from e
            for h in hs:
                if h not in found:
                    self.cat.add_pin(h, until)
            self.status.counts["pins"] += len(hs)
            return len(found)

    def delete_session(self, session_id: str, tenant: str | None = None) -> set[bytes]:
        """Remove the session from the blocks of ``tenant`` (None: every tenant); delete
        the blocks it leaves without a session. Returns the hashes of those deleted."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError("tenant must be a non-empty string or None")
        self.status.refuse_change("delete_session")
        with self.cat.write_lock, self.cat.dirlock.shared(), self.status.lock:
            for p in self.queued.pending.values():
                if tenant is None or p.meta.tenant == tenant:
                    p.sessions.discard(session_id)
            cancelled = self.queued.cancel(
                lambda p: p.had_session and not p.sessions
                and (tenant is None or p.meta.tenant == tenant))
            try:
                orphaned = self.cat.delete_where(
                    lambda: self.cat.index.remove_session(session_id, tenant))
            except sqlite3.Error as e:
                self.status.index_error(e)
                raise TierError(f"ssd delete_session failed: {e}") from e
            return cancelled | {bytes(h) for h, _, _ in orphaned}

    def discard(self, block_hashes: Iterable[BlockHash]) -> int:
        """Delete these blocks (e.g. partial tails a longer sibling now covers), queued
        or stored. Returns the number deleted."""
        hs = {bytes(h) for h in block_hashes}
        if not hs:
            return 0
        self.status.refuse_change("discard")
        marks = ",".join("?" * len(hs))
        with self.cat.write_lock, self.cat.dirlock.shared(), self.status.lock:
            cancelled = self.queued.cancel(lambda p: bytes(p.meta.block_hash) in hs)
            try:
                victims = self.cat.delete_where(
                    lambda: self.cat.index.select_files(f"WHERE hash IN ({marks})", tuple(hs)))
            except sqlite3.Error as e:
                self.status.index_error(e)
                raise TierError(f"ssd discard failed: {e}") from e
            return len(cancelled | {h for h, _, _ in victims})

    def purge(self, *, tenant: str | None = None, older_than_s: float | None = None) -> int:
        """Delete the blocks of ``tenant`` (None: every tenant) not used for
        ``older_than_s`` seconds (None: regardless of age). Returns the count. Holds
        the folder's exclusive lock (as ``cache check --fix`` does)."""
        if older_than_s is not None and older_than_s < 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
        conds: list[str] = []
        params: list[str | float] = []
        if tenant is not None:
            conds.append("tenant=?")
            params.append(tenant)
        if older_than_s is not None:
            conds.append("last_access < ?")
            params.append(self.status.clock() - older_than_s)
        where = ("WHERE " + " AND ".join(conds)) if conds else ""
        self.status.refuse_change("purge")
        with self.cat.write_lock, self.cat.dirlock.exclusive(), self.status.lock:
            self.cat.apply_touches()
            cancelled: set[bytes] = set()
            if older_than_s is None:
                cancelled = self.queued.cancel(lambda p: tenant is None or p.meta.tenant == tenant)
            try:
                victims = self.cat.delete_where(lambda: self.cat.index.select_files(where, tuple(params)))
            except sqlite3.Error as e:
                self.status.index_error(e)
                raise TierError(f"ssd purge failed: {e}") from e
            return len(cancelled | {h for h, _, _ in victims})
