"""The SSD tier's shared state (``SSDState``): the index, the locks, the pending
blocks, the counters, the mode, and what every part needs of them: degrading,
deleting rows and their files, capacity (LRU) and the batched accesses.

The budget in use (``budget()``) is the configured ``budget_bytes`` capped by the
disk: the bytes stored + the disk's free bytes - ``disk_reserve_bytes`` (asked at
open, at each sweep and after a write found the disk full), so a disk filled from
outside makes the tier evict its least recently used blocks (``evictions_disk``)
instead of failing its writes. ``SSDTier`` (``ssd.py``) composes the state with
its reader, writer and maintenance. Locking rules: see ``ssd.py``.

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..config import SSDConfig
from ..errors import TierError
from ..meta import BlockMeta
from . import ssd_files as files
from .base import PayloadSource
from .ssd_index import SSDIndex
from .ssd_schema import IndexRow, is_corruption

log = logging.getLogger(__name__)

LATENCY_BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0, 500.0, 1000.0)
MAX_EARLY_PINS = 1 << 16  # pins kept for blocks that have no row yet
MAX_DISK_RESERVE = 1 << 30  # the default reserve: 5% of the disk, at most this

# ``shutil.disk_usage``'s (total, used, free) bytes of the file system holding a path
DiskUsage = tuple[int, int, int]
DROP_REASONS = ("queue_full", "budget", "admission", "degraded", "write_budget", "closed",
                "read_only", "off")


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


_F = TypeVar("_F", bound=Callable[..., Any])


def tier_errors(fn: _F) -> _F:
    """The tier boundary: a public method lets only ``TierError`` out. An index or
    I/O error that the method did not turn into a degraded answer itself (or any
    other unexpected exception: a bug must not fail a request either) becomes a
    ``TierError`` and is counted; bad input still raises ``ValueError``."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        st: SSDState = self.state
        try:
            return fn(self, *args, **kwargs)
        except (TierError, ValueError):
            raise
        except sqlite3.Error as e:
            with st.lock:
                st.index_error(e)
            raise TierError(f"ssd {fn.__name__} failed: index error: {e}") from e
        except OSError as e:
            st.degrade(f"{fn.__name__} failed: {e}")
            raise TierError(f"ssd {fn.__name__} failed: {e}") from e
        except Exception as e:
            log.exception("ssd %s: unexpected error", fn.__name__)
            with st.lock:
                st.counts["unexpected_errors"] += 1
            raise TierError(f"ssd {fn.__name__} failed unexpectedly: {e!r}") from e

    return wrapper  # type: ignore[return-value]


