"""The SSD tier: a crash-safe, persistent, content-addressed block store that
several live processes may share.

``put(meta, payload, sessions=(), hits=None, *, timeout=0.0)`` enqueues the block
(bytes, or a ``PayloadSource`` the writer thread encodes) on a bounded queue
drained by one writer thread. With ``timeout=0`` (the request path) a full queue
refuses at once (counted ``queue_full``; the cache keeps such a block in RAM and
offers it again, see ``cache.lower``); a positive or None ``timeout`` waits for
room (back-pressure). The write itself is in ``ssd_write``: temp file -> fsync ->
publish under a free name -> fsync folder -> commit of the index row (what is queued
together, a shutdown's persist, is written together: files in parallel, each folder
fsynced once, the rows in one transaction), so after a crash (even SIGKILL) every
row names a complete file; reconcile at startup
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
opened, or that cannot be written (a read-only file system, permissions), is served
read-only (``mode`` ``read_only``: reads, no write (refused and counted), no deletion,
no reconcile); a folder that cannot be created, or whose index cannot be opened (or is
corrupt while the lock is missing), is ``off`` (an empty index in memory; the files
are left as they are). A corrupt index is rebuilt only under the exclusive lock, and
the block files it described are set aside in quarantine, never deleted.
``read_only=True`` (the CLI's inspections) opens the folder without changing it.

Composition: ``SSDTier`` holds an ``SSDState`` (``ssd_store``: the index, the locks,
the pending blocks, the counters and the mode) opened by ``ssd_open``, and the parts
that work on it, each given it explicitly: a ``Reader`` (``ssd_read``), a ``Writer``
(``ssd_write``: ``put`` and the writer thread) and a ``Maintenance`` (``ssd_maint``:
sweeps, pins, deletions); the tier delegates to them at its boundary (``tier_errors``).

Thread safety: every public method may be called from any thread. Lock order:
``write_lock`` (serializes file writes, deletions, sweeps and checks), then the
folder's ``DirLock`` (shared for changes, exclusive for repair and purge, across
processes), then ``lock`` (guards the index connection, the pending map and the
counters).
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..config import SSDConfig
from ..errors import TierError
from ..hashing import BlockHash
from ..meta import BlockMeta, Namespace
from .base import PayloadSource
from .ssd_check import CheckReport, reconcile
from .ssd_index import SSDIndex
from .ssd_maint import Maintenance
from .ssd_open import open_index
from .ssd_queue import WriteQueue
from .ssd_read import Reader
from .ssd_schema import IndexRow
from .ssd_store import LATENCY_BUCKETS_MS, DiskUsage, SSDState, tier_errors
from .ssd_write import STOP, Writer

log = logging.getLogger(__name__)

# Blocks of a chain read and verified ahead of the caller (see ssd_ahead.ReadAhead).
READ_AHEAD_BLOCKS = 4
# How often the writer thread verifies the whole index file (``verify_index``).
INDEX_CHECK_INTERVAL_S = 300.0


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
        read_ahead_blocks: int = READ_AHEAD_BLOCKS,
        read_only: bool = False,
        disk_usage: Callable[[Path], DiskUsage] = shutil.disk_usage,
        index_check_interval_s: float = INDEX_CHECK_INTERVAL_S,
    ) -> None:
        if read_ahead_blocks < 0:
            raise ValueError(f"read_ahead_blocks must be >= 0, got {read_ahead_blocks}")
        self.policy = config.policy
        self.root = Path(config.path)
        st = self.state = SSDState(config, clock=clock, degraded_backoff_s=degraded_backoff_s,
                                   disk_usage=disk_usage)
        self.reader = Reader(st, read_ahead_blocks=read_ahead_blocks)
        self.maint = Maintenance(st, sweep_interval_s=sweep_interval_s,
                                 index_check_interval_s=index_check_interval_s)
        # (tests hold the write lock, and read the early pins and the read-ahead)
        self._write_lock, self._pins, self._ahead = st.write_lock, st.pins, self.reader.ahead
        st.index = open_index(st, read_only)
        try:
            with st.lock:
                st.refresh_totals()
        except sqlite3.Error as e:
            st.index_error(e)
        if st.mode != "off":
            st.refresh_disk_cap()
        self.startup_report: CheckReport | None = None
        if reconcile_on_open and st.mode == "read_write":
            try:
                self.startup_report = self.check(fix=True)
            except TierError as e:  # counted and degraded by check; serving goes on
                log.error("ssd startup check failed: %s", e)
            st.enforce_capacity()  # a smaller budget, or a fuller disk, than last time
        self._queue = WriteQueue(config.queue_size)
        self.writer = Writer(st, self._queue, maintain=self._maintain,
                             poll_s=max(0.05, sweep_interval_s / 4))
        self.maint.last_sweep = time.monotonic()
        self._thread = threading.Thread(target=self.writer.run, name="promptcache-ssd-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def config(self) -> SSDConfig:
        """The configuration in use (replacing it, e.g. a smaller budget, takes effect)."""
        return self.state.config

    @config.setter
    def config(self, config: SSDConfig) -> None:
        self.state.config = config

    # (tests swap the index for a failing one, and shorten the index check interval)
    @property
    def _index(self) -> SSDIndex:
        return self.state.index

    @_index.setter
    def _index(self, index: SSDIndex) -> None:
        self.state.index = index

    @property
    def _index_check_interval(self) -> float:
        return self.maint.index_check_interval

    @_index_check_interval.setter
    def _index_check_interval(self, seconds: float) -> None:
        self.maint.index_check_interval = seconds

    # -- reads (Reader) -------------------------------------------------------------------

    @tier_errors
    def get_metas(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                  ) -> list[BlockMeta | None]:
        """``get_meta`` of each hash: queued blocks, then the index (one query per 500)."""
        return self.reader.get_metas(block_hashes)

    @tier_errors
    def get_meta(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> BlockMeta | None:
        return self.reader.get_meta(block_hash)

    @tier_errors
    def children(self, parent_hash: BlockHash, *, ns: Namespace | None = None
                 ) -> list[BlockMeta]:
        return self.reader.children(parent_hash)

    @tier_errors
    def sessions_of(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> list[str]:
        return self.reader.sessions_of(block_hash)

    @tier_errors
    def rows(self, tenant: str | None = None) -> list[IndexRow]:
        """Index rows (for the CLI and tests), most recently used first."""
        return self.reader.rows(tenant)

    @tier_errors
    def sessions(self, tenant: str | None = None) -> list[tuple[str, str, int, int, float]]:
        """``(tenant, session, blocks, bytes, last use)`` per session (``last use``: the
        latest access of its blocks, wall-clock seconds), most recently used first."""
        return self.reader.sessions(tenant)

    @tier_errors
    def tenants(self) -> list[tuple[str, int, int]]:
        return self.reader.tenants()

    @tier_errors
    def get(self, block_hash: BlockHash, *, ns: Namespace | None = None) -> bytes | None:
        """The verified payload (None if absent); ``CorruptBlockError`` if damaged."""
        return self.reader.get(block_hash)

    def get_many(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                 ) -> list[tuple[bytes, list[str]] | TierError | None]:
        """``(payload, sessions)`` of a chain's run of blocks (None where absent; a
        block's own error, counted as ``get`` counts it, in its place), so the cache
        makes their arrays at once. The files are read as ``get`` reads them, the next
        blocks' reads ahead overlapping each one."""
        out: list[tuple[bytes, list[str]] | TierError | None] = []
        for h in block_hashes:
            try:
                data = self.get(h, ns=ns)
                out.append(None if data is None else (data, self.sessions_of(h, ns=ns)))
            except TierError as e:
                out.append(e)
        return out

    # -- writes (Writer) ------------------------------------------------------------------

    @tier_errors
    def put(self, meta: BlockMeta, payload: bytes | PayloadSource, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        return self.writer.put(meta, payload, sessions, hits, timeout=timeout)

    @tier_errors
    def has_room(self, timeout: float | None = 0.0) -> bool:
        """True if a put that does not wait would find room in the write queue."""
        return self.writer.has_room(timeout)

    @tier_errors
    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        self.writer.add_sessions(block_hash, sessions)

    def budget(self) -> int:
        """The byte budget in use: ``config.budget_bytes`` capped by the disk."""
        return self.state.budget()

    # -- maintenance (Maintenance) --------------------------------------------------------

    def _maintain(self) -> None:
        if self.maint.sweep_due():
            self.sweep()

    def verify_index(self) -> bool:
        """Check the index file (``PRAGMA quick_check``); never raises."""
        return self.maint.verify_index()

    @tier_errors
    def sweep(self) -> int:
        """Apply batched accesses, delete expired blocks, enforce the byte limit; every
        ``index_check_interval_s``, verify the index file (``verify_index``)."""
        return self.maint.sweep(self.verify_index)

    @tier_errors
    def pin(self, block_hashes: Iterable[BlockHash], seconds: float) -> int:
        """Retain these blocks for ``seconds`` (see ``Maintenance.pin``); returns the
        number of stored blocks pinned now."""
        return self.maint.pin(block_hashes, seconds)

    @tier_errors
    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        return len(self.maint.delete_session(session_id, tenant))

    @tier_errors
    def delete_session_blocks(self, session_id: str, tenant: str | None = None
                              ) -> set[bytes]:
        return self.maint.delete_session(session_id, tenant)

    @tier_errors
    def discard(self, block_hashes: Iterable[BlockHash], *, ns: Namespace | None = None) -> int:
        return self.maint.discard(block_hashes)

    @tier_errors
    def delete_tenant(self, tenant: str | None) -> int:
        return self.maint.purge(tenant=tenant)

    @tier_errors
    def purge(self, *, tenant: str | None = None, older_than_s: float | None = None) -> int:
        return self.maint.purge(tenant=tenant, older_than_s=older_than_s)

    @tier_errors
    def stats(self) -> dict[str, Any]:
        st = self.state
        with st.lock:
            if not st.closed:
                try:
                    st.refresh_totals()  # every process's blocks, not only ours
                except sqlite3.Error as e:
                    st.index_error(e)
            pinned = (0, 0)
            if not st.closed:
                try:
                    pinned = st.index.pinned(st.clock())
                except sqlite3.Error as e:
                    st.index_error(e)
            c = st.counts
            return {
                "name": self.name,
                "policy": self.policy,
                "spills": c["spills"],
                "dedup_writes": c["dedup"],
                "dropped_spills": dict(st.drops),
                "dropped_spills_total": sum(st.drops.values()),
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
                "blocks_on_disk": st.blocks,
                "bytes_on_disk": st.bytes_stored,
                "budget_bytes": st.budget(),
                "config_budget_bytes": st.config.budget_bytes,
                "disk_free_bytes": st.disk_free,
                "disk_reserve_bytes": st.disk_reserve,
                "bytes_written": st.bytes_written,
                "bytes_written_today": st.today_bytes(),
                "queue_depth": len(st.pending),
                "read_ahead": dict(self.reader.ahead.counts),
                "degraded": st.degraded_reason is not None,
                "degraded_reason": st.degraded_reason,
                "mode": st.mode,
                "mode_reason": st.mode_reason,
                "reload_latency_ms": {
                    "buckets": list(LATENCY_BUCKETS_MS),
                    "counts": list(st.latency),
                    "count": sum(st.latency),
                    "sum": round(st.latency_sum_ms, 3),
                },
            }

    @property
    def mode(self) -> str:
        """``read_write``, ``read_only`` or ``off`` (see ``SSDState.set_mode``)."""
        return self.state.mode

    def health(self) -> dict[str, Any]:
        """Cheap (no lock, no I/O): the mode and why the tier is not fully working."""
        return {"mode": self.state.mode, "degraded": self.state.degraded_reason is not None,
                "reason": self.state.mode_reason or self.state.degraded_reason,
                "index_errors": self.state.counts["index_errors"]}

    @tier_errors
    def check(self, fix: bool = False,
              progress: Callable[[int, int], None] | None = None) -> CheckReport:
        """Compare index and files (see ``ssd_check``). Waits for queued writes first.
        ``progress(done, total)`` follows the index rows checked."""
        st = self.state
        if not st.closed and hasattr(self, "_thread"):
            self.flush()
        refused = None
        if fix and st.mode != "read_write":
            refused = f"no repair: the tier is {st.mode.replace('_', '-')} ({st.mode_reason})"
            log.error("ssd check: %s", refused)
            fix = False
        with st.write_lock, st.dirlock.exclusive(), st.lock:
            try:
                report = reconcile(st.root, st.index, fix=fix, progress=progress,
                                   trust_index=st.mode != "off")
                if st.mode != "off":
                    st.refresh_totals()
            except sqlite3.Error as e:
                st.index_error(e)
                raise TierError(f"ssd check failed: {e}") from e
            report.index_rebuilt, st.index_rebuilt = st.index_rebuilt, False
            report.set_aside_files, st.set_aside = st.set_aside, 0
            report.recovered_blocks, st.recovered = st.recovered, 0
            report.index_corrupt = st.index_corrupt
            report.refused = refused
        return report

    @tier_errors
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped); apply batched accesses.
        False if the queue did not drain within ``timeout`` seconds (None: no limit)."""
        if not self._queue.join(timeout):
            return False
        with self.state.write_lock, self.state.lock:
            self.state.apply_touches()
        return True

    def close(self) -> None:
        with self.state.lock:
            if self.state.closed:
                return
            self.state.closed = True
        self._queue.put(STOP, force=True)
        self._thread.join()
        self.writer.close()
        self.reader.ahead.close()
        with self.state.write_lock, self.state.lock:
            self.state.apply_touches()
            self.state.index.close()
            self.state.dirlock.close()

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[IndexRow]:
        return iter(self.rows())
