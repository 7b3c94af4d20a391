"""A clean shutdown writes exactly what the SSD lacks, in batches that keep every
crash guarantee of a single write, and a restart finds every acknowledged block:

- the close after a persist writes only the blocks written since (count, bytes);
- a batch of queued blocks is committed in one transaction, each folder fsynced once;
- a write error inside a batch (folder fsync, index commit) commits none of the
  batch's rows and leaves no file behind it (the blocks are then written one by one,
  or dropped and counted), and ``check`` finds nothing to repair;
- large files go around the page cache (``O_DIRECT``) with the same bytes, and fall
  back to a buffered write where the file system refuses it;
- a kill -9 in the middle of a shutdown loses nothing whose row was committed, and
  every block the restart finds is complete and valid.
"""

from __future__ import annotations

import errno
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shutdown_blocks import NS, payload_for, prompt
from ssd_helpers import make_tier

from promptcache.cache import PromptCache
from promptcache.cache.types import NumpyAdapter
from promptcache.codec import decode, encode
from promptcache.config import CacheConfig, SSDConfig
from promptcache.hashing import hash_block
from promptcache.meta import BlockMeta
from promptcache.tiers import ssd_files
from promptcache.tiers.base import as_source
from promptcache.tiers.ssd import SSDTier
from promptcache.tiers.ssd_queue import Pending

CHILD = Path(__file__).parent / "shutdown_child.py"


def open_cache(path: Path, **kw: Any) -> tuple[PromptCache, SSDTier]:
    ssd = make_tier(path, **kw)
    cache = PromptCache(CacheConfig(block_size=NS.block_size, ram_budget_bytes=1 << 28),
                        lower=[ssd])
    return cache, ssd


def block_value(data: bytes) -> float:
    """The float every element of a stored block holds (its block number)."""
    arr = np.frombuffer(bytes(decode(data).buffer), dtype=np.float32)
    assert arr.size > 0 and np.all(np.abs(arr) == abs(arr[0]))
    return float(abs(arr[0]))


def test_close_writes_exactly_the_blocks_the_ssd_lacks(tmp_path):
    cache, ssd = open_cache(tmp_path, fsync=True)
    assert cache.store(NS, prompt(6), 6 * NS.block_size, payload_for) == 6
    assert cache.persist() == 6
    first = ssd.stats()
    assert (first["spills"], first["blocks_on_disk"]) == (6, 6)
    assert cache.store(NS, prompt(16), 16 * NS.block_size, payload_for) == 10
    cache.close()
    s = ssd.stats()
    assert cache.last_persist is not None
    assert (cache.last_persist.blocks, cache.last_persist.written,
            cache.last_persist.failed) == (10, 10, 0)
    assert (s["spills"], s["dedup_writes"], s["dropped_spills_total"]) == (16, 0, 0)
    ssd2 = make_tier(tmp_path)  # the restart
    rows = ssd2.rows()
    assert len(rows) == 16
    new = [r for r in rows if r.meta.start >= 6 * NS.block_size]
    assert len(new) == 10
    assert s["bytes_written"] - first["bytes_written"] == sum(r.file_bytes for r in new)
    assert sorted(block_value(ssd2.get(r.meta.block_hash) or b"") for r in rows) == \
        [float(i) for i in range(16)]
    assert ssd2.check(fix=False).problems == 0
    ssd2.close()


def _pending(tier: SSDTier, n: int, first: int = 0) -> list[Pending]:
    """``n`` blocks registered as queued (not in the queue: the test writes them)."""
    out = []
    for i in range(first, first + n):
        toks = (i, i, i, i)
        meta = BlockMeta(hash_block(NS.root, toks), NS.root, toks, 0,
                         namespace_key=NS.key, tenant=NS.tenant)
        arr = np.full((1, 1, 4, 64), float(i), dtype=np.float32)
        buffer, layout = NumpyAdapter().to_buffer({"0.k": arr, "0.v": -arr})
        data = encode(meta, (), layout, buffer)
        p = Pending(meta, as_source(data), len(data), {"s"}, True, queued=True)
        with tier.status.lock:
            tier.queued.pending[bytes(meta.block_hash)] = p
            tier.queued.bytes += p.nbytes
        out.append(p)
    return out


