"""The SSD tier's read path: metadata queries (the index only,
and the blocks queued) and payload reads (verified size and checksum; a bad file
is quarantined), with the chain's next blocks read ahead (``ssd_ahead``)."""

from __future__ import annotations

import bisect
import logging
import os
import sqlite3
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..codec import checksum_matches
from ..errors import CorruptBlockError, TierError
from ..hashing import BlockHash
from ..meta import BlockMeta
from . import ssd_files as files
from . import ssd_segments as segments
from .ssd_ahead import ReadAhead
from .ssd_queue import Queued
from .ssd_schema import IndexRow
from .ssd_store import Catalog, Status

log = logging.getLogger(__name__)

PREFETCH_CHILDREN = 4
# Blocks after those read ahead whose files the kernel is asked to start reading.
HINT_BLOCKS = 8
READ_WORKERS = 4
LATENCY_BUCKETS_MS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 250.0, 500.0, 1000.0)


class Reader:
    """Reads for ``SSDTier``; ``read_ahead_blocks`` of a chain are read and verified
    ahead of the caller (``ReadAhead``)."""

    def __init__(self, status: Status, cat: Catalog, queued: Queued, *,
                 read_ahead_blocks: int) -> None:
        self.status, self.cat, self.queued = status, cat, queued
        self.latency = [0] * (len(LATENCY_BUCKETS_MS) + 1)
        self.latency_sum_ms = 0.0
        self.pool: ThreadPoolExecutor | None = None  # segment reads (``get_many``)
        self.read_ahead_blocks = read_ahead_blocks
        self.ahead = ReadAhead(workers=min(max(1, read_ahead_blocks), READ_WORKERS),
                               max_blocks=max(1, read_ahead_blocks))
        self.kids_memo: dict[bytes, tuple[float, list[tuple[bytes, str, int, str, float | None]]]] = {}
        self.hinted: dict[bytes, float] = {}

    def get_metas(self, block_hashes: Sequence[BlockHash]
                  ) -> list[BlockMeta | None]:
        """``get_meta`` of each hash: queued blocks, then the index (one query per 500)."""
        hs = [bytes(h) for h in block_hashes]
        out: list[BlockMeta | None] = [None] * len(hs)
        rows: dict[bytes, IndexRow] = {}
        with self.status.lock:
            ask = []
            for i, h in enumerate(hs):
                p = self.queued.find(h)
                if p is not None:
                    out[i] = p.meta
                else:
                    ask.append(h)
            try:
                for k in range(0, len(ask), 500):
                    chunk = tuple(ask[k:k + 500])
                    where = f"WHERE hash IN ({','.join('?' * len(chunk))})"
                    for row in self.cat.index.iter_rows(where, chunk):
                        rows[bytes(row.meta.block_hash)] = row
            except sqlite3.Error as e:
                self.status.index_error(e)
                return out
        now = self.status.clock()
        for i, h in enumerate(hs):
            got = rows.get(h)
            if out[i] is None and got is not None and self.cat.live(got, now):
                out[i] = got.meta
        return out

    def get_meta(self, block_hash: BlockHash) -> BlockMeta | None:
        h = bytes(block_hash)
        with self.status.lock:
            p = self.queued.find(h)
            if p is not None:
                return p.meta
            try:
                row = self.cat.index.get(h)
            except sqlite3.Error as e:
                self.status.index_error(e)
                return None
        return row.meta if row is not None and self.cat.live(row, self.status.clock()) else None

    def children(self, parent_hash: BlockHash
                 ) -> list[BlockMeta]:
        parent = bytes(parent_hash)
        now = self.status.clock()
        with self.status.lock:
            try:
                rows = self.cat.index.children(parent)
            except sqlite3.Error as e:
                self.status.index_error(e)
                rows = []
            out = {bytes(r.meta.block_hash): r.meta for r in rows if self.cat.live(r, now)}
            for h, p in self.queued.pending.items():
                if not p.cancelled and bytes(p.meta.parent_hash) == parent:
                    out[h] = p.meta
        return [out[h] for h in sorted(out)]

    def sessions_of(self, block_hash: BlockHash) -> list[str]:
        with self.status.lock:
            p = self.queued.find(bytes(block_hash))
            if p is not None:
                return sorted(p.sessions)
            return self.cat.index.sessions_of(bytes(block_hash))

    def rows(self, tenant: str | None = None) -> list[IndexRow]:
        """Index rows (for the CLI and tests), most recently used first."""
        where, params = ("WHERE tenant=?", (tenant,)) if tenant is not None else ("", ())
        with self.status.lock:
            return list(self.cat.index.iter_rows(where + " ORDER BY last_access DESC, hash", params))

    def sessions(self, tenant: str | None = None) -> list[tuple[str, str, int, int, float]]:
        """``(tenant, session, blocks, bytes, last use)`` per session (``last use``: the
        latest access of its blocks, wall-clock seconds), most recently used first."""
        with self.status.lock:
            return self.cat.index.sessions(tenant)

    def tenants(self) -> list[tuple[str, int, int]]:
        with self.status.lock:
            return self.cat.index.tenants()

    # -- payload reads --------------------------------------------------------------------

    def get(self, block_hash: BlockHash) -> bytes | None:
        h = bytes(block_hash)
        t0 = time.perf_counter()
        with self.status.lock:
            p = self.queued.find(h)
            if p is not None:
                self.status.counts["hits"] += 1
                self.status.counts["pending_hits"] += 1
                source = p.source
            else:
                source = None
                try:
                    row = self.cat.index.get(h)
                except sqlite3.Error as e:
                    self.status.index_error(e)
                    raise TierError(f"ssd index unavailable: {e}") from e
        if source is not None:  # queued, not written yet: encoded here if the writer has not
            try:
                return source.encode()
            except Exception as e:
                raise TierError(f"ssd block {h.hex()[:16]}: cannot encode the queued payload: {e}") from e
        now = self.status.clock()
        for _attempt in range(3):
            if row is None or not self.cat.live(row, now):
                with self.status.lock:
                    self.status.counts["misses"] += 1
                return None
            path = self.cat.root / row.file_name
            self._prefetch_children(h, now)  # the next blocks' reads overlap this one
            ahead = self.ahead.take(h, path, row.file_name, row.checksum)
            if ahead is not None:  # verified against this row's checksum by the reader
                self._record_hit(h, now, (time.perf_counter() - t0) * 1000.0)
                return ahead
            try:
                data = _read(self.cat.root, row.file_name, row.file_bytes)
            except FileNotFoundError:
                again = self._reread_row(h, row)
                if again is not row:
                    row = again
                    continue
                self._drop_bad(row, reason=None)
                raise CorruptBlockError(f"ssd block {h.hex()[:16]}: file {row.file_name} is missing") from None
            except OSError as e:
                with self.status.lock:
                    self.status.counts["read_errors"] += 1
                self.status.degrade(f"read failed: {e}")
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

    def get_many(self, block_hashes: Sequence[BlockHash]
                 ) -> list[tuple[segments.Payload, list[str]] | TierError | None]:
        """``(payload, sessions)`` of a chain's run (None where absent, a block's own
        error in its place): the blocks of segments read together (``read_many``:
        runs of adjacent records, each block a view of its mapped segment); the
        rest, and any block whose read failed there, as ``get`` reads it (which
        judges the failure)."""
        hs = [bytes(h) for h in block_hashes]
        t0, now = time.perf_counter(), self.status.clock()
        rows: dict[int, IndexRow] = {}
        with self.status.lock:
            try:
                for i, h in enumerate(hs):
                    row = None if self.queued.find(h) is not None else self.cat.index.get(h)
                    if row is not None and segments.is_segment(row.file_name) and \
                            self.cat.live(row, now):
                        rows[i] = row
            except sqlite3.Error as e:
                self.status.index_error(e)
                rows = {}
        if len(rows) > 1:
            if self.pool is None:
                self.pool = ThreadPoolExecutor(segments.READERS,
                                               thread_name_prefix="promptcache-ssd-seg")
            wants = [(i, r.file_name, r.file_bytes, r.checksum) for i, r in rows.items()]
            got = segments.read_many(self.cat.root, wants, self.pool)
        else:
            got = {}
        out: list[tuple[segments.Payload, list[str]] | TierError | None] = []
        for i, h in enumerate(hs):
            try:
                data: segments.Payload | None | OSError = got.get(i)
                if isinstance(data, (bytes, memoryview)):
                    self._record_hit(h, now, (time.perf_counter() - t0) * 1000.0)
                else:
                    data = self.get(BlockHash(h))
                out.append(None if data is None else (data, self.sessions_of(BlockHash(h))))
            except TierError as e:
                out.append(e)
            except sqlite3.Error as e:  # this block's miss, counted as ``tier_errors`` would
                self.status.index_error(e)
                out.append(TierError(f"ssd block {h.hex()[:16]}: index error: {e}"))
            except OSError as e:
                self.status.degrade(f"get_many failed: {e}")
                out.append(TierError(f"ssd block {h.hex()[:16]}: {e}"))
        return out

    def close(self) -> None:
        self.ahead.close()
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def _prefetch_children(self, h: bytes, now: float) -> None:
        """A restore walks a chain: along it (while a block has exactly one live
        child), read and verify the next ``read_ahead_blocks`` blocks on worker
        threads and ask the kernel (``posix_fadvise(WILLNEED)``) to start reading
        the files of the ``HINT_BLOCKS`` after them, so the disk always has reads
        queued; at a fork, hint every child. Hints only: a wrong guess costs a read."""
        try:
            cur = h
            for depth in range(self.read_ahead_blocks + HINT_BLOCKS):
                kids = self._live_kids(cur, now)
                if len(kids) != 1:
                    for kid in kids:
                        self._willneed(kid[0], kid[1])
                    return
                kh, rel, size, digest, _expiry = kids[0]
                if segments.is_segment(rel):  # a run of a segment: read by ``get_many``
                    return
                if depth < self.read_ahead_blocks:
                    if kh not in self.ahead:
                        self.ahead.schedule(kh, self.cat.root / rel, rel, size, digest)
                else:
                    self._willneed(kh, rel)
                cur = kh
        except OSError:  # a hint only
            pass
        except sqlite3.Error as e:  # a hint only, but never a silent index error
            self.status.index_error(e)

    def _live_kids(self, h: bytes, now: float) -> list[tuple[bytes, str, int, str, float | None]]:
        """``child_reads`` of ``h`` (unexpired), remembered for a second: consecutive
        gets walk overlapping stretches of the chain."""
        t = time.monotonic()
        hit = self.kids_memo.get(h)
        if hit is not None and t - hit[0] < 1.0:
            kids = hit[1]
        else:
            with self.status.lock:
                kids = self.cat.index.child_reads(h, limit=PREFETCH_CHILDREN)
            if len(self.kids_memo) >= 1024:
                self.kids_memo.clear()
            self.kids_memo[h] = (t, kids)
        return [k for k in kids if k[4] is None or k[4] > now]

    def _willneed(self, h: bytes, rel: str) -> None:
        t = time.monotonic()
        if files.FADV_WILLNEED is None or t - self.hinted.get(h, float("-inf")) < 2.0:
            return
        if len(self.hinted) >= 1024:
            self.hinted.clear()
        self.hinted[h] = t
        self.ahead.hint(self.cat.root / rel)

    def _reread_row(self, h: bytes, row: IndexRow) -> IndexRow | None:
        """The current row if it changed since ``row`` was read, else ``row`` itself."""
        with self.status.lock:
            try:
                cur = self.cat.index.get(h)
            except sqlite3.Error as e:
                self.status.index_error(e)
                raise TierError(f"ssd index unavailable: {e}") from e
        if cur is None:
            return None
        if cur.file_name == row.file_name and cur.checksum == row.checksum:
            return row
        return cur

    def _drop_bad(self, row: IndexRow, *, reason: str | None) -> None:
        h = bytes(row.meta.block_hash)
        if not self.status.writable():  # nothing may change the folder: a miss, counted
            with self.status.lock:
                self.status.counts["corrupt"] += 1
                self.status.counts["misses"] += 1
            log.warning("ssd block %s unreadable (%s); %s tier: left as it is", h.hex()[:16],
                        reason or "missing file", self.status.mode)
            return

        def still_this_row() -> list[tuple[bytes, str, int]]:
            cur = self.cat.index.get(h)  # (in the deleting transaction: no other writer now)
            if cur is None or cur.file_name != row.file_name or cur.checksum != row.checksum:
                return []
            return [(h, row.file_name, row.file_bytes)]

        with self.cat.write_lock, self.cat.dirlock.shared(), self.status.lock:
            try:
                if not self.cat.delete_where(still_this_row, unlink=False):
                    return
            except sqlite3.Error as e:
                self.status.index_error(e)
                return
            if reason is None:
                self.status.counts["missing_files"] += 1
            elif not segments.is_segment(row.file_name):  # (a segment's other blocks are fine)
                files.quarantine(self.cat.root, self.cat.root / row.file_name, h.hex(), reason)
                self.status.counts["quarantined"] += 1
            self.status.counts["corrupt"] += 1
            self.status.counts["misses"] += 1
        log.warning("ssd block %s dropped (%s)", h.hex()[:16], reason or "missing file")

    def _record_hit(self, h: bytes, now: float, ms: float) -> None:
        with self.status.lock:
            self.status.counts["hits"] += 1
            self.cat.touch(h, now)
            self.latency[bisect.bisect_left(LATENCY_BUCKETS_MS, ms)] += 1
            self.latency_sum_ms += ms


def _read(root: Path, rel: str, size: int) -> bytes:
    """A block file's bytes, or a segment record's ``size`` bytes (``<seg>@<offset>``).
    Raises FileNotFoundError (a missing file) or OSError."""
    if segments.is_segment(rel):
        seg, offset = segments.split_ref(rel)
        fd = os.open(root / seg, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.pread(fd, size, offset)
        finally:
            os.close(fd)
    with open(root / rel, "rb", buffering=0) as f:
        if files.FADV_WILLNEED is not None:  # the whole file in one go
            os.posix_fadvise(f.fileno(), 0, 0, files.FADV_WILLNEED)
        return f.read()
