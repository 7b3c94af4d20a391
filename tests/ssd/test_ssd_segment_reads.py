"""Segment reads (``get_many``): runs of adjacent records served as verified,
read-only views of the mapped segment; a damaged record, or one past a cut end, is a
counted corrupt miss (never a SIGBUS); a view outlives its segment's unlink."""

from pathlib import Path

from ssd_helpers import NS, chain, payload_for
from test_ssd_segments import REC, SIZE, seg_tier, segs, stored

from promptcache.codec import decode
from promptcache.errors import CorruptBlockError
from promptcache.tiers import ssd_segments
from promptcache.tiers.ssd_segments import HEAD


def test_get_many_reads_adjacent_records_as_one_run_and_serves_exact_bytes(tmp_path, monkeypatch):
    tier, ms = stored(tmp_path, 5)
    runs: list[list[int]] = []
    real = ssd_segments._view_run

    def recording(path, m, run):
        runs.append([off for _i, off, _n, _d in run])
        return real(path, m, run)

    monkeypatch.setattr(ssd_segments, "_view_run", recording)
    got = tier.get_many([m.block_hash for m in ms])
    assert [g[0] for g in got] == [payload_for(i) for i in range(5)]
    # views of the mapped segment: no copy, read-only
    assert all(type(g[0]) is memoryview and g[0].readonly for g in got)
    assert runs == [[HEAD.size + k * REC for k in range(5)]]  # one run, every block in order
    monkeypatch.setattr(ssd_segments, "RUN_BYTES", 2 * REC)  # runs of two blocks
    runs.clear()
    tier.get_many([m.block_hash for m in reversed(ms)])
    assert sorted(runs) == [[HEAD.size, HEAD.size + REC], [HEAD.size + 2 * REC, HEAD.size + 3 * REC],
                            [HEAD.size + 4 * REC]]
    assert tier.stats()["hits"] == 10
    tier.close()