def _count(monkeypatch: pytest.MonkeyPatch, tier: SSDTier) -> dict[str, int]:
    calls = {"commit": 0, "fsync_dir": 0}
    index = tier.catalog.index
    real_commit, real_fsync_dir = index.commit, ssd_files.fsync_dir

    def commit() -> None:
        calls["commit"] += 1
        real_commit()

    def fsync_dir(path: Path) -> None:
        calls["fsync_dir"] += 1
        real_fsync_dir(path)

    monkeypatch.setattr(index, "commit", commit)
    monkeypatch.setattr(ssd_files, "fsync_dir", fsync_dir)
    return calls


def _folders(items: list[Pending]) -> set[str]:
    return {ssd_files.block_rel_path(NS.key, NS.tenant, bytes(p.meta.block_hash).hex())
            .rsplit("/", 1)[0] for p in items}


def test_a_batch_is_one_transaction_with_each_folder_fsynced_once(tmp_path, monkeypatch):
    tier = make_tier(tmp_path, fsync=True)
    items = _pending(tier, 12)
    for folder in _folders(items):  # no folder creation (its own fsyncs) in the count
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    calls = _count(monkeypatch, tier)
    tier.writer._write_batch(items)
    # one transaction for the 12 rows, one for the capacity check after it (one by
    # one: 12 of each, and 12 folder fsyncs)
    assert calls == {"commit": 2, "fsync_dir": len(_folders(items))}
    s = tier.stats()
    assert (s["spills"], s["blocks_on_disk"], s["queue_depth"]) == (12, 12, 0)
    assert sorted(block_value(tier.get(p.meta.block_hash) or b"") for p in items) == \
        [float(i) for i in range(12)]
    assert tier.sessions_of(items[0].meta.block_hash) == ["s"]
    assert tier.check(fix=False).problems == 0
    tier.close()


def test_the_writer_thread_writes_what_is_queued_together(tmp_path, monkeypatch):
    tier = make_tier(tmp_path, fsync=True, queue_size=32)
    metas = [p.meta for p in _pending(tier, 9)]
    with tier.status.lock:
        datas = [tier.queued.pending.pop(bytes(m.block_hash)).source.encode() for m in metas]
        tier.queued.bytes = 0
    calls = _count(monkeypatch, tier)
    with tier.catalog.write_lock:  # the writer waits: the puts queue up behind it
        for m, d in zip(metas, datas, strict=True):
            assert tier.put(m, d)
    assert tier.flush()
    assert tier.stats()["spills"] == 9
    # the block it took first, then the rest at once: two writes of two transactions
    # (the rows, the capacity check) at most; one by one, 18
    assert 2 <= calls["commit"] <= 4
    tier.close()


@pytest.mark.parametrize("fail", ["fsync_dir", "commit"])
def test_a_failed_batch_commits_no_row_and_leaves_no_file(tmp_path, monkeypatch, fail):
    tier = make_tier(tmp_path, fsync=True)
    items = _pending(tier, 6)
    real_fsync_dir, index = ssd_files.fsync_dir, tier.catalog.index
    real_upsert = index.upsert
    upserts = [0]

    def fsync_dir(path: Path) -> None:
        raise OSError(errno.EIO, "injected")

    def upsert(row: Any) -> None:
        upserts[0] += 1
        if upserts[0] == 3:
            raise sqlite3.OperationalError("injected")
        real_upsert(row)

    if fail == "fsync_dir":
        monkeypatch.setattr(ssd_files, "fsync_dir", fsync_dir)
    else:
        monkeypatch.setattr(index, "upsert", upsert)
    for p in items:
        p.taken = True
    with tier.catalog.write_lock:
        alone = tier.writer._write_fresh(items)
    s = tier.stats()
    assert s["blocks_on_disk"] == 0 and s["spills"] == 0
    assert tier.rows() == []
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent != tmp_path]
    assert files == []  # no block file, no temp file
    if fail == "fsync_dir":  # handed back to be written one by one
        assert alone == items
        monkeypatch.setattr(ssd_files, "fsync_dir", real_fsync_dir)
        for p in alone:
            tier.writer._write(p)
        assert tier.stats()["spills"] == 6
    else:  # an index error: counted, the blocks forgotten (the cache offers them again)
        assert alone == [] and s["index_errors"] == 1 and s["queue_depth"] == 0
    assert tier.check(fix=False).problems == 0
    tier.close()


