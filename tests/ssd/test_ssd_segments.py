"""Segment files (``SSDConfig.segment_bytes`` > 0): blocks appended as records to a
segment, rows naming ``<segment>@<offset>``; runs read together; torn tails cut,
damaged records a corrupt miss, segments removed once no row names them and no
writer holds them; folders of one file per block still read."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from crash_writer import crash_meta, crash_payload
from ssd_helpers import NS, FakeClock, chain, make_tier, payload_for

from promptcache.codec import decode
from promptcache.errors import CorruptBlockError
from promptcache.tiers import ssd_segments
from promptcache.tiers.ssd_segments import HEAD, SEG_DIR

SIZE = len(payload_for(0))
REC = HEAD.size + SIZE  # one record: its header and the block


def seg_tier(root: Path, **kw: object):
    return make_tier(root, segment_bytes=kw.pop("segment_bytes", 64 << 20), **kw)


def segs(root: Path) -> list[Path]:
    d = root / SEG_DIR
    return sorted(d.iterdir()) if d.is_dir() else []


def stored(root: Path, n: int, **kw: object):
    tier = seg_tier(root, **kw)
    ms = chain(NS, n)
    for i, m in enumerate(ms):
        assert tier.put(m, payload_for(i), timeout=None)
    tier.flush()
    return tier, ms


def test_a_chain_is_appended_to_one_segment_at_exact_offsets(tmp_path):
    tier, ms = stored(tmp_path, 3)
    [seg] = segs(tmp_path)
    assert seg.stat().st_size == 3 * REC
    rows = {bytes(r.meta.block_hash): r for r in tier.rows()}
    names = [rows[bytes(m.block_hash)].file_name for m in ms]
    assert names == [f"{SEG_DIR}/{seg.name}@{HEAD.size + k * REC}" for k in range(3)]
    assert [rows[bytes(m.block_hash)].file_bytes for m in ms] == [SIZE] * 3
    assert list(tmp_path.rglob("*.safetensors")) == []
    s = tier.stats()
    assert (s["blocks_on_disk"], s["bytes_on_disk"], s["spills"]) == (3, 3 * SIZE, 3)
    assert tier.check(fix=False).problems == 0
    tier.close()


def test_a_full_segment_makes_a_new_one(tmp_path):
    tier = seg_tier(tmp_path, segment_bytes=1)
    for i, m in enumerate(chain(NS, 3)):
        tier.put(m, payload_for(i))
        tier.flush()
    assert [p.stat().st_size for p in segs(tmp_path)] == [REC] * 3
    assert sorted(r.file_name.rpartition("@")[2] for r in tier.rows()) == [str(HEAD.size)] * 3
    tier.close()


def test_a_torn_tail_is_cut_at_open_and_the_blocks_served(tmp_path):
    tier, ms = stored(tmp_path, 2)
    tier.close()
    [seg] = segs(tmp_path)
    with open(seg, "ab") as f:  # a crash mid-append: a header and half a block
        f.write(HEAD.pack(ssd_segments.MAGIC, SIZE, bytes(16)) + payload_for(9)[: SIZE // 2])
    tier = seg_tier(tmp_path)
    assert tier.startup_report is not None and tier.startup_report.torn_tails == 1
    assert seg.stat().st_size == 2 * REC
    assert [bytes(g[0]) for g in tier.get_many([m.block_hash for m in ms])] == [
        payload_for(0), payload_for(1)]
    assert tier.check(fix=False).problems == 0
    tier.close()


def test_a_segment_goes_when_its_last_block_goes_and_no_writer_holds_it(tmp_path):
    tier = seg_tier(tmp_path, segment_bytes=1)
    a, b = chain(NS, 2)
    for i, m in enumerate((a, b)):
        tier.put(m, payload_for(i))
        tier.flush()
    # which segment holds which block: by the rows (two made in one millisecond may sort
    # either way by name)
    where = {bytes(r.meta.block_hash): r.file_name.split("@")[0] for r in tier.rows()}
    second = tmp_path / where[bytes(b.block_hash)]
    assert sorted(segs(tmp_path)) == sorted([tmp_path / where[bytes(a.block_hash)], second])
    assert tier.discard([a.block_hash]) == 1
    assert segs(tmp_path) == [second]  # a's segment: no row, no writer
    assert tier.discard([b.block_hash]) == 1
    assert segs(tmp_path) == [second]  # the writer still appends to it
    tier.close()
    tier = seg_tier(tmp_path)
    assert tier.startup_report is not None and tier.startup_report.orphan_files == 1
    assert segs(tmp_path) == []
    tier.close()


def test_eviction_by_budget_keeps_the_newest_and_their_bytes(tmp_path):
    clock = FakeClock()
    tier = seg_tier(tmp_path, budget_bytes=2 * SIZE, clock=clock)
    ms = chain(NS, 4)
    for i, m in enumerate(ms):
        tier.put(m, payload_for(i))
        tier.flush()
        clock.advance(1.0)
    s = tier.stats()
    assert (s["blocks_on_disk"], s["bytes_on_disk"], s["evictions_capacity"]) == (2, 2 * SIZE, 2)
    got = tier.get_many([m.block_hash for m in ms])
    assert got[:2] == [None, None]
    assert [bytes(g[0]) for g in got[2:]] == [payload_for(2), payload_for(3)]
    tier.close()


def test_a_folder_of_block_files_is_read_and_grows_by_segments(tmp_path):
    old = make_tier(tmp_path)  # one file per block
    ms = chain(NS, 4)
    for i, m in enumerate(ms[:2]):
        old.put(m, payload_for(i))
    old.flush()
    old.close()
    assert len(list(tmp_path.rglob("*.safetensors"))) == 2
    tier = seg_tier(tmp_path)
    for i, m in enumerate(ms[2:], 2):
        tier.put(m, payload_for(i))
    tier.flush()
    assert len(segs(tmp_path)) == 1 and len(list(tmp_path.rglob("*.safetensors"))) == 2
    got = tier.get_many([m.block_hash for m in ms])
    assert [bytes(g[0]) for g in got] == [payload_for(i) for i in range(4)]
    s = tier.stats()
    assert (s["hits"], s["blocks_on_disk"], s["bytes_on_disk"]) == (4, 4, 4 * SIZE)
    assert tier.check(fix=False).problems == 0
    tier.close()


def test_a_lost_index_is_rebuilt_from_the_segment_records(tmp_path):
    tier, ms = stored(tmp_path, 3)
    tier.close()
    for suffix in ("", "-wal", "-shm"):
        (tmp_path / f"index.sqlite{suffix}").unlink(missing_ok=True)
    tier = seg_tier(tmp_path)
    assert tier.startup_report is not None and tier.startup_report.recovered_blocks == 3
    own = [decode(payload_for(i)).desc.meta.block_hash for i in range(3)]  # what they describe
    assert [bytes(g[0]) for g in tier.get_many(own)] == [payload_for(i) for i in range(3)]
    assert tier.check(fix=False).problems == 0
    tier.close()


def test_a_second_live_tier_leaves_the_writers_segment_alone(tmp_path):
    a, ms = stored(tmp_path, 2)
    [seg] = segs(tmp_path)
    with open(seg, "ab") as f:  # bytes a's writer appended and has not committed yet
        f.write(b"x" * 100)
    b = seg_tier(tmp_path)  # its startup repair: a holds the segment
    assert b.startup_report is not None and b.startup_report.problems == 0
    assert seg.stat().st_size == 2 * REC + 100
    assert [bytes(g[0]) for g in b.get_many([m.block_hash for m in ms])] == [
        payload_for(0), payload_for(1)]
    b.close()
    a.close()


def test_a_full_disk_mid_append_leaves_no_bytes_and_degrades(tmp_path, monkeypatch):
    import errno

    tier, ms = stored(tmp_path, 1)
    [seg] = segs(tmp_path)

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ssd_segments.os, "pwrite", full)
    assert tier.put(chain(NS, 2)[1], payload_for(1))
    tier.flush()
    s = tier.stats()
    assert (s["write_errors"], s["degraded"], s["blocks_on_disk"], s["disk_full"]) == (1, True, 1, 1)
    assert seg.stat().st_size == REC  # cut back to where it was
    monkeypatch.undo()
    assert bytes(tier.get_many([ms[0].block_hash])[0][0]) == payload_for(0)
    tier.close()


WRITER = Path(__file__).parent / "crash_writer.py"
BUDGET = 40 * len(payload_for(0, 112))


@pytest.mark.parametrize("seg_bytes", [1 << 20])
def test_sigkill_mid_append_20_times(tmp_path, seg_bytes):
    """kill -9 a process appending continuously (rewrites and deletions too): after
    each kill every row reads back exactly what was written, no check problem is
    left, and every segment no one holds ends at its last row."""
    rng = random.Random(4321)
    root = tmp_path / "cache"
    seen = 0
    for run in range(20):
        proc = subprocess.Popen([sys.executable, str(WRITER), str(root), str(run * 10_000),
                                 str(BUDGET), str(seg_bytes)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            if rng.random() >= 0.2:
                assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            time.sleep(rng.uniform(0.02, 0.3))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
        tier = make_tier(root, budget_bytes=BUDGET, segment_bytes=seg_bytes)
        try:
            assert tier.check(fix=False).problems == 0
            rows = tier.rows()
            got = tier.get_many([r.meta.block_hash for r in rows])
            ends: dict[str, int] = {}
            for row, g in zip(rows, got, strict=True):
                i = row.meta.token_ids[0]
                assert row.meta == crash_meta(i)
                assert bytes(g[0]) in (crash_payload(i, 0), crash_payload(i, 1))
                seg, _, off = row.file_name.rpartition("@")
                ends[seg] = max(ends.get(seg, 0), int(off) + row.file_bytes)
            assert tier.stats()["corrupt"] == 0
            assert list(root.rglob("*.safetensors")) == []
            for p in segs(root):
                assert p.stat().st_size == ends[f"{SEG_DIR}/{p.name}"]
            seen += len(rows)
        finally:
            tier.close()
    assert seen > 0


def test_an_unwritable_folder_of_segments_is_served_read_only(tmp_path, monkeypatch):
    import errno

    from promptcache.tiers import ssd_files

    tier, ms = stored(tmp_path, 3)
    tier.close()
    [seg] = segs(tmp_path)
    with open(seg, "ab") as f:  # a torn tail: a read-only tier leaves it as it is
        f.write(b"x" * 10)

    def refuse(root: Path) -> None:
        raise OSError(errno.EROFS, "Read-only file system", str(root))

    monkeypatch.setattr(ssd_files, "probe_writable", refuse)
    tier = seg_tier(tmp_path)
    assert tier.mode == "read_only"
    assert [bytes(g[0]) for g in tier.get_many([m.block_hash for m in ms])] == [
        payload_for(i) for i in range(3)]
    assert not tier.put(chain(NS, 4)[3], payload_for(3))
    s = tier.stats()
    assert (s["hits"], s["dropped_spills"]["read_only"], s["blocks_on_disk"]) == (3, 1, 3)
    assert seg.stat().st_size == 3 * REC + 10
    tier.close()


ACK_CHILD = """
import sys, time
sys.path.insert(0, {here!r})
from crash_writer import crash_meta, crash_payload
from promptcache.config import SSDConfig
from promptcache.tiers.ssd import SSDTier
tier = SSDTier(SSDConfig(path={root!r}, fsync=True, segment_bytes=1 << 20, queue_size=8))
for i in range(20):
    tier.put(crash_meta(i), crash_payload(i, 0), timeout=None)