def test_a_flipped_byte_is_a_corrupt_miss_never_served(tmp_path):
    tier, ms = stored(tmp_path, 3)
    [seg] = segs(tmp_path)
    with open(seg, "r+b") as f:  # one byte inside block 1
        f.seek(REC + HEAD.size + SIZE // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0xFF]))
    got = tier.get_many([m.block_hash for m in ms])
    assert bytes(got[0][0]) == payload_for(0) and bytes(got[2][0]) == payload_for(2)
    assert isinstance(got[1], CorruptBlockError)
    s = tier.stats()
    assert (s["hits"], s["corrupt"], s["misses"], s["quarantined"], s["blocks_on_disk"]) == (
        2, 1, 1, 0, 2)
    assert tier.get(ms[1].block_hash) is None  # its row is gone: a miss from now on
    assert seg.stat().st_size == 3 * REC  # the other blocks' segment is kept
    tier.close()


def test_an_index_error_in_get_many_is_each_blocks_own_tier_error(tmp_path):
    from test_ssd_tier_boundary import FailingIndex

    from promptcache.errors import TierError

    tier, ms = stored(tmp_path, 3)
    real = tier.catalog.index
    tier.catalog.index = FailingIndex(real, "sessions_of")  # type: ignore[assignment]
    got = tier.get_many([m.block_hash for m in ms])
    assert [type(g) for g in got] == [TierError] * 3
    assert tier.health()["index_errors"] == 3
    tier.catalog.index = real
    assert [bytes(g[0]) for g in tier.get_many([m.block_hash for m in ms])] == [
        payload_for(i) for i in range(3)]
    tier.close()


def _cut(seg: Path, size: int) -> None:
    with open(seg, "r+b") as f:
        f.truncate(size)


def test_each_run_is_populated_by_a_call_that_releases_the_gil(tmp_path, monkeypatch):
    import ctypes

    tier, ms = stored(tmp_path, 3)
    real, calls = ssd_segments._madvise, []
    assert not real._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # a CDLL call: the GIL released

    def recording(addr, length, advice):
        calls.append((length, advice))
        return real(addr, length, advice)

    monkeypatch.setattr(ssd_segments, "_madvise", recording)
    got = tier.get_many([m.block_hash for m in ms])
    assert [bytes(g[0]) for g in got] == [payload_for(i) for i in range(3)]
    assert calls == [(3 * REC, 22)]  # one run from the segment's first page
    tier.close()


def test_a_record_past_a_cut_end_is_a_corrupt_miss_not_a_crash(tmp_path):
    tier, ms = stored(tmp_path, 3)
    [seg] = segs(tmp_path)
    _cut(seg, 2 * REC + HEAD.size + SIZE // 2)  # block 2 cut in half
    got = tier.get_many([m.block_hash for m in ms])
    assert [bytes(g[0]) for g in got[:2]] == [payload_for(0), payload_for(1)]
    assert isinstance(got[2], CorruptBlockError)
    s = tier.stats()
    assert (s["hits"], s["corrupt"], s["misses"], s["blocks_on_disk"]) == (2, 1, 1, 2)
    tier.close()


def test_a_segment_cut_after_it_is_mapped_is_read_with_pread_not_a_sigbus(tmp_path, monkeypatch):
    tier, ms = seg_tier(tmp_path), chain(NS, 3)
    big = [payload_for(i, n=2048) for i in range(3)]  # 16 KB each: four pages or more
    for m, data in zip(ms, big, strict=True):
        assert tier.put(m, data, timeout=None)
    tier.flush()
    real_map, fallbacks = ssd_segments._map, []
    real_read = ssd_segments._read_run

    def map_then_cut(path):
        m = real_map(path)
        _cut(path, HEAD.size + len(big[0]) + HEAD.size + 100)  # (later pages would SIGBUS)
        return m

    def reading(path, run):
        fallbacks.append(len(run))
        return real_read(path, run)

    monkeypatch.setattr(ssd_segments, "_map", map_then_cut)
    monkeypatch.setattr(ssd_segments, "_read_run", reading)
    got = tier.get_many([m.block_hash for m in ms])
    assert fallbacks == [3]  # the populate failed (EFAULT): the run read with pread
    assert type(got[0][0]) is bytes and got[0][0] == big[0]
    assert [type(g) for g in got[1:]] == [CorruptBlockError] * 2
    s = tier.stats()
    assert (s["hits"], s["corrupt"], s["misses"], s["blocks_on_disk"]) == (1, 2, 2, 1)
    tier.close()


def test_views_stay_valid_after_their_segment_is_compacted_away(tmp_path):
    tier = seg_tier(tmp_path, segment_bytes=2 * REC)
    a, b, c = chain(NS, 3)
    for i, m in enumerate((a, b, c)):
        tier.put(m, payload_for(i))
        tier.flush()
    first, _second = segs(tmp_path)
    got = tier.get_many([a.block_hash, b.block_hash])  # both views of ``first``
    assert tier.discard([a.block_hash]) == 1 and tier.sweep() == 1  # b moved, first unlinked
    assert not first.exists()
    assert [bytes(g[0]) for g in got] == [payload_for(0), payload_for(1)]
    assert decode(got[1][0]).buffer.tobytes() == decode(payload_for(1)).buffer.tobytes()
    tier.close()


def test_a_promoted_block_owns_its_bytes_not_a_view_of_the_segment(tmp_path):
    import numpy as np

    from promptcache.cache import PromptCache
    from promptcache.config import CacheConfig
    from promptcache.meta import Namespace

    def payload(start, end, _snapshot):
        return {"0.k": np.arange(start, end, dtype=np.float32).reshape(-1, 1).repeat(2, axis=1)}

    ns, seq = Namespace("test-model", 4), list(range(1, 13))
    tier = seg_tier(tmp_path)
    cache = PromptCache(CacheConfig(block_size=4, ram_budget_bytes=10**6), lower=[tier])
    cache.store(ns, seq, 12, payload, snapshot_at_end=False)
    assert cache.evict() == 3 and tier.flush()
    hit = cache.acquire(seq, ns)  # promoted through one get_many: views of the segment
    assert hit.num_tokens == 11 and hit.tiers == ["ssd"] * 3
    for (_meta, got), start in zip(hit.blocks, (0, 4, 8), strict=True):
        np.testing.assert_array_equal(got["0.k"], payload(start, start + 4, False)["0.k"])
        base = got["0.k"]
        while getattr(base, "base", None) is not None:
            base = base.base
        assert type(base) is memoryview and type(base.obj) is bytes  # copied at promotion: RAM pins no segment mapping
    cache.release(hit)
    cache.close()