def test_large_files_are_written_around_the_page_cache_with_the_same_bytes(tmp_path,
                                                                          monkeypatch):
    data = bytes(range(256)) * ((ssd_files.DIRECT_MIN_BYTES + 1000) // 256)
    direct = []
    real = ssd_files._write_direct

    def spy(path: Path, payload: bytes) -> bool:
        direct.append(real(path, payload))
        return direct[-1]

    monkeypatch.setattr(ssd_files, "_write_direct", spy)
    tmp = ssd_files.write_temp(tmp_path, "big", data, fsync=True)
    assert tmp.read_bytes() == data
    small = ssd_files.write_temp(tmp_path, "small", b"x" * 100, fsync=True)
    assert small.read_bytes() == b"x" * 100
    assert len(direct) == 1  # only the large one, and only with fsync
    ssd_files.write_temp(tmp_path, "unsynced", data, fsync=False)
    assert len(direct) == 1


def test_a_file_system_without_o_direct_gets_a_buffered_write(tmp_path, monkeypatch):
    real_open = ssd_files.os.open

    def no_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & getattr(ssd_files.os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "no O_DIRECT here")
        return real_open(path, flags, *args)

    monkeypatch.setattr(ssd_files.os, "open", no_direct)
    data = b"\x01\x02" * (ssd_files.DIRECT_MIN_BYTES // 2 + 7)
    tmp = ssd_files.write_temp(tmp_path, "big", data, fsync=True)
    assert tmp.read_bytes() == data
    assert [p.name for p in tmp_path.iterdir()] == [tmp.name]


def _committed(root: Path) -> set[bytes]:
    try:
        db = sqlite3.connect(f"file:{root / ssd_files.INDEX_NAME}?mode=ro", uri=True,
                             timeout=5)
        try:
            return {bytes(r[0]) for r in db.execute("SELECT hash FROM blocks")}
        finally:
            db.close()
    except sqlite3.Error:
        return set()


@pytest.mark.parametrize("after_rows", [1, 40])
def test_kill_9_during_the_shutdown_loses_nothing_acknowledged(tmp_path, after_rows):
    """The child closes a cache of 120 blocks; it is killed once ``after_rows`` rows
    are committed (seen by polling the index read-only: those are acknowledged)."""
    root = tmp_path / "ssd"
    proc = subprocess.Popen([sys.executable, str(CHILD), str(root), "120"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "closing"
    acked: set[bytes] = set()
    while len(acked) < after_rows and proc.poll() is None:
        acked |= _committed(root)
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    acked |= _committed(root)  # (what was committed up to the kill)
    ssd = SSDTier(SSDConfig(path=root, fsync=False))  # the restart: reconcile repairs
    report = ssd.startup_report
    assert report is not None and report.missing_files == 0 and report.wrong_size == 0
    rows = ssd.rows()
    found = {bytes(r.meta.block_hash) for r in rows}
    assert acked <= found and len(found) >= after_rows
    for r in rows:  # every block found is complete and holds its own block's values
        data = ssd.get(r.meta.block_hash)
        assert data is not None
        assert block_value(data) == float(r.meta.start // NS.block_size)
    assert ssd.check(fix=False).problems == 0
    ssd.close()