class SSDState:
    """What the SSD tier's parts share (see the module docstring). ``index`` is set by
    the opener (``ssd_open``); the totals are the last ones read from the index
    (every process's blocks), with the shared write counters."""

    index: SSDIndex

    def __init__(self, config: SSDConfig, *, clock: Callable[[], float],
                 degraded_backoff_s: float, disk_usage: Callable[[Path], DiskUsage]) -> None:
        self.config = config
        self.root = Path(config.path)
        self.clock = clock
        self.backoff = degraded_backoff_s
        self.disk_usage = disk_usage
        self.lock = threading.RLock()
        self.write_lock = threading.RLock()
        self.dirlock = files.DirLock(None)
        self.pending: dict[bytes, Pending] = {}
        self.pending_bytes = 0
        self.touches: dict[bytes, tuple[float, int]] = {}
        self.pins: dict[bytes, float] = {}  # pins of blocks not in the index yet (applied at commit)
        self.counts: Counter[str] = Counter()
        self.drops: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self.latency = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.latency_sum_ms = 0.0
        self.degraded_reason: str | None = None
        self.retry_at = 0.0
        self.closed = False
        self.mode = "read_write"  # read_write | read_only | off (see set_mode)
        self.mode_reason: str | None = None
        self.blocks = self.bytes_stored = self.bytes_written = self.day_bytes = 0
        self.day = ""
        self.disk_cap: int | None = None  # None: not known (the disk could not be asked)
        self.disk_free: int | None = None
        self.disk_reserve = 0
        self.index_rebuilt = False
        self.index_corrupt = False  # the CLI's read-only open found the index unusable
        self.set_aside = 0
        self.recovered = 0

    def live(self, row: IndexRow | None, now: float) -> bool:
        return row is not None and (row.expiry is None or row.expiry > now)

    def today(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.clock()))

    def today_bytes(self) -> int:
        """Bytes written today (as of this process's last commit: a cheap estimate for
        the daily write budget, never a query on the request path)."""
        day = self.today()
        if day != self.day:
            self.day, self.day_bytes = day, 0
        return self.day_bytes

    def refresh_totals(self) -> None:
        """Re-read the shared totals and write counters (caller holds ``_lock``)."""
        self.blocks, self.bytes_stored = self.index.totals()
        day = self.today()
        self.bytes_written, self.day_bytes = self.index.written(day)
        self.day = day

    def budget(self) -> int:
        """The byte budget in use: ``config.budget_bytes`` capped by the disk."""
        cap = self.disk_cap
        return self.config.budget_bytes if cap is None else min(self.config.budget_bytes, cap)

    def refresh_disk_cap(self) -> None:
        """Ask the disk (``statvfs``): cap = bytes stored + free - reserve. Caller holds
        ``_lock`` (the stored bytes are the last totals read). Never raises."""
        try:
            total, _used, free = self.disk_usage(self.root)
        except OSError as e:
            log.debug("ssd: cannot read the disk usage of %s: %s", self.root, e)
            return
        reserve = self.config.disk_reserve_bytes
        if reserve is None:
            reserve = min(MAX_DISK_RESERVE, int(total) // 20)
        self.disk_reserve = reserve
        self.disk_free = int(free)
        cap = max(0, self.bytes_stored + int(free) - reserve)
        if cap < self.config.budget_bytes and (self.disk_cap is None
                                               or self.disk_cap >= self.config.budget_bytes):
            log.warning("ssd budget capped by the disk: %d bytes (configured %d; %d free, "
                        "%d kept free)", cap, self.config.budget_bytes, free, reserve)
        self.disk_cap = cap

    def forget(self, p: Pending) -> None:
        h = bytes(p.meta.block_hash)
        if self.pending.get(h) is p:
            del self.pending[h]
            self.pending_bytes -= p.nbytes

    def degrade(self, reason: str) -> None:
        with self.lock:
            self.counts["io_errors"] += 1
            if self.degraded_reason is None:
                log.error("ssd tier degraded: %s", reason)
            self.degraded_reason = reason
            if self.retry_at != float("inf"):
                self.retry_at = self.clock() + self.backoff

    def writable(self) -> bool:
        """False in the read-only and off modes: nothing may change the folder."""
        return self.mode == "read_write"

    def refuse_change(self, what: str) -> None:
        if self.mode != "read_write":
            raise TierError(f"ssd {what}: the tier is {self.mode.replace('_', '-')} "
                            f"({self.mode_reason})")

    def index_error(self, e: sqlite3.Error) -> None:
        """Every SQLite error is counted (``index_errors``) and degrades the tier; one
        that says the index file is damaged turns the tier read-only for good (a
        restart, or ``promptcache cache check --fix``, rebuilds the index under the
        folder lock)."""
        with self.lock:
            self.counts["index_errors"] += 1
        if is_corruption(e):
            self.index_corrupted(str(e))
        else:
            self.degrade(f"index error: {e}")

    def index_corrupted(self, detail: str) -> None:
        with self.lock:
            self.counts["index_corrupt"] += 1
            if self.mode != "read_write":
                return
            self.set_mode("read_only", f"the index is corrupt ({detail}): no writes, no "
                           "repairs until a restart or `promptcache cache check --fix` "
                           "rebuilds it")

    def set_mode(self, mode: str, reason: str, *, degraded: bool = True) -> None:
        """``read_only``: reads only (no write, no deletion, no repair); ``off``: an
        empty index in memory, every read a miss. Never changes back while open.
        ``degraded=False``: asked for (the CLI's inspection), not a failure."""
        self.mode, self.mode_reason = mode, reason
        if degraded:
            log.error("ssd tier %s: %s", "is off" if mode == "off" else "serves read-only",
                      reason)
            self.degraded_reason = reason
            self.retry_at = float("inf")

    # -- deletion, capacity, TTL --------------------------------------------------------

    def delete_where(self, select: Callable[[], list[tuple[bytes, str, int]]], *,
                      unlink: bool = True) -> list[tuple[bytes, str, int]]:
        """Select victims and delete their rows in one transaction, then unlink their
        files. Caller holds ``write_lock``, the shared ``DirLock`` and ``lock``.
        Raises sqlite3.Error (rolled back)."""
        self.index.begin()
        try:
            victims = select()
            if victims:
                self.index.delete(h for h, _, _ in victims)
            self.index.commit()
        except BaseException:
            self.index.rollback()
            raise
        if victims:
            self.unlink(victims, unlink=unlink)
        return victims

    def unlink(self, victims: list[tuple[bytes, str, int]], *, unlink: bool) -> None:
        for _h, rel, _nbytes in victims:
            if unlink:
                try:
                    files.remove_file(self.root / rel)
                except OSError as e:  # left for reconcile as an orphan
                    log.warning("cannot remove %s: %s", rel, e)
        self.blocks, self.bytes_stored = self.index.totals()

    def enforce_capacity(self, keep: bytes | None = None, budget: int | None = None) -> int:
        """Delete blocks (of every process) until the folder's bytes fit ``budget``
        (default ``budget()``): least recently used unpinned blocks first; pinned
        blocks (``pin``) only when no unpinned block is left, the pin that ends first
        first (a pin never makes a write fail; counted ``evictions_pinned``). Counted
        ``evictions_disk`` when the disk, not ``budget_bytes``, set the budget. Never
        raises (an index error degrades the tier)."""
        evicted = 0
        if not self.writable():
            return 0
        if budget is None:
            budget = self.budget()
        counter = ("evictions_capacity" if budget >= self.config.budget_bytes
                   else "evictions_disk")
        now = self.clock()
        pinned_victims = [0]  # pinned blocks in the last victim batch

        def victims() -> list[tuple[bytes, str, int]]:
            _, total = self.index.totals()
            out: list[tuple[bytes, str, int]] = []
            excess = total - budget
            if excess <= 0:
                return out
            pinned = 0
            for h, rel, size, is_pinned in self.index.lru(64, now):
                if excess <= 0:
                    break
                if h != keep:
                    out.append((h, rel, size))
                    excess -= size
                    pinned += is_pinned
            pinned_victims[0] = pinned
            return out

        with self.write_lock, self.dirlock.shared(), self.lock:
            try:
                while True:
                    pinned_victims[0] = 0
                    gone = self.delete_where(victims)
                    if not gone:
                        break
                    evicted += len(gone)
                    self.counts["evictions_pinned"] += pinned_victims[0]
            except sqlite3.Error as e:
                self.index_error(e)
            self.counts[counter] += evicted
        return evicted

    def apply_touches(self) -> None:
        if not self.touches:
            return
        if not self.writable():
            self.touches.clear()
            return
        batch = [(h, when, n, self.config.ttl_seconds) for h, (when, n) in self.touches.items()]
        self.touches.clear()
        try:
            self.index.begin()
            self.index.touch(batch)
            self.index.commit()
        except sqlite3.Error as e:
            self.index.rollback()
            self.index_error(e)

    def cancel_pending(self, match: Callable[[Pending], bool]) -> set[bytes]:
        out = set()
        for h, p in list(self.pending.items()):
            if not p.cancelled and match(p):
                p.cancelled = True
                self.pins.pop(h, None)
                out.add(h)
                if not p.taken:
                    self.forget(p)
        return out
