"""The SSD tier's shared state and maintenance: counters, deletion, capacity (LRU),
TTL sweeps, sessions, tenants and stats.

The budget in use (``budget()``) is the configured ``budget_bytes`` capped by the
disk: the bytes stored + the disk's free bytes - ``disk_reserve_bytes`` (asked at
open, at each sweep and after a write found the disk full), so a disk filled from
outside makes the tier evict its least recently used blocks (``evictions_disk``)
instead of failing its writes. ``SSDTier`` (``ssd.py``) adds the read
and write paths and the lifecycle on top. Locking rules: see ``ssd.py``.

Several processes may share one folder: block and byte totals live in the index
(kept by triggers), so the byte budget is enforced on everyone's blocks together;
each deletion selects and deletes its rows in one transaction, and unlinks the
files only after the commit, holding the folder's shared ``DirLock`` meanwhile.
"""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..config import SSDConfig
from ..errors import TierError
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from . import ssd_files as files
from .base import PayloadSource
from .ssd_index import IndexCorruptError, IndexOpenError, SSDIndex, is_corruption
from .ssd_queue import WriteQueue

log = logging.getLogger(__name__)

LATENCY_BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0, 500.0, 1000.0)
MAX_EARLY_PINS = 1 << 16  # pins kept for blocks that have no row yet
MAX_DISK_RESERVE = 1 << 30  # the default reserve: 5% of the disk, at most this

# ``shutil.disk_usage``'s (total, used, free) bytes of the file system holding a path
DiskUsage = tuple[int, int, int]
DROP_REASONS = ("queue_full", "budget", "admission", "degraded", "write_budget", "closed",
                "read_only", "off")


@dataclass(eq=False)
class _Pending:
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


_F = TypeVar("_F", bound=Callable[..., Any])