tier.flush()
print("flushed", flush=True)
i = 20
while True:  # appends go on until the kill
    tier.put(crash_meta(i), crash_payload(i, 0), timeout=None)
    i += 1
"""


def test_a_flushed_block_survives_kill_9_mid_append(tmp_path):
    root = tmp_path / "cache"
    code = ACK_CHILD.format(here=str(Path(__file__).parent), root=str(root))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"flushed\n"
        time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    tier = make_tier(root, segment_bytes=1 << 20)
    got = tier.get_many([crash_meta(i).block_hash for i in range(20)])
    assert [bytes(g[0]) for g in got] == [crash_payload(i, 0) for i in range(20)]
    assert tier.check(fix=False).problems == 0 and tier.stats()["corrupt"] == 0
    tier.close()


def test_without_the_folder_lock_segments_are_served_and_nothing_is_cut(tmp_path, monkeypatch):
    import errno

    from promptcache.tiers import ssd_files

    tier, ms = stored(tmp_path, 3)
    tier.close()
    [seg] = segs(tmp_path)
    with open(seg, "ab") as f:  # a torn tail a repair would cut
        f.write(b"x" * 10)
    with open(seg, "r+b") as f:  # and block 2 damaged
        f.seek(2 * REC + HEAD.size + 1)
        f.write(b"\xff\xff")

    def refuse(path: Path, *, create: bool) -> int:
        raise OSError(errno.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(ssd_files, "open_lock_fd", refuse)
    before = seg.read_bytes()
    tier = seg_tier(tmp_path)
    assert tier.mode == "read_only" and tier.startup_report is None
    got = tier.get_many([m.block_hash for m in ms])
    assert [bytes(g[0]) for g in got[:2]] == [payload_for(0), payload_for(1)]
    assert isinstance(got[2], CorruptBlockError)
    rep = tier.check(fix=True)
    assert (rep.fixed, rep.torn_tails) == (False, 1)  # found, not repaired
    s = tier.stats()
    assert (s["hits"], s["corrupt"], s["quarantined"], s["blocks_on_disk"]) == (2, 1, 0, 3)
    tier.close()
    assert seg.read_bytes() == before


def test_a_half_dead_segment_is_compacted_into_the_current_one(tmp_path):
    tier = seg_tier(tmp_path, segment_bytes=2 * REC)  # two records, then a new segment
    a, b, c = chain(NS, 3)
    for i, m in enumerate((a, b, c)):
        tier.put(m, payload_for(i))
        tier.flush()
    first, second = segs(tmp_path)
    assert (first.stat().st_size, second.stat().st_size) == (2 * REC, REC)
    assert tier.sweep() == 0  # nothing dead yet
    assert tier.discard([a.block_hash]) == 1  # first: half its bytes dead
    assert tier.sweep() == 1  # b moved
    assert segs(tmp_path) == [second] and second.stat().st_size == 2 * REC
    row = {bytes(r.meta.block_hash): r for r in tier.rows()}[bytes(b.block_hash)]
    assert row.file_name == f"{SEG_DIR}/{second.name}@{REC + HEAD.size}"
    got = tier.get_many([b.block_hash, c.block_hash])
    assert [bytes(g[0]) for g in got] == [payload_for(1), payload_for(2)]
    s = tier.stats()
    assert (s["compacted_blocks"], s["blocks_on_disk"], s["bytes_on_disk"]) == (1, 2, 2 * SIZE)
    assert tier.check(fix=False).problems == 0
    tier.close()
