"""The SSD tier: a crash-safe, persistent, content-addressed block store.

``put`` never blocks: it enqueues the block on a bounded queue drained by one
writer thread (a full queue drops the block and counts it). Each write is
temp file -> fsync -> ``os.replace`` -> fsync folder -> commit of the index row,
so after a crash (even SIGKILL) every row names a complete file; reconcile at
startup removes what a crash left behind. ``get`` verifies size and checksum and
quarantines a bad file. Metadata queries (``get_meta``, ``children``) read only
the SQLite index (and the blocks still queued for writing).

Failures degrade, they never propagate: an ``OSError`` while writing marks the
tier degraded (``stats()["degraded"]``) and puts are dropped until a backoff has
passed; ``get`` raises only ``TierError`` / ``CorruptBlockError``.

``put(meta, payload, sessions=(), hits=None)``: ``hits`` is the block's hit count
as the policy knows it, used by the ``admission_min_hits`` rule (None counts as 0).

Thread safety: every public method may be called from any thread. Lock order:
``_write_lock`` (serializes file writes, deletions, sweeps and checks) before
``_lock`` (guards the index connection, the pending map and the counters).
"""

from __future__ import annotations

import bisect
import logging
import os
import queue
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..codec import checksum
from ..config import SSDConfig
from ..errors import CorruptBlockError, TierError
from ..hashing import BlockHash
from ..meta import BlockMeta
from . import ssd_files as files
from .ssd_check import CheckReport, reconcile
from .ssd_index import IndexCorruptError, IndexRow, SSDIndex

log = logging.getLogger(__name__)

LATENCY_BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0, 500.0, 1000.0)
DROP_REASONS = ("queue_full", "budget", "admission", "degraded", "write_budget", "closed")
_STOP = object()
PREFETCH_CHILDREN = 4
_FADV_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)


@dataclass(eq=False)
class _Pending:
    meta: BlockMeta
    payload: bytes
    sessions: set[str] = field(default_factory=set)
    had_session: bool = False
    taken: bool = False
    cancelled: bool = False


