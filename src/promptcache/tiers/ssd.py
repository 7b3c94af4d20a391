"""The SSD tier: a crash-safe, persistent, content-addressed block store that
several live processes may share.

``put(meta, payload, sessions=(), hits=None, *, timeout=0.0)`` enqueues the block
(bytes, or a ``PayloadSource`` the writer thread encodes) on a bounded queue
drained by one writer thread. With ``timeout=0`` (the request path) a full queue
refuses at once (counted ``queue_full``; the cache keeps such a block in RAM and
offers it again, see ``cache_lower``); a positive or None ``timeout`` waits for
room (back-pressure). The write itself is in ``ssd_write``: temp file -> fsync ->
publish under a free name -> fsync folder -> commit of the index row, so after a
crash (even SIGKILL) every row names a complete file; reconcile at startup
removes what a crash left behind (and only that: a live writer's temp files stay).
``get`` verifies size and checksum and quarantines a bad file. Metadata queries
(``get_meta``, ``children``) read only the SQLite index (and the blocks queued).

Failures degrade, they never propagate: every public method lets only
``TierError`` out (``ssd_store.tier_errors``); an ``OSError`` while writing marks
the tier degraded (``stats()["degraded"]``) and puts are refused until a backoff
has passed; ``get`` raises only ``TierError`` / ``CorruptBlockError``. ``hits`` is
the block's hit count as the policy knows it, used by the ``admission_min_hits``
rule (None counts as 0).

Repairs only under the folder's exclusive lock: a folder whose ``lock`` cannot be
opened is served read-only (``mode`` ``read_only``: reads, no write, no deletion, no
reconcile); a folder that cannot be written, or whose index cannot be opened (or is
corrupt while the lock is missing), is ``off`` (an empty index in memory; the files
are left as they are). A corrupt index is rebuilt only under the exclusive lock, and
the block files it described are set aside in quarantine, never deleted.
``read_only=True`` (the CLI's inspections) opens the folder without changing it.

Thread safety: every public method may be called from any thread. Lock order:
``_write_lock`` (serializes file writes, deletions, sweeps and checks), then the
folder's ``DirLock`` (shared for changes, exclusive for repair and purge, across
processes), then ``_lock`` (guards the index connection, the pending map and the
counters).
"""

from __future__ import annotations

import bisect
import logging
import os
import shutil
import sqlite3
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from ..codec import checksum_matches
from ..config import SSDConfig
from ..errors import CorruptBlockError, TierError
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from . import ssd_files as files
from .ssd_check import CheckReport, reconcile
from .ssd_index import IndexRow
from .ssd_open import SSDOpener
from .ssd_queue import WriteQueue
from .ssd_store import DROP_REASONS, LATENCY_BUCKETS_MS, DiskUsage, _Pending, tier_errors
from .ssd_write import STOP, SSDWriter

log = logging.getLogger(__name__)

PREFETCH_CHILDREN = 4
# Blocks of a chain read and verified ahead of the caller (see ssd_files.ReadAhead).
READ_AHEAD_BLOCKS = 4
READ_WORKERS = 4
# Blocks after those whose files the kernel is asked to start reading (WILLNEED).
HINT_BLOCKS = 8
_FADV_WILLNEED: int | None = getattr(os, "POSIX_FADV_WILLNEED", None)
# How often the writer thread verifies the whole index file (``verify_index``).
INDEX_CHECK_INTERVAL_S = 300.0