def tier_errors(fn: _F) -> _F:
    """The tier boundary: a public method lets only ``TierError`` out. An index or
    I/O error that the method did not turn into a degraded answer itself (or any
    other unexpected exception: a bug must not fail a request either) becomes a
    ``TierError`` and is counted; bad input still raises ``ValueError``."""

    @functools.wraps(fn)
    def wrapper(self: SSDStore, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(self, *args, **kwargs)
        except (TierError, ValueError):
            raise
        except sqlite3.Error as e:
            with self._lock:
                self._index_error(e)
            raise TierError(f"ssd {fn.__name__} failed: index error: {e}") from e
        except OSError as e:
            self._degrade(f"{fn.__name__} failed: {e}")
            raise TierError(f"ssd {fn.__name__} failed: {e}") from e
        except Exception as e:
            log.exception("ssd %s: unexpected error", fn.__name__)
            with self._lock:
                self._counts["unexpected_errors"] += 1
            raise TierError(f"ssd {fn.__name__} failed unexpectedly: {e!r}") from e

    return wrapper  # type: ignore[return-value]


class SSDStore:
    """State shared by the SSD tier's paths; not used on its own."""

    name = "ssd"
    config: SSDConfig
    policy: str
    root: Path
    _clock: Callable[[], float]
    _lock: threading.RLock
    _write_lock: threading.RLock
    _dirlock: files.DirLock
    _index: SSDIndex
    _queue: WriteQueue
    _pending: dict[bytes, _Pending]
    _pending_bytes: int
    _touches: dict[bytes, tuple[float, int]]
    _pins: dict[bytes, float]  # pins of blocks not in the index yet (applied at commit)
    _pinned_victims: int  # pinned blocks in the last capacity victim batch
    _counts: Counter[str]
    _ahead: files.ReadAhead
    _drops: Counter[str]
    _latency: list[int]
    _latency_sum_ms: float
    _degraded_reason: str | None
    _retry_at: float
    _mode: str  # read_write | read_only | off (see _set_mode)
    _mode_reason: str | None
    _backoff: float
    _blocks: int  # the last totals read from the index (every process's blocks)
    _bytes: int
    _bytes_written: int  # ... and the shared write counters
    _day: str
    _day_bytes: int
    _last_sweep: float
    _disk_usage: Callable[[Path], DiskUsage]
    _disk_cap: int | None  # None: not known (the disk could not be asked)
    _disk_free: int | None
    _disk_reserve: int
    _last_index_check: float  # time.monotonic() of the last verify_index
    _index_check_interval: float

    def _today(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self._clock()))

    def _today_bytes(self) -> int:
        """Bytes written today (as of this process's last commit: a cheap estimate for
        the daily write budget, never a query on the request path)."""
        day = self._today()
        if day != self._day:
            self._day, self._day_bytes = day, 0
        return self._day_bytes

    def _refresh_totals(self) -> None:
        """Re-read the shared totals and write counters (caller holds ``_lock``)."""
        self._blocks, self._bytes = self._index.totals()
        day = self._today()
        self._bytes_written, self._day_bytes = self._index.written(day)
        self._day = day

    def budget(self) -> int:
        """The byte budget in use: ``config.budget_bytes`` capped by the disk."""
        cap = self._disk_cap
        return self.config.budget_bytes if cap is None else min(self.config.budget_bytes, cap)

    def _refresh_disk_cap(self) -> None:
        """Ask the disk (``statvfs``): cap = bytes stored + free - reserve. Caller holds
        ``_lock`` (the stored bytes are the last totals read). Never raises."""
        try:
            total, _used, free = self._disk_usage(self.root)
        except OSError as e:
            log.debug("ssd: cannot read the disk usage of %s: %s", self.root, e)
            return
        reserve = self.config.disk_reserve_bytes
        if reserve is None:
            reserve = min(MAX_DISK_RESERVE, int(total) // 20)
        self._disk_reserve = reserve
        self._disk_free = int(free)
        cap = max(0, self._bytes + int(free) - reserve)
        if cap < self.config.budget_bytes and (self._disk_cap is None
                                               or self._disk_cap >= self.config.budget_bytes):
            log.warning("ssd budget capped by the disk: %d bytes (configured %d; %d free, "
                        "%d kept free)", cap, self.config.budget_bytes, free, reserve)
        self._disk_cap = cap

    def _forget(self, p: _Pending) -> None:
        h = bytes(p.meta.block_hash)
        if self._pending.get(h) is p:
            del self._pending[h]
            self._pending_bytes -= p.nbytes

    def _degrade(self, reason: str) -> None:
        with self._lock:
            self._counts["io_errors"] += 1
            if self._degraded_reason is None:
                log.error("ssd tier degraded: %s", reason)
            self._degraded_reason = reason
            if self._retry_at != float("inf"):
                self._retry_at = self._clock() + self._backoff

    def _writable(self) -> bool:
        """False in the read-only and off modes: nothing may change the folder."""
        return self._mode == "read_write"

    def _refuse_change(self, what: str) -> None:
        if self._mode != "read_write":
            raise TierError(f"ssd {what}: the tier is {self._mode.replace('_', '-')} "
                            f"({self._mode_reason})")

    def _index_error(self, e: sqlite3.Error) -> None:
        """Every SQLite error is counted (``index_errors``) and degrades the tier; one
        that says the index file is damaged turns the tier read-only for good (a
        restart, or ``promptcache cache check --fix``, rebuilds the index under the
        folder lock)."""
        with self._lock:
            self._counts["index_errors"] += 1
        if is_corruption(e):
            self._index_corrupted(str(e))
        else:
            self._degrade(f"index error: {e}")

    def _index_corrupted(self, detail: str) -> None:
        with self._lock:
            self._counts["index_corrupt"] += 1
            if self._mode != "read_write":
                return
            self._set_mode("read_only", f"the index is corrupt ({detail}): no writes, no "
                           "repairs until a restart or `promptcache cache check --fix` "
                           "rebuilds it")

    def _set_mode(self, mode: str, reason: str, *, degraded: bool = True) -> None:
        """``read_only``: reads only (no write, no deletion, no repair); ``off``: an
        empty index in memory, every read a miss. Never changes back while open.
        ``degraded=False``: asked for (the CLI's inspection), not a failure."""
        self._mode, self._mode_reason = mode, reason
        if degraded:
            log.error("ssd tier %s: %s", "is off" if mode == "off" else "serves read-only",
                      reason)
            self._degraded_reason = reason
            self._retry_at = float("inf")

    def verify_index(self) -> bool:
        """``PRAGMA quick_check`` of the index file on a connection of its own (so no
        lock of the request path is held while it reads the whole file): a running
        server notices an index damaged under it. False (and the tier read-only,
        ``index_errors`` counted) if it is damaged. Never raises."""
        self._last_index_check = time.monotonic()
        if self._mode == "off" or self._closed_now():
            return True
        path = self.root / files.INDEX_NAME
        try:
            SSDIndex(path, durable=False, read_only=True).close()
        except IndexCorruptError as e:
            with self._lock:
                self._counts["index_errors"] += 1
            self._index_corrupted(str(e))
            return False
        except IndexOpenError as e:
            with self._lock:
                self._counts["index_errors"] += 1
            self._degrade(f"index check failed: {e}")
            return False
        return True

    def _closed_now(self) -> bool:
        return bool(getattr(self, "_closed", False))

    # -- deletion, capacity, TTL --------------------------------------------------------

    def _delete_where(self, select: Callable[[], list[tuple[bytes, str, int]]], *,
                      unlink: bool = True) -> list[tuple[bytes, str, int]]:
        """Select victims and delete their rows in one transaction, then unlink their
        files. Caller holds ``_write_lock``, the shared ``DirLock`` and ``_lock``.
        Raises sqlite3.Error (rolled back)."""
        self._index.begin()
        try:
            victims = select()
            if victims:
                self._index.delete(h for h, _, _ in victims)
            self._index.commit()
        except BaseException:
            self._index.rollback()
            raise
        if victims:
            self._unlink(victims, unlink=unlink)
        return victims

    def _unlink(self, victims: list[tuple[bytes, str, int]], *, unlink: bool) -> None:
        for _h, rel, _nbytes in victims:
            if unlink:
                try:
                    files.remove_file(self.root / rel)
                except OSError as e:  # left for reconcile as an orphan
                    log.warning("cannot remove %s: %s", rel, e)
        self._blocks, self._bytes = self._index.totals()

    def _enforce_capacity(self, keep: bytes | None = None, budget: int | None = None) -> int:
        """Delete blocks (of every process) until the folder's bytes fit ``budget``
        (default ``budget()``): least recently used unpinned blocks first; pinned
        blocks (``pin``) only when no unpinned block is left, the pin that ends first
        first (a pin never makes a write fail; counted ``evictions_pinned``). Counted
        ``evictions_disk`` when the disk, not ``budget_bytes``, set the budget. Never
        raises (an index error degrades the tier)."""
        evicted = 0
        if not self._writable():
            return 0
        if budget is None:
            budget = self.budget()
        counter = ("evictions_capacity" if budget >= self.config.budget_bytes
                   else "evictions_disk")
        now = self._clock()

        def victims() -> list[tuple[bytes, str, int]]:
            _, total = self._index.totals()
            out: list[tuple[bytes, str, int]] = []
            excess = total - budget
            if excess <= 0:
                return out
            pinned = 0
            for h, rel, size, is_pinned in self._index.lru(64, now):
                if excess <= 0:
                    break
                if h != keep:
                    out.append((h, rel, size))
                    excess -= size
                    pinned += is_pinned
            self._pinned_victims = pinned
            return out

        with self._write_lock, self._dirlock.shared(), self._lock:
            try:
                while True:
                    self._pinned_victims = 0
                    gone = self._delete_where(victims)
                    if not gone:
                        break
                    evicted += len(gone)
                    self._counts["evictions_pinned"] += self._pinned_victims
            except sqlite3.Error as e:
                self._index_error(e)
            self._counts[counter] += evicted
        return evicted

    @tier_errors
    def sweep(self) -> int:
        """Apply batched accesses, delete expired blocks, enforce the byte limit; every
        ``index_check_interval_s``, verify the index file (``verify_index``)."""
        self._last_sweep = time.monotonic()
        if self._last_sweep - self._last_index_check >= self._index_check_interval:
            self.verify_index()
        if not self._writable():
            with self._lock:
                self._touches.clear()
            return 0
        try:
            with self._write_lock, self._dirlock.shared(), self._lock:
                self._apply_touches()
                expired = self._delete_where(lambda: self._index.expired(self._clock()))
                self._counts["evictions_ttl"] += len(expired)
                self._refresh_totals()
                self._refresh_disk_cap()
            return len(expired) + self._enforce_capacity()
        except sqlite3.Error as e:
            with self._lock:
                self._index_error(e)
            return 0

    def _apply_touches(self) -> None:
        if not self._touches:
            return
        if not self._writable():
            self._touches.clear()
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

    @tier_errors
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
        if not hs or not self._writable():
            return 0
        with self._lock:
            until = self._clock() + float(seconds)
            try:
                self._index.begin()
                found = self._index.pin(hs, until)
                self._index.commit()
            except sqlite3.Error as e:
                self._index.rollback()
                self._index_error(e)
                raise TierError(f"ssd pin failed: {e}") from e
            for h in hs:
                if h not in found:
                    self._pins[h] = max(self._pins.get(h, 0.0), until)
            if len(self._pins) > MAX_EARLY_PINS:  # blocks that never came: oldest go
                now = self._clock()
                for h, t in sorted(self._pins.items(), key=lambda kv: kv[1]):
                    if len(self._pins) <= MAX_EARLY_PINS // 2 and t > now:
                        break
                    del self._pins[h]
            self._counts["pins"] += len(hs)
            return len(found)

    def _cancel_pending(self, match: Callable[[_Pending], bool]) -> set[bytes]:
        out = set()
        for h, p in list(self._pending.items()):
            if not p.cancelled and match(p):
                p.cancelled = True
                self._pins.pop(h, None)
                out.add(h)
                if not p.taken:
                    self._forget(p)
        return out

    @tier_errors
    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        """Remove the session from the blocks of ``tenant`` (None: every tenant); delete
        the blocks it leaves without a session. Returns the number deleted."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError("tenant must be a non-empty string or None")
        self._refuse_change("delete_session")
        with self._write_lock, self._dirlock.shared(), self._lock:
            for p in self._pending.values():
                if tenant is None or p.meta.tenant == tenant:
                    p.sessions.discard(session_id)
            cancelled = self._cancel_pending(
                lambda p: p.had_session and not p.sessions
                and (tenant is None or p.meta.tenant == tenant))
            try:
                orphaned = self._delete_where(
                    lambda: self._index.remove_session(session_id, tenant))
            except sqlite3.Error as e:
                self._index_error(e)
                raise TierError(f"ssd delete_session failed: {e}") from e
            return len(cancelled | {h for h, _, _ in orphaned})

    @tier_errors
    def discard(self, block_hashes: Iterable[BlockHash], *, ns: Namespace | None = None) -> int:
        """Delete these blocks (e.g. partial tails a longer sibling now covers), queued
        or stored. Returns the number deleted."""
        hs = {bytes(h) for h in block_hashes}
        if not hs:
            return 0
        self._refuse_change("discard")
        marks = ",".join("?" * len(hs))
        with self._write_lock, self._dirlock.shared(), self._lock:
            cancelled = self._cancel_pending(lambda p: bytes(p.meta.block_hash) in hs)
            try:
                victims = self._delete_where(
                    lambda: self._index.select_files(f"WHERE hash IN ({marks})", tuple(hs)))
            except sqlite3.Error as e:
                self._index_error(e)
                raise TierError(f"ssd discard failed: {e}") from e
            return len(cancelled | {h for h, _, _ in victims})

    @tier_errors
    def delete_tenant(self, tenant: str | None) -> int:
        return self.purge(tenant=tenant)

    @tier_errors
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
            params.append(self._clock() - older_than_s)
        where = ("WHERE " + " AND ".join(conds)) if conds else ""
        self._refuse_change("purge")
        with self._write_lock, self._dirlock.exclusive(), self._lock:
            self._apply_touches()
            cancelled: set[bytes] = set()
            if older_than_s is None:
                cancelled = self._cancel_pending(lambda p: tenant is None or p.meta.tenant == tenant)
            try:
                victims = self._delete_where(lambda: self._index.select_files(where, tuple(params)))
            except sqlite3.Error as e:
                self._index_error(e)
                raise TierError(f"ssd purge failed: {e}") from e
            return len(cancelled | {h for h, _, _ in victims})

    @tier_errors
    def stats(self) -> dict[str, Any]:
        with self._lock:
            if not getattr(self, "_closed", False):
                try:
                    self._refresh_totals()  # every process's blocks, not only ours
                except sqlite3.Error as e:
                    self._index_error(e)
            pinned = (0, 0)
            if not getattr(self, "_closed", False):
                try:
                    pinned = self._index.pinned(self._clock())
                except sqlite3.Error as e:
                    self._index_error(e)
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
                "encode_errors": c["encode_errors"],
                "unexpected_errors": c["unexpected_errors"],
                "index_errors": c["index_errors"],
                "index_corrupt": c["index_corrupt"],
                "io_errors": c["io_errors"],
                "evictions_capacity": c["evictions_capacity"],
                "evictions_disk": c["evictions_disk"],
                "disk_full": c["disk_full"],
                "evictions_ttl": c["evictions_ttl"],
                "evictions_pinned": c["evictions_pinned"],
                "pinned_blocks": pinned[0],
                "pinned_bytes": pinned[1],
                "blocks_on_disk": self._blocks,
                "bytes_on_disk": self._bytes,
                "budget_bytes": self.budget(),
                "config_budget_bytes": self.config.budget_bytes,
                "disk_free_bytes": self._disk_free,
                "disk_reserve_bytes": self._disk_reserve,
                "bytes_written": self._bytes_written,
                "bytes_written_today": self._today_bytes(),
                "queue_depth": len(self._pending),
                "read_ahead": dict(self._ahead.counts),
                "degraded": self._degraded_reason is not None,
                "degraded_reason": self._degraded_reason,
                "mode": self._mode,
                "mode_reason": self._mode_reason,
                "reload_latency_ms": {
                    "buckets": list(LATENCY_BUCKETS_MS),
                    "counts": list(self._latency),
                    "count": sum(self._latency),
                    "sum": round(self._latency_sum_ms, 3),
                },
            }
