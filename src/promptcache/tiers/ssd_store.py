"""Two parts of the SSD tier the others are given: ``Status`` (mode, degradation, counters, the
lock over them, the index connection, the queued blocks) and ``Catalog`` (the index and its
folder: totals kept by triggers, the byte budget capped by the disk, deletion, capacity,
batched accesses, early pins)."""

from __future__ import annotations

import functools
import logging
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from ..config import SSDConfig
from ..errors import TierError
from . import ssd_files as files
from . import ssd_segments as segments
from .ssd_index import SSDIndex
from .ssd_schema import IndexRow, is_corruption

log = logging.getLogger(__name__)

MAX_EARLY_PINS = 1 << 16  # pins kept for blocks that have no row yet
MAX_DISK_RESERVE = 1 << 30  # the default reserve: 5% of the disk, at most this

# ``shutil.disk_usage``'s (total, used, free) bytes of the file system holding a path
DiskUsage = tuple[int, int, int]
Victim = tuple[bytes, str, int]  # (hash, file, bytes) of a deleted row

_F = TypeVar("_F", bound=Callable[..., Any])


def tier_errors(fn: _F) -> _F:
    """The tier boundary: a public method lets only ``TierError`` out (bad input still
    raises ``ValueError``); an index or I/O error, or a bug, is counted and degrades."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        st: Status = self.status
        try:
            return fn(self, *args, **kwargs)
        except (TierError, ValueError):
            raise
        except sqlite3.Error as e:
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


class Status:
    """The mode (``read_write`` | ``read_only`` | ``off``), degradation and counters.
    ``lock`` guards them, the index connection and the queued blocks."""

    def __init__(self, *, clock: Callable[[], float], degraded_backoff_s: float) -> None:
        self.clock = clock
        self.backoff = degraded_backoff_s
        self.lock = threading.RLock()
        self.counts: Counter[str] = Counter()
        self.degraded_reason: str | None = None
        self.retry_at = 0.0
        self.closed = False
        self.mode = "read_write"
        self.mode_reason: str | None = None

    def degrade(self, reason: str) -> None:
        with self.lock:
            self.counts["io_errors"] += 1
            if self.degraded_reason is None:
                log.error("ssd tier degraded: %s", reason)
            self.degraded_reason = reason
            if self.retry_at != float("inf"):
                self.retry_at = self.clock() + self.backoff

    def backing_off(self) -> bool:
        return self.degraded_reason is not None and self.clock() < self.retry_at

    def recovered(self) -> None:
        """A write committed: a degradation that was not for good ends."""
        if self.degraded_reason is not None and self.retry_at != float("inf"):
            log.info("ssd tier recovered (was: %s)", self.degraded_reason)
            self.degraded_reason = None

    def writable(self) -> bool:
        """False in the read-only and off modes: nothing may change the folder."""
        return self.mode == "read_write"

    def refuse_change(self, what: str) -> None:
        if self.mode != "read_write":
            raise TierError(f"ssd {what}: the tier is {self.mode.replace('_', '-')} "
                            f"({self.mode_reason})")

    def index_error(self, e: sqlite3.Error) -> None:
        """Counted (``index_errors``); degrades the tier, or, if the index file is
        damaged, turns it read-only for good (a restart or ``cache check --fix``
        rebuilds it under the folder lock)."""
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
        """``read_only``: reads only; ``off``: an empty index in memory, every read a
        miss. Never changes back while open. ``degraded=False``: asked for."""
        self.mode, self.mode_reason = mode, reason
        if degraded:
            log.error("ssd tier %s: %s", "is off" if mode == "off" else "serves read-only",
                      reason)
            self.degraded_reason = reason
            self.retry_at = float("inf")


class Catalog:
    """The index and the folder it describes (``root``, the cross-process ``dirlock``).
    ``write_lock`` serializes file writes, deletions, sweeps and checks; the totals are
    the last read from the index (every process's blocks)."""

    def __init__(self, config: SSDConfig, status: Status, index: SSDIndex,
                 dirlock: files.DirLock, *, disk_usage: Callable[[Path], DiskUsage]) -> None:
        self.config = config
        self.status = status
        self.index = index
        self.dirlock = dirlock
        self.root = Path(config.path)
        self.disk_usage = disk_usage
        self.write_lock = threading.RLock()
        self.touches: dict[bytes, tuple[float, int]] = {}
        self.pins: dict[bytes, float] = {}  # pins of blocks not in the index yet
        self.blocks = self.bytes_stored = self.bytes_written = self.day_bytes = 0
        self.day = ""
        self.disk_cap: int | None = None  # None: not known (the disk could not be asked)
        self.disk_free: int | None = None
        self.disk_reserve = 0

    def live(self, row: IndexRow | None, now: float) -> bool:
        return row is not None and (row.expiry is None or row.expiry > now)

    def today(self) -> str:
        return time.strftime("%Y-%m-%d", time.gmtime(self.status.clock()))

    def today_bytes(self) -> int:
        """Bytes written today as of this process's last commit (the daily write
        budget's cheap estimate: never a query on the request path)."""
        day = self.today()
        if day != self.day:
            self.day, self.day_bytes = day, 0
        return self.day_bytes

    def add_written(self, size: int) -> None:
        day = self.today()
        self.bytes_written, self.day_bytes = self.index.add_written(size, day)
        self.day = day

    def refresh_totals(self) -> None:
        """Re-read the shared totals and write counters (caller holds the lock)."""
        self.blocks, self.bytes_stored = self.index.totals()
        day = self.today()
        self.bytes_written, self.day_bytes = self.index.written(day)
        self.day = day

    def budget(self) -> int:
        """The byte budget in use: ``config.budget_bytes`` capped by the disk."""
        cap = self.disk_cap
        return self.config.budget_bytes if cap is None else min(self.config.budget_bytes, cap)

    def refresh_disk_cap(self) -> None:
        """Ask the disk: cap = bytes stored + free - reserve. Never raises."""
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

    def eviction_counter(self) -> str:
        return ("evictions_capacity" if self.budget() >= self.config.budget_bytes
                else "evictions_disk")

    def delete_where(self, select: Callable[[], list[Victim]], *,
                     unlink: bool = True) -> list[Victim]:
        """Select victims and delete their rows in one transaction, then unlink their
        files. Caller holds ``write_lock``, the shared ``dirlock`` and the lock.
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
            if unlink:
                self.remove_files(rel for _h, rel, _n in victims)
            self.blocks, self.bytes_stored = self.index.totals()
        return victims

    def remove_files(self, rels: Iterable[str]) -> None:
        """Unlink the block files of deleted rows; a segment only once no row names it
        and no writer holds it (its other bytes are dead until then)."""
        segs = set()
        for rel in rels:
            if segments.is_segment(rel):
                segs.add(segments.split_ref(rel)[0])
                continue
            try:
                files.remove_file(self.root / rel)
            except OSError as e:  # left for reconcile as an orphan
                log.warning("cannot remove %s: %s", rel, e)
        for seg in sorted(segs):
            try:
                with self.status.lock:
                    named = self.index.names_segment(seg)
                if not named and not segments.in_use(self.root / seg):
                    files.remove_file(self.root / seg)
                    self.status.counts["segments_removed"] += 1
            except (OSError, sqlite3.Error) as e:  # left for reconcile as an orphan
                log.warning("cannot remove %s: %s", seg, e)

    def enforce_capacity(self, keep: bytes | None = None, budget: int | None = None) -> int:
        """Delete blocks (of every process) until the folder fits ``budget`` (default
        ``budget()``): least recently used unpinned blocks first, pinned ones (the pin
        that ends first first, counted ``evictions_pinned``) only when none is left.
        Never raises (an index error degrades the tier)."""
        st = self.status
        if not st.writable():
            return 0
        if budget is None:
            budget = self.budget()
        counter = ("evictions_capacity" if budget >= self.config.budget_bytes
                   else "evictions_disk")
        now = st.clock()
        evicted = 0
        pinned_victims = [0]  # pinned blocks in the last victim batch

        def victims() -> list[Victim]:
            _, total = self.index.totals()
            out: list[Victim] = []
            excess = total - budget
            pinned = 0
            for h, rel, size, is_pinned in self.index.lru(64, now) if excess > 0 else ():
                if excess <= 0:
                    break
                if h != keep:
                    out.append((h, rel, size))
                    excess -= size
                    pinned += is_pinned
            pinned_victims[0] = pinned
            return out

        with self.write_lock, self.dirlock.shared(), st.lock:
            try:
                while True:
                    pinned_victims[0] = 0
                    gone = self.delete_where(victims)
                    if not gone:
                        break
                    evicted += len(gone)
                    st.counts["evictions_pinned"] += pinned_victims[0]
            except sqlite3.Error as e:
                st.index_error(e)
            st.counts[counter] += evicted
        return evicted

    def make_room(self, keep: bytes, need: int) -> bool:
        """A write found the disk full (ENOSPC / EDQUOT, counted ``disk_full``): re-read
        the disk's free space (the budget in use shrinks to what the disk holds) and,
        if the disk really lacks the bytes, evict least recently used blocks until this
        block's ``need`` bytes fit (``evictions_disk``). True if something was evicted
        (worth one more try); False leaves the tier to degrade as for any write error."""
        with self.status.lock:
            self.status.counts["disk_full"] += 1
            try:
                self.blocks, self.bytes_stored = self.index.totals()
            except sqlite3.Error as e:
                self.status.index_error(e)
                return False
            self.refresh_disk_cap()
            free = self.disk_free
            if free is None or free >= need + self.disk_reserve:
                return False  # the disk has the bytes (inodes, quota?): evicting won't help
            target = max(0, min(self.budget(), self.bytes_stored - need))
        evicted = self.enforce_capacity(keep=keep, budget=target)
        log.warning("ssd disk full: %d block(s) evicted to make room for %d bytes",
                    evicted, need)
        return evicted > 0

    def touch(self, h: bytes, now: float) -> None:
        """Remember a hit (caller holds the lock); written by ``apply_touches``."""
        prev = self.touches.get(h)
        self.touches[h] = (now, (prev[1] if prev else 0) + 1)

    def apply_touches(self) -> None:
        if not self.touches:
            return
        if not self.status.writable():
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
            self.status.index_error(e)

    def add_pin(self, h: bytes, until: float) -> None:
        """A pin of a block with no row yet, applied when its row is committed."""
        self.pins[h] = max(self.pins.get(h, 0.0), until)
        if len(self.pins) > MAX_EARLY_PINS:  # blocks that never came: oldest go
            now = self.status.clock()
            for k, t in sorted(self.pins.items(), key=lambda kv: kv[1]):
                if len(self.pins) <= MAX_EARLY_PINS // 2 and t > now:
                    break
                del self.pins[k]