class SSDTier(SSDWriter, SSDOpener):
    """See the module docstring. ``clock`` returns wall-clock seconds (tests fake it)."""


    def __init__(
        self,
        config: SSDConfig,
        *,
        clock: Callable[[], float] = time.time,
        sweep_interval_s: float = 10.0,
        degraded_backoff_s: float = 5.0,
        reconcile_on_open: bool = True,
        read_ahead_blocks: int = READ_AHEAD_BLOCKS,
        read_only: bool = False,
        disk_usage: Callable[[Path], DiskUsage] = shutil.disk_usage,
        index_check_interval_s: float = INDEX_CHECK_INTERVAL_S,
    ) -> None:
        if read_ahead_blocks < 0:
            raise ValueError(f"read_ahead_blocks must be >= 0, got {read_ahead_blocks}")
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
        self._pins: dict[bytes, float] = {}
        self._pinned_victims = 0
        self._counts: Counter[str] = Counter()
        self._drops: Counter[str] = Counter({r: 0 for r in DROP_REASONS})
        self._latency = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self._latency_sum_ms = 0.0
        self._degraded_reason: str | None = None
        self._retry_at = 0.0
        self._closed = False
        self._read_ahead_blocks = read_ahead_blocks
        self._ahead = files.ReadAhead(
            workers=min(max(1, read_ahead_blocks), READ_WORKERS), max_blocks=max(1, read_ahead_blocks)
        )
        self._kids_memo: dict[bytes, tuple[float, list[tuple[bytes, str, int, str, float | None]]]] = {}
        self._hinted: dict[bytes, float] = {}
        self._disk_usage = disk_usage
        self._index_check_interval = index_check_interval_s
        self._last_index_check = time.monotonic()
        self._disk_cap: int | None = None
        self._disk_free: int | None = None
        self._disk_reserve = 0
        self._index_rebuilt = False
        self._index_corrupt = False
        self._set_aside = 0
        self._recovered = 0
        self._mode = "read_write"
        self._mode_reason: str | None = None
        self._dirlock = files.DirLock(None)
        self._index = self._open_index(read_only)
        self._blocks = self._bytes = self._bytes_written = self._day_bytes = 0
        self._day = ""
        try:
            self._refresh_totals()
        except sqlite3.Error as e:
            self._index_error(e)
        if self._mode != "off":
            self._refresh_disk_cap()
        self.startup_report: CheckReport | None = None
        if reconcile_on_open and self._mode == "read_write":
            try:
                self.startup_report = self.check(fix=True)
            except TierError as e:  # counted and degraded by check; serving goes on
                log.error("ssd startup check failed: %s", e)
            self._enforce_capacity()  # a smaller budget, or a fuller disk, than last time
        self._queue = WriteQueue(config.queue_size)
        self._last_sweep = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="promptcache-ssd-writer", daemon=True)
        self._thread.start()

    # -- metadata queries (index only) -------------------------------------------

    def _live(self, row: IndexRow | None, now: float) -> bool:
        return row is not None and (row.expiry is None or row.expiry > now)

    @tier_errors
    def get_metas(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                  ) -> list[BlockMeta | None]:
        """``get_meta`` of each hash: queued blocks, then the index (one query per 500)."""
        hs = [bytes(h) for h in block_hashes]
        out: list[BlockMeta | None] = [None] * len(hs)
        rows: dict[bytes, IndexRow] = {}
        with self._lock:
            ask = []
            for i, h in enumerate(hs):
                p = self._pending.get(h)
                if p is not None and not p.cancelled:
                    out[i] = p.meta
                else:
                    ask.append(h)
            try:
                for k in range(0, len(ask), 500):
                    chunk = tuple(ask[k:k + 500])
                    where = f"WHERE hash IN ({','.join('?' * len(chunk))})"
                    for row in self._index.iter_rows(where, chunk):
                        rows[bytes(row.meta.block_hash)] = row
            except sqlite3.Error as e:
                self._index_error(e)
                return out
        now = self._clock()
        for i, h in enumerate(hs):
            got = rows.get(h)
            if out[i] is None and got is not None and self._live(got, now):
                out[i] = got.meta
        return out

    @tier_errors
    def get_meta(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> BlockMeta | None:
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

    @tier_errors
    def children(self, parent_hash: BlockHash, *, ns: Namespace | None = None
                 ) -> list[BlockMeta]:
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

    @tier_errors
    def sessions_of(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> list[str]:
        with self._lock:
            p = self._pending.get(bytes(block_hash))
            if p is not None and not p.cancelled:
                return sorted(p.sessions)
            return self._index.sessions_of(bytes(block_hash))

    @tier_errors
    def rows(self, tenant: str | None = None) -> list[IndexRow]:
        """Index rows (for the CLI and tests), most recently used first."""
        where, params = ("WHERE tenant=?", (tenant,)) if tenant is not None else ("", ())
        with self._lock:
            return list(self._index.iter_rows(where + " ORDER BY last_access DESC, hash", params))

    @tier_errors
    def sessions(self, tenant: str | None = None) -> list[tuple[str, str, int, int, float]]:
        """``(tenant, session, blocks, bytes, last use)`` per session (``last use``: the
        latest access of its blocks, wall-clock seconds), most recently used first."""
        with self._lock:
            return self._index.sessions(tenant)

    @tier_errors
    def tenants(self) -> list[tuple[str, int, int]]:
        with self._lock:
            return self._index.tenants()

    # -- read path --------------------------------------------------------------------

    @tier_errors
    def get(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> bytes | None:
        h = bytes(block_hash)
        t0 = time.perf_counter()
        with self._lock:
            p = self._pending.get(h)
            if p is not None and not p.cancelled:
                self._counts["hits"] += 1
                self._counts["pending_hits"] += 1
                source = p.source
            else:
                source = None
                try:
                    row = self._index.get(h)
                except sqlite3.Error as e:
                    self._index_error(e)
                    raise TierError(f"ssd index unavailable: {e}") from e
        if source is not None:  # queued, not written yet: encoded here if the writer has not
            try:
                return source.encode()
            except Exception as e:
                raise TierError(f"ssd block {h.hex()[:16]}: cannot encode the queued payload: {e}") from e
        now = self._clock()
        for _attempt in range(3):
            if row is None or not self._live(row, now):
                with self._lock:
                    self._counts["misses"] += 1
                return None
            path = self.root / row.file_name
            self._prefetch_children(h, now)  # the next blocks' reads overlap this one
            ahead = self._ahead.take(h, path, row.file_name, row.checksum)
            if ahead is not None:  # verified against this row's checksum by the reader
                self._record_hit(h, now, (time.perf_counter() - t0) * 1000.0)
                return ahead
            try:
                with open(path, "rb", buffering=0) as f:
                    if _FADV_WILLNEED is not None:  # the whole file in one go
                        os.posix_fadvise(f.fileno(), 0, 0, _FADV_WILLNEED)
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
            if len(data) != row.file_bytes or not checksum_matches(data, row.checksum):
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

    def _prefetch_children(self, h: bytes, now: float) -> None:
        """A restore walks a chain: along it (while a block has exactly one live
        child), read and verify the next ``read_ahead_blocks`` blocks on worker
        threads and ask the kernel (``posix_fadvise(WILLNEED)``) to start reading
        the files of the ``HINT_BLOCKS`` after them, so the disk always has reads
        queued; at a fork, hint every child. Hints only: a wrong guess costs a read."""
        try:
            cur = h
            for depth in range(self._read_ahead_blocks + HINT_BLOCKS):
                kids = self._live_kids(cur, now)
                if len(kids) != 1:
                    for kid in kids:
                        self._willneed(kid[0], kid[1])
                    return
                kh, rel, size, digest, _expiry = kids[0]
                if depth < self._read_ahead_blocks:
                    if kh not in self._ahead:
                        self._ahead.schedule(kh, self.root / rel, rel, size, digest)
                else:
                    self._willneed(kh, rel)
                cur = kh
        except OSError:  # a hint only
            pass
        except sqlite3.Error as e:  # a hint only, but never a silent index error
            self._index_error(e)

    def _live_kids(self, h: bytes, now: float) -> list[tuple[bytes, str, int, str, float | None]]:
        """``child_reads`` of ``h`` (unexpired), remembered for a second: consecutive
        gets walk overlapping stretches of the chain."""
        t = time.monotonic()
        hit = self._kids_memo.get(h)
        if hit is not None and t - hit[0] < 1.0:
            kids = hit[1]
        else:
            with self._lock:
                kids = self._index.child_reads(h, limit=PREFETCH_CHILDREN)
            if len(self._kids_memo) >= 1024:
                self._kids_memo.clear()
            self._kids_memo[h] = (t, kids)
        return [k for k in kids if k[4] is None or k[4] > now]

    def _willneed(self, h: bytes, rel: str) -> None:
        t = time.monotonic()
        if _FADV_WILLNEED is None or t - self._hinted.get(h, float("-inf")) < 2.0:
            return
        if len(self._hinted) >= 1024:
            self._hinted.clear()
        self._hinted[h] = t
        self._ahead.hint(self.root / rel)

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
        if not self._writable():  # nothing may change the folder: a miss, counted
            with self._lock:
                self._counts["corrupt"] += 1
                self._counts["misses"] += 1
            log.warning("ssd block %s unreadable (%s); %s tier: left as it is", h.hex()[:16],
                        reason or "missing file", self._mode)
            return

        def still_this_row() -> list[tuple[bytes, str, int]]:
            cur = self._index.get(h)  # (in the deleting transaction: no other writer now)
            if cur is None or cur.file_name != row.file_name or cur.checksum != row.checksum:
                return []
            return [(h, row.file_name, row.file_bytes)]

        with self._write_lock, self._dirlock.shared(), self._lock:
            try:
                if not self._delete_where(still_this_row, unlink=False):
                    return
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

    # -- maintenance, stats, lifecycle ----------------------------------------------------

    @tier_errors
    def check(self, fix: bool = False,
              progress: Callable[[int, int], None] | None = None) -> CheckReport:
        """Compare index and files (see ``ssd_check``). Waits for queued writes first.
        ``progress(done, total)`` follows the index rows checked."""
        if not self._closed and hasattr(self, "_thread"):
            self.flush()
        refused = None
        if fix and self._mode != "read_write":
            refused = f"no repair: the tier is {self._mode.replace('_', '-')} ({self._mode_reason})"
            log.error("ssd check: %s", refused)
            fix = False
        with self._write_lock, self._dirlock.exclusive(), self._lock:
            try:
                report = reconcile(self.root, self._index, fix=fix, progress=progress,
                                   trust_index=self._mode != "off")
                if self._mode != "off":
                    self._refresh_totals()
            except sqlite3.Error as e:
                self._index_error(e)
                raise TierError(f"ssd check failed: {e}") from e
            report.index_rebuilt, self._index_rebuilt = self._index_rebuilt, False
            report.set_aside_files, self._set_aside = self._set_aside, 0
            report.recovered_blocks, self._recovered = self._recovered, 0
            report.index_corrupt = self._index_corrupt
            report.refused = refused
        return report

    @tier_errors
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped); apply batched accesses.
        False if the queue did not drain within ``timeout`` seconds (None: no limit)."""
        if not self._queue.join(timeout):
            return False
        with self._write_lock, self._lock:
            self._apply_touches()
        return True

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._queue.put(STOP, force=True)
        self._thread.join()
        self._ahead.close()
        with self._write_lock, self._lock:
            self._apply_touches()
            self._index.close()
            self._dirlock.close()

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[IndexRow]:
        return iter(self.rows())