class SSDTier:
    """See the module docstring. ``clock`` returns wall-clock seconds (tests fake it)."""

    name = "ssd"

    def __init__(
        self,
        config: SSDConfig,
        *,
        clock: Callable[[], float] = time.time,
        sweep_interval_s: float = 10.0,
        degraded_backoff_s: float = 5.0,
        reconcile_on_open: bool = True,
    ) -> None:
        self.config = config
        self.policy = config.policy
        self.root = Path(config.path)
        self._clock = clock
        self._sweep_interval = sweep_interval_s
        self._backoff = degraded_backoff_s
        self._lock = threading.RLock()
        self._write_lock = threading.RLock()
        self._pending: dict[bytes, _Pending] = {}
        self._pending_bytes = 0
        self._touches: dict[bytes, tuple[float, int]] = {}
        self._counts: Counter[str] = Counter()
        self._drops: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self._latency = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self._latency_sum_ms = 0.0
        self._degraded_reason: str | None = None
        self._retry_at = 0.0
        self._closed = False
        self._index_rebuilt = False
        self._index = self._open_index()
        self._blocks, self._bytes = self._index.totals()
        self._bytes_written = int(self._index.kv_get("bytes_written") or 0)
        self._day = self._index.kv_get("write_day") or ""
        self._day_bytes = int(self._index.kv_get("write_day_bytes") or 0)
        self.startup_report: CheckReport | None = None
        if reconcile_on_open:
            self.startup_report = self.check(fix=True)
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=config.queue_size)
        self._last_sweep = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="promptcache-ssd-writer", daemon=True)
        self._thread.start()

    # -- opening ----------------------------------------------------------------

    def _open_index(self) -> SSDIndex:
        durable = self.config.fsync
        path = self.root / files.INDEX_NAME
        try:
            files.ensure_dir(self.root, fsync=durable)
            return SSDIndex(path, durable=durable)
        except IndexCorruptError as e:
            log.error("ssd index %s is unusable (%s): moving it aside, starting empty", path, e)
        except OSError as e:
            return self._memory_index(f"cannot create {self.root}: {e}")
        self._index_rebuilt = True
        stamp = int(time.time() * 1000)
        try:
            qdir = self.root / files.QUARANTINE_DIR
            qdir.mkdir(parents=True, exist_ok=True)
            for suffix in ("", "-wal", "-shm"):
                p = self.root / (files.INDEX_NAME + suffix)
                if p.exists():
                    p.replace(qdir / f"{files.INDEX_NAME}{suffix}.{stamp}")
            return SSDIndex(path, durable=durable)
        except (OSError, IndexCorruptError) as e:
            return self._memory_index(f"cannot rebuild index: {e}")

    def _memory_index(self, reason: str) -> SSDIndex:
        log.error("ssd tier degraded: %s (index kept in memory)", reason)
        self._degraded_reason = reason
        self._retry_at = float("inf")
        return SSDIndex(Path(":memory:"), durable=False)

    # -- metadata queries (index only) -------------------------------------------

    def _live(self, row: IndexRow | None, now: float) -> bool:
        return row is not None and (row.expiry is None or row.expiry > now)

    def get_meta(self, block_hash: BlockHash) -> BlockMeta | None:
        h = bytes(block_hash)
        with self._lock:
            p = self._pending.get(h)
            if p is not None and not p.cancelled:
                return p.meta
            try:
                row = self._index.get(h)
            except sqlite3.Error as e:
                self._index_error(e)
                return None
        return row.meta if row is not None and self._live(row, self._clock()) else None

    def children(self, parent_hash: BlockHash) -> list[BlockMeta]:
        parent = bytes(parent_hash)
        now = self._clock()
        with self._lock:
            try:
                rows = self._index.children(parent)
            except sqlite3.Error as e:
                self._index_error(e)
                rows = []
            out = {bytes(r.meta.block_hash): r.meta for r in rows if self._live(r, now)}
            for h, p in self._pending.items():
                if not p.cancelled and bytes(p.meta.parent_hash) == parent:
                    out[h] = p.meta
        return [out[h] for h in sorted(out)]

    def sessions_of(self, block_hash: BlockHash) -> list[str]:
        with self._lock:
            p = self._pending.get(bytes(block_hash))
            if p is not None and not p.cancelled:
                return sorted(p.sessions)
            return self._index.sessions_of(bytes(block_hash))

    def rows(self, tenant: str | None = None) -> list[IndexRow]:
        """Index rows (for the CLI and tests), most recently used first."""
        where, params = ("WHERE tenant=?", (tenant,)) if tenant is not None else ("", ())
        with self._lock:
            return list(self._index.iter_rows(where + " ORDER BY last_access DESC, hash", params))

    def tenants(self) -> list[tuple[str, int, int]]:
        with self._lock:
            return self._index.tenants()

    # -- read path --------------------------------------------------------------------

    def get(self, block_hash: BlockHash) -> bytes | None:
        h = bytes(block_hash)
        t0 = time.perf_counter()
        with self._lock:
            p = self._pending.get(h)
            if p is not None and not p.cancelled:
                self._counts["hits"] += 1
                self._counts["pending_hits"] += 1
                return p.payload
            try:
                row = self._index.get(h)
            except sqlite3.Error as e:
                self._index_error(e)
                raise TierError(f"ssd index unavailable: {e}") from e
        now = self._clock()
        for _attempt in range(3):
            if row is None or not self._live(row, now):
                with self._lock:
                    self._counts["misses"] += 1
                return None
            path = self.root / row.file_name
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                again = self._reread_row(h, row)
                if again is not row:
                    row = again
                    continue
                self._drop_bad(row, reason=None)
                raise CorruptBlockError(f"ssd block {h.hex()[:16]}: file {row.file_name} is missing") from None
            except OSError as e:
                with self._lock:
                    self._counts["read_errors"] += 1
                self._degrade(f"read failed: {e}")
                raise TierError(f"ssd block {h.hex()[:16]}: cannot read {row.file_name}: {e}") from e
            self._prefetch_children(h)
            if len(data) != row.file_bytes or checksum(data) != row.checksum:
                again = self._reread_row(h, row)
                if again is not row:
                    row = again
                    continue
                why = "size" if len(data) != row.file_bytes else "checksum"
                self._drop_bad(row, reason=why)
                raise CorruptBlockError(f"ssd block {h.hex()[:16]}: {why} mismatch, quarantined")
            self._record_hit(h, now, (time.perf_counter() - t0) * 1000.0)
            return data
        raise TierError(f"ssd block {h.hex()[:16]} kept changing while being read")

    def _prefetch_children(self, h: bytes) -> None:
        """Ask the kernel to start reading the files of ``h``'s children: a restore
        walks a chain, so the next block's read overlaps this block's checksum."""
        if _FADV_WILLNEED is None:
            return
        try:
            with self._lock:
                rels = self._index.child_files(h, limit=PREFETCH_CHILDREN)
            for rel in rels:
                fd = os.open(self.root / rel, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, _FADV_WILLNEED)
                finally:
                    os.close(fd)
        except (OSError, sqlite3.Error):  # a hint only
            pass

    def _reread_row(self, h: bytes, row: IndexRow) -> IndexRow | None:
        """The current row if it changed since ``row`` was read, else ``row`` itself."""
        with self._lock:
            try:
                cur = self._index.get(h)
            except sqlite3.Error as e:
                self._index_error(e)
                raise TierError(f"ssd index unavailable: {e}") from e
        if cur is None:
            return None
        if cur.file_name == row.file_name and cur.checksum == row.checksum:
            return row
        return cur

    def _drop_bad(self, row: IndexRow, *, reason: str | None) -> None:
        h = bytes(row.meta.block_hash)
        with self._write_lock, self._lock:
            try:
                cur = self._index.get(h)
                if cur is None or cur.file_name != row.file_name or cur.checksum != row.checksum:
                    return
                self._delete_rows([(h, row.file_name, row.file_bytes)], unlink=False)
            except sqlite3.Error as e:
                self._index_error(e)
                return
            if reason is None:
                self._counts["missing_files"] += 1
            else:
                files.quarantine(self.root, self.root / row.file_name, h.hex(), reason)
                self._counts["quarantined"] += 1
            self._counts["corrupt"] += 1
            self._counts["misses"] += 1
        log.warning("ssd block %s dropped (%s)", h.hex()[:16], reason or "missing file")

    def _record_hit(self, h: bytes, now: float, ms: float) -> None:
        with self._lock:
            self._counts["hits"] += 1
            prev = self._touches.get(h)
            self._touches[h] = (now, (prev[1] if prev else 0) + 1)
            self._latency[bisect.bisect_left(LATENCY_BUCKETS_MS, ms)] += 1
            self._latency_sum_ms += ms

    # -- write path -------------------------------------------------------------------

    def put(
        self,
        meta: BlockMeta,
        payload: bytes,
        sessions: Iterable[str] = (),
        hits: int | None = None,
    ) -> bool:
        if not isinstance(meta, BlockMeta):
            raise ValueError(f"meta must be a BlockMeta, got {type(meta).__name__}")
        if len(meta.block_hash) != 32 or len(meta.parent_hash) != 32:
            raise ValueError("block and parent hashes must be 32 bytes")
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise ValueError(f"payload must be bytes, got {type(payload).__name__}")
        if isinstance(sessions, str):
            raise ValueError("sessions must be an iterable of session ids, not a string")
        files.block_rel_path(meta.namespace_key, meta.tenant, "00")  # validates folder names
        payload = bytes(payload)
        sess = {str(s) for s in sessions}
        cfg = self.config
        h = bytes(meta.block_hash)
        with self._lock:
            reason = None
            if self._closed:
                reason = "closed"
            elif meta.end < cfg.admission_min_tokens or (hits or 0) < cfg.admission_min_hits:
                reason = "admission"
            elif len(payload) > cfg.budget_bytes:
                reason = "budget"
            elif self._degraded_reason is not None and self._clock() < self._retry_at:
                reason = "degraded"
            elif cfg.daily_write_budget_bytes is not None and (
                self._today_bytes() + self._pending_bytes + len(payload)
                > cfg.daily_write_budget_bytes
            ):
                reason = "write_budget"
            if reason is not None:
                self._drops[reason] += 1
                return False
            p = self._pending.get(h)
            if p is not None and not p.taken and not p.cancelled:
                self._pending_bytes += len(payload) - len(p.payload)
                p.meta, p.payload = meta, payload
                p.sessions |= sess
                p.had_session = p.had_session or bool(sess)
                return True
            item = _Pending(meta, payload, set(sess), bool(sess))
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                self._drops["queue_full"] += 1
                return False
            if p is not None:  # an older version is being written: it is superseded
                self._forget(p)
            self._pending[h] = item
            self._pending_bytes += len(payload)
            return True

    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str]) -> None:
        if isinstance(sessions, str):
            raise ValueError("sessions must be an iterable of session ids, not a string")
        sess = {str(s) for s in sessions}
        if not sess:
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

    def _today_bytes(self) -> int:
        day = time.strftime("%Y-%m-%d", time.gmtime(self._clock()))
        if day != self._day:
            self._day, self._day_bytes = day, 0
        return self._day_bytes

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=max(0.05, self._sweep_interval / 4))
            except queue.Empty:
                item = None
            if item is _STOP:
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
                if item is not None:
                    self._queue.task_done()

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
                try:
                    existing = self._index.get(h)
                except sqlite3.Error as e:
                    self._index_error(e)
                    self._forget(p)
                    return
            digest = checksum(p.payload)
            if existing is not None and existing.checksum == digest:
                self._commit(p, existing.file_name, digest, existing)
                return
            alt = existing is not None and not files.is_alt(existing.file_name)
            rel = files.block_rel_path(p.meta.namespace_key, p.meta.tenant, h.hex(), alt=alt)
            try:
                files.atomic_write(self.root / rel, p.payload, fsync=self.config.fsync)
            except OSError as e:
                with self._lock:
                    self._counts["write_errors"] += 1
                    self._drops["degraded"] += 1
                    self._forget(p)
                self._degrade(f"write failed: {e}")
                return
            if self._commit(p, rel, digest, existing) and existing is not None:
                if existing.file_name != rel:
                    files.remove_file(self.root / existing.file_name)
            self._enforce_capacity(keep=h)

    def _commit(self, p: _Pending, rel: str, digest: str, existing: IndexRow | None) -> bool:
        h = bytes(p.meta.block_hash)
        now = self._clock()
        ttl = self.config.ttl_seconds
        written = existing is None or existing.file_name != rel
        with self._lock:
            if p.cancelled:
                self._forget(p)
                if written:
                    files.remove_file(self.root / rel)
                return False
            row = IndexRow(
                meta=p.meta,
                file_name=rel,
                file_bytes=len(p.payload),
                checksum=digest,
                created=existing.created if existing is not None else now,
                last_access=now,
                expiry=None if ttl is None else now + ttl,
                hits=existing.hits if existing is not None else 0,
                had_session=p.had_session or (existing is not None and existing.had_session),
            )
            try:
                self._index.begin()
                self._index.upsert(row)
                self._index.add_sessions(h, p.sessions)
                if written:
                    self._today_bytes()
                    self._day_bytes += len(p.payload)
                    self._bytes_written += len(p.payload)
                    self._index.kv_set("bytes_written", str(self._bytes_written))
                    self._index.kv_set("write_day", self._day)
                    self._index.kv_set("write_day_bytes", str(self._day_bytes))
                self._index.commit()
            except sqlite3.Error as e:
                self._index.rollback()
                self._index_error(e)
                self._forget(p)
                if written:
                    files.remove_file(self.root / rel)
                return False
            self._forget(p)
            if existing is not None:
                self._bytes -= existing.file_bytes
                self._blocks -= 1
            self._bytes += row.file_bytes
            self._blocks += 1
            self._counts["spills" if written else "dedup"] += 1
            if self._degraded_reason is not None and self._retry_at != float("inf"):
                log.info("ssd tier recovered (was: %s)", self._degraded_reason)
                self._degraded_reason = None
            return True

    def _forget(self, p: _Pending) -> None:
        h = bytes(p.meta.block_hash)
        if self._pending.get(h) is p:
            del self._pending[h]
            self._pending_bytes -= len(p.payload)

    def _degrade(self, reason: str) -> None:
        with self._lock:
            self._counts["io_errors"] += 1
            if self._degraded_reason is None:
                log.error("ssd tier degraded: %s", reason)
            self._degraded_reason = reason
            if self._retry_at != float("inf"):
                self._retry_at = self._clock() + self._backoff

    def _index_error(self, e: sqlite3.Error) -> None:
        self._counts["index_errors"] += 1
        self._degrade(f"index error: {e}")

    # -- deletion, capacity, TTL --------------------------------------------------------

    def _delete_rows(self, victims: list[tuple[bytes, str, int]], *, unlink: bool = True) -> None:
        """Delete rows (commit first), then their files. Caller holds both locks."""
        if not victims:
            return
        self._index.begin()
        try:
            self._index.delete(h for h, _, _ in victims)
            self._index.commit()
        except sqlite3.Error:
            self._index.rollback()
            raise
        for _h, rel, nbytes in victims:
            self._bytes -= nbytes
            self._blocks -= 1
            if unlink:
                try:
                    files.remove_file(self.root / rel)
                except OSError as e:  # left for reconcile as an orphan
                    log.warning("cannot remove %s: %s", rel, e)

    def _enforce_capacity(self, keep: bytes | None = None) -> int:
        evicted = 0
        with self._write_lock, self._lock:
            while self._bytes > self.config.budget_bytes:
                batch = [v for v in self._index.lru(32) if v[0] != keep]
                if not batch:
                    break
                victims = []
                excess = self._bytes - self.config.budget_bytes
                for v in batch:
                    if excess <= 0:
                        break
                    victims.append(v)
                    excess -= v[2]
                self._delete_rows(victims)
                evicted += len(victims)
            self._counts["evictions_capacity"] += evicted
        return evicted

    def sweep(self) -> int:
        """Apply batched accesses, delete expired blocks, enforce the byte limit."""
        self._last_sweep = time.monotonic()
        try:
            with self._write_lock, self._lock:
                self._apply_touches()
                expired = self._index.expired(self._clock())
                self._delete_rows(expired)
                self._counts["evictions_ttl"] += len(expired)
            return len(expired) + self._enforce_capacity()
        except sqlite3.Error as e:
            with self._lock:
                self._index_error(e)
            return 0

    def _apply_touches(self) -> None:
        if not self._touches:
            return
        batch = [(h, when, n, self.config.ttl_seconds) for h, (when, n) in self._touches.items()]
        self._touches.clear()
        try:
            self._index.begin()
            self._index.touch(batch)
            self._index.commit()
        except sqlite3.Error as e:
            self._index.rollback()
            self._index_error(e)

    def _cancel_pending(self, match: Callable[[_Pending], bool]) -> set[bytes]:
        out = set()
        for h, p in list(self._pending.items()):
            if not p.cancelled and match(p):
                p.cancelled = True
                out.add(h)
                if not p.taken:
                    self._forget(p)
        return out

    def delete_session(self, session_id: str) -> int:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        with self._write_lock, self._lock:
            for p in self._pending.values():
                p.sessions.discard(session_id)
            cancelled = self._cancel_pending(lambda p: p.had_session and not p.sessions)
            try:
                self._index.begin()
                orphaned = self._index.remove_session(session_id)
                self._index.commit()
                self._delete_rows(orphaned)
            except sqlite3.Error as e:
                self._index.rollback()
                self._index_error(e)
                raise TierError(f"ssd delete_session failed: {e}") from e
            return len(cancelled | {h for h, _, _ in orphaned})

    def delete_tenant(self, tenant: str | None) -> int:
        return self.purge(tenant=tenant)

    def purge(self, *, tenant: str | None = None, older_than_s: float | None = None) -> int:
        """Delete the blocks of ``tenant`` (None: every tenant) not used for
        ``older_than_s`` seconds (None: regardless of age). Returns the count."""
        if older_than_s is not None and older_than_s < 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s}")
        conds: list[str] = []
        params: list[str | float] = []
        if tenant is not None:
            conds.append("tenant=?")
            params.append(tenant)
        if older_than_s is not None:
            conds.append("last_access < ?")
            params.append(self._clock() - older_than_s)
        where = ("WHERE " + " AND ".join(conds)) if conds else ""
        with self._write_lock, self._lock:
            self._apply_touches()
            cancelled: set[bytes] = set()
            if older_than_s is None:
                cancelled = self._cancel_pending(lambda p: tenant is None or p.meta.tenant == tenant)
            try:
                victims = self._index.select_files(where, tuple(params))
                self._delete_rows(victims)
            except sqlite3.Error as e:
                self._index_error(e)
                raise TierError(f"ssd purge failed: {e}") from e
            return len(cancelled | {h for h, _, _ in victims})

    # -- maintenance, stats, lifecycle ----------------------------------------------------

    def check(self, fix: bool = False) -> CheckReport:
        """Compare index and files (see ``ssd_check``). Waits for queued writes first."""
        if not self._closed and hasattr(self, "_thread"):
            self.flush()
        with self._write_lock, self._lock:
            report = reconcile(self.root, self._index, fix=fix)
            report.index_rebuilt, self._index_rebuilt = self._index_rebuilt, False
            self._blocks, self._bytes = self._index.totals()
        return report

    def flush(self) -> None:
        """Wait until every queued block is written (or dropped); apply batched accesses."""
        self._queue.join()
        with self._write_lock, self._lock:
            self._apply_touches()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            c = self._counts
            return {
                "name": self.name,
                "policy": self.policy,
                "spills": c["spills"],
                "dedup_writes": c["dedup"],
                "dropped_spills": dict(self._drops),
                "dropped_spills_total": sum(self._drops.values()),
                "hits": c["hits"],
                "misses": c["misses"],
                "corrupt": c["corrupt"],
                "quarantined": c["quarantined"],
                "missing_files": c["missing_files"],
                "read_errors": c["read_errors"],
                "write_errors": c["write_errors"],
                "index_errors": c["index_errors"],
                "io_errors": c["io_errors"],
                "evictions_capacity": c["evictions_capacity"],
                "evictions_ttl": c["evictions_ttl"],
                "blocks_on_disk": self._blocks,
                "bytes_on_disk": self._bytes,
                "budget_bytes": self.config.budget_bytes,
                "bytes_written": self._bytes_written,
                "bytes_written_today": self._today_bytes(),
                "queue_depth": len(self._pending),
                "degraded": self._degraded_reason is not None,
                "degraded_reason": self._degraded_reason,
                "reload_latency_ms": {
                    "buckets": list(LATENCY_BUCKETS_MS),
                    "counts": list(self._latency),
                    "count": sum(self._latency),
                    "sum": round(self._latency_sum_ms, 3),
                },
            }

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(_STOP)
        self._thread.join()
        with self._write_lock, self._lock:
            self._apply_touches()
            self._index.close()

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[IndexRow]:
        return iter(self.rows())
