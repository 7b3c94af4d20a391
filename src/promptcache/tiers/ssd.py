"""The SSD tier: a crash-safe, persistent, content-addressed block store that several live
processes may share (docs/cache.md). ``SSDTier`` wires parts that own their state (``ssd_store``,
``ssd_open``, ``ssd_queue``, ``ssd_write``, ``ssd_read``, ``ssd_maint``). Failures degrade to
counted misses: only ``TierError`` (and ``get``'s ``CorruptBlockError``) leaves a public method.
A folder it cannot lock or write is served read-only; one it cannot open is off."""

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
from .ssd_maint import Maintenance
from .ssd_open import Opened, open_index
from .ssd_queue import Queued
from .ssd_read import LATENCY_BUCKETS_MS, Reader
from .ssd_schema import IndexRow
from .ssd_segments import Payload, SegmentWriter
from .ssd_store import Catalog, DiskUsage, Status, tier_errors
from .ssd_write import STOP, Writer

log = logging.getLogger(__name__)

# Blocks of a chain read and verified ahead of the caller (see ssd_ahead.ReadAhead).
READ_AHEAD_BLOCKS = 4
# How often the writer thread verifies the whole index file (``verify_index``).
INDEX_CHECK_INTERVAL_S = 300.0


class SSDTier:
    """Any thread may call any public method. Lock order: ``Catalog.write_lock``, then the
    folder's ``DirLock`` (shared for changes, exclusive for repair), then ``Status.lock``.
    ``read_only=True`` never changes the folder; ``clock``: wall-clock seconds (tests fake it)."""

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
        st = self.status = Status(clock=clock, degraded_backoff_s=degraded_backoff_s)
        self.opened = Opened(config, st)
        index = open_index(self.opened, read_only)
        cat = self.catalog = Catalog(config, st, index, self.opened.dirlock,
                                     disk_usage=disk_usage)
        self.queued = Queued(st, cat, config.queue_size)
        self.reader = Reader(st, cat, self.queued, read_ahead_blocks=read_ahead_blocks)
        segs = SegmentWriter(cat.root, max_bytes=config.segment_bytes, fsync=config.fsync)
        self.maint = Maintenance(st, cat, self.queued, sweep_interval_s=sweep_interval_s,
                                 index_check_interval_s=index_check_interval_s, segs=segs)
        try:
            with st.lock:
                cat.refresh_totals()
        except sqlite3.Error as e:
            st.index_error(e)
        if st.mode != "off":
            cat.refresh_disk_cap()
        self.startup_report: CheckReport | None = None
        if reconcile_on_open and st.mode == "read_write":
            try:
                self.startup_report = self.check(fix=True)
            except TierError as e:  # counted and degraded by check; serving goes on
                log.error("ssd startup check failed: %s", e)
            cat.enforce_capacity()  # a smaller budget, or a fuller disk, than last time
        self.writer = Writer(st, cat, self.queued, segs, maintain=self._maintain,
                             poll_s=max(0.05, sweep_interval_s / 4))
        self.maint.last_sweep = time.monotonic()
        self._thread = threading.Thread(target=self.writer.run, name="promptcache-ssd-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def config(self) -> SSDConfig:
        """The configuration in use (replacing it, e.g. a smaller budget, takes effect)."""
        return self.catalog.config

    @config.setter
    def config(self, config: SSDConfig) -> None:
        self.catalog.config = config

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

    @tier_errors
    def get_many(self, block_hashes: Sequence[BlockHash], *, ns: Namespace | None = None
                 ) -> list[tuple[Payload, list[str]] | TierError | None]:
        """``(payload, sessions)`` of a chain's run (see ``Reader.get_many``)."""
        return self.reader.get_many(block_hashes)

    # -- writes (Writer) ------------------------------------------------------------------

    @tier_errors
    def put(self, meta: BlockMeta, payload: bytes | PayloadSource, sessions: Iterable[str] = (),
            hits: int | None = None, *, timeout: float | None = 0.0) -> bool:
        """Queue a block for the writer; ``timeout=0`` refuses at once when the queue is full
        (counted ``queue_full``), else waits for room. ``hits``: for ``admission_min_hits``."""
        return self.queued.put(meta, payload, sessions, hits, timeout=timeout)

    @tier_errors
    def has_room(self, timeout: float | None = 0.0) -> bool:
        """True if a put that does not wait would find room in the write queue."""
        return self.queued.queue.wait_for_room(timeout)

    @tier_errors
    def add_sessions(self, block_hash: BlockHash, sessions: Iterable[str], *,
                     ns: Namespace | None = None) -> None:
        self.writer.add_sessions(block_hash, sessions)

    def budget(self) -> int:
        """The byte budget in use: ``config.budget_bytes`` capped by the disk."""
        return self.catalog.budget()

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
        st, cat = self.status, self.catalog
        with st.lock:
            pinned = (0, 0)
            if not st.closed:
                try:
                    cat.refresh_totals()  # every process's blocks, not only ours
                    pinned = cat.index.pinned(st.clock())
                except sqlite3.Error as e:
                    st.index_error(e)
            c, drops = st.counts, self.queued.drops
            lat = self.reader.latency
            return {
                "name": self.name, "policy": self.policy,
                "spills": c["spills"], "dedup_writes": c["dedup"],
                "dropped_spills": dict(drops), "dropped_spills_total": sum(drops.values()),
                **{k: c[k] for k in (
                    "hits", "misses", "corrupt", "quarantined", "missing_files", "read_errors",
                    "write_errors", "encode_errors", "unexpected_errors", "index_errors",
                    "index_corrupt", "io_errors", "evictions_capacity", "evictions_disk",
                    "disk_full", "evictions_ttl", "evictions_pinned", "compacted_blocks")},
                "pinned_blocks": pinned[0], "pinned_bytes": pinned[1],
                "blocks_on_disk": cat.blocks, "bytes_on_disk": cat.bytes_stored,
                "budget_bytes": cat.budget(), "config_budget_bytes": cat.config.budget_bytes,
                "disk_free_bytes": cat.disk_free, "disk_reserve_bytes": cat.disk_reserve,
                "bytes_written": cat.bytes_written, "bytes_written_today": cat.today_bytes(),
                "queue_depth": len(self.queued.pending),
                "read_ahead": dict(self.reader.ahead.counts),
                "degraded": st.degraded_reason is not None,
                "degraded_reason": st.degraded_reason,
                "mode": st.mode, "mode_reason": st.mode_reason,
                "reload_latency_ms": {
                    "buckets": list(LATENCY_BUCKETS_MS), "counts": list(lat),
                    "count": sum(lat), "sum": round(self.reader.latency_sum_ms, 3),
                },
            }

    @property
    def mode(self) -> str:
        """``read_write``, ``read_only`` or ``off`` (see ``Status.set_mode``)."""
        return self.status.mode

    def health(self) -> dict[str, Any]:
        """Cheap (no lock, no I/O): the mode and why the tier is not fully working."""
        st = self.status
        return {"mode": st.mode, "degraded": st.degraded_reason is not None,
                "reason": st.mode_reason or st.degraded_reason,
                "index_errors": st.counts["index_errors"]}

    @tier_errors
    def check(self, fix: bool = False,
              progress: Callable[[int, int], None] | None = None) -> CheckReport:
        """Compare index and files (see ``ssd_check``). Waits for queued writes first.
        ``progress(done, total)`` follows the index rows checked."""
        st, cat, op = self.status, self.catalog, self.opened
        if not st.closed and hasattr(self, "_thread"):
            self.flush()
        refused = None
        if fix and st.mode != "read_write":
            refused = f"no repair: the tier is {st.mode.replace('_', '-')} ({st.mode_reason})"
            log.error("ssd check: %s", refused)
            fix = False
        with cat.write_lock, cat.dirlock.exclusive(), st.lock:
            try:
                report = reconcile(cat.root, cat.index, fix=fix, progress=progress,
                                   trust_index=st.mode != "off")
                if st.mode != "off":
                    cat.refresh_totals()
            except sqlite3.Error as e:
                st.index_error(e)
                raise TierError(f"ssd check failed: {e}") from e
            report.index_rebuilt, op.index_rebuilt = op.index_rebuilt, False
            report.set_aside_files, op.set_aside = op.set_aside, 0
            report.recovered_blocks, op.recovered = op.recovered, 0
            report.index_corrupt = op.index_corrupt
            report.refused = refused
        return report

    @tier_errors
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (or dropped); apply batched accesses.
        False if the queue did not drain within ``timeout`` seconds (None: no limit)."""
        if not self.queued.queue.join(timeout):
            return False
        with self.catalog.write_lock, self.status.lock:
            self.catalog.apply_touches()
        return True

    def close(self) -> None:
        with self.status.lock:
            if self.status.closed:
                return
            self.status.closed = True
        self.queued.queue.put(STOP, force=True)
        self._thread.join()
        self.writer.close()
        self.reader.close()
        with self.catalog.write_lock, self.status.lock:
            self.catalog.apply_touches()
            self.catalog.index.close()
            self.catalog.dirlock.close()

    def __enter__(self) -> SSDTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[IndexRow]:
        return iter(self.rows())
