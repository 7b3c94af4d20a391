"""Read-ahead in SSDTier.get: the next blocks of a chain are read and verified on
worker threads; a read-ahead copy is served only if it is still exactly what the
index row names, so damage done after the read-ahead is still caught."""

import os
import time
from pathlib import Path

import pytest
from ssd_helpers import NS, FakeClock, chain, make_tier, payload_for

from promptcache.errors import CorruptBlockError
from promptcache.hashing import hash_block
from promptcache.meta import BlockMeta
from promptcache.tiers.ssd_ahead import ReadAhead
from promptcache.tiers.ssd_files import block_rel_path

OLD = time.time() - 3600  # file times an hour ago: older than the stamp margin


def path_of(root: Path, m) -> Path:
    return root / block_rel_path(m.namespace_key, m.tenant, m.block_hash.hex())


def stored(tmp_path: Path, n: int, *, age: bool = True, **kw):
    tier = make_tier(tmp_path, **kw)
    ms = chain(NS, n)
    for i, m in enumerate(ms):
        assert tier.put(m, payload_for(i), ["s"])
    tier.flush()
    if age:
        for m in ms:
            os.utime(path_of(tmp_path, m), (OLD, OLD))
    return tier, ms


def ahead(tier):
    return tier.stats()["read_ahead"]


def test_a_chain_is_read_ahead_and_served_from_the_read_ahead(tmp_path):
    tier, ms = stored(tmp_path, 7, read_ahead_blocks=3)
    assert tier.get(ms[0].block_hash) == payload_for(0)
    assert ahead(tier) == {"scheduled": 3, "used": 0, "discarded": 0}  # blocks 1, 2, 3
    tier.reader.ahead.wait()
    for i in range(1, 7):
        assert tier.get(ms[i].block_hash) == payload_for(i)
    # each get tops the window up to 3 blocks ahead: 4, 5, 6 join; the last has no child
    assert ahead(tier) == {"scheduled": 6, "used": 6, "discarded": 0}
    s = tier.stats()
    assert (s["hits"], s["misses"], s["corrupt"]) == (7, 0, 0)
    tier.close()


def test_read_ahead_off_reads_every_block_itself(tmp_path):
    tier, ms = stored(tmp_path, 4, read_ahead_blocks=0)
    assert [tier.get(m.block_hash) for m in ms] == [payload_for(i) for i in range(4)]
    assert ahead(tier) == {"scheduled": 0, "used": 0, "discarded": 0}
    tier.close()


def test_negative_read_ahead_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="read_ahead_blocks"):
        make_tier(tmp_path, read_ahead_blocks=-1)


def test_a_file_modified_just_before_the_read_ahead_is_not_trusted(tmp_path):
    tier, ms = stored(tmp_path, 2, age=False, read_ahead_blocks=1)
    now = time.time()
    os.utime(path_of(tmp_path, ms[1]), (now, now))  # within the coarse-clock margin
    tier.get(ms[0].block_hash)
    tier.reader.ahead.wait()
    assert tier.get(ms[1].block_hash) == payload_for(1)  # read again by get itself
    assert ahead(tier) == {"scheduled": 1, "used": 0, "discarded": 1}
    tier.close()


def test_a_file_damaged_after_the_read_ahead_is_still_quarantined(tmp_path):
    tier, ms = stored(tmp_path, 3, read_ahead_blocks=2)
    tier.get(ms[0].block_hash)
    tier.reader.ahead.wait()  # blocks 1 and 2 were read and verified intact
    p = path_of(tmp_path, ms[1])
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    os.utime(p, (OLD + 60, OLD + 60))  # a new mtime, as any write gives
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        tier.get(ms[1].block_hash)
    assert not p.exists()
    assert [q.name.split(".")[0] for q in (tmp_path / "quarantine").iterdir()] == [ms[1].block_hash.hex()]
    assert tier.get(ms[2].block_hash) == payload_for(2)  # untouched: served from the read-ahead
    assert ahead(tier) == {"scheduled": 2, "used": 1, "discarded": 1}
    s = tier.stats()
    assert (s["corrupt"], s["quarantined"], s["blocks_on_disk"]) == (1, 1, 2)
    tier.close()


def test_a_file_damaged_before_the_read_ahead_is_quarantined_by_get(tmp_path):
    tier, ms = stored(tmp_path, 3, read_ahead_blocks=2)
    p = path_of(tmp_path, ms[2])
    p.write_bytes(p.read_bytes()[:-4])
    os.utime(p, (OLD, OLD))
    tier.get(ms[0].block_hash)
    tier.reader.ahead.wait()
    assert tier.get(ms[1].block_hash) == payload_for(1)
    with pytest.raises(CorruptBlockError, match="size mismatch"):
        tier.get(ms[2].block_hash)
    assert ahead(tier) == {"scheduled": 2, "used": 1, "discarded": 1}
    assert tier.stats()["quarantined"] == 1
    tier.close()


def test_a_deleted_file_after_the_read_ahead_is_a_missing_file(tmp_path):
    tier, ms = stored(tmp_path, 2, read_ahead_blocks=1)
    tier.get(ms[0].block_hash)
    tier.reader.ahead.wait()
    path_of(tmp_path, ms[1]).unlink()
    with pytest.raises(CorruptBlockError, match="missing"):
        tier.get(ms[1].block_hash)
    s = tier.stats()
    assert (s["missing_files"], s["blocks_on_disk"], s["read_ahead"]["discarded"]) == (1, 1, 1)
    tier.close()


def test_a_block_rewritten_after_the_read_ahead_serves_the_new_payload(tmp_path):
    tier, ms = stored(tmp_path, 2, read_ahead_blocks=1)
    tier.get(ms[0].block_hash)
    tier.reader.ahead.wait()
    assert tier.put(ms[1], payload_for(9))  # a new file and a new row checksum
    tier.flush()
    assert tier.get(ms[1].block_hash) == payload_for(9)
    assert ahead(tier) == {"scheduled": 1, "used": 0, "discarded": 1}
    tier.close()


def test_no_read_ahead_past_a_fork(tmp_path):
    tier, ms = stored(tmp_path, 2, read_ahead_blocks=2)
    toks = tuple(range(100, 104))
    other = BlockMeta(hash_block(ms[0].block_hash, toks), ms[0].block_hash, toks, 4, nbytes=100,
                      namespace_key=NS.key, tenant=NS.tenant)
    assert tier.put(other, payload_for(5))
    tier.flush()
    tier.get(ms[0].block_hash)  # two children: which one comes next is unknown
    assert ahead(tier)["scheduled"] == 0
    assert tier.get(other.block_hash) == payload_for(5)
    tier.close()


def test_read_ahead_is_bounded_and_expires(tmp_path):
    clock = FakeClock(100.0)
    ra = ReadAhead(workers=1, max_blocks=2, max_bytes=100, ttl_s=5.0, clock=clock)
    f = tmp_path / "f"
    f.write_bytes(b"x" * 40)
    os.utime(f, (OLD, OLD))
    from promptcache.codec import checksum

    d = checksum(b"x" * 40)
    assert ra.schedule(b"a", f, "f", 40, d)
    assert not ra.schedule(b"a", f, "f", 40, d)  # already there
    assert ra.schedule(b"b", f, "f", 40, d)
    assert not ra.schedule(b"c", f, "f", 40, d)  # max_blocks
    assert ra.take(b"b", f, "f", d) == b"x" * 40
    assert not ra.schedule(b"c", f, "f", 70, d)  # 40 + 70 > max_bytes
    clock.advance(5.01)
    assert ra.schedule(b"c", f, "f", 40, d)  # "a" expired and was dropped
    assert "a" not in [k.decode() for k in ra._entries]
    assert ra.take(b"c", f, "other-name", d) is None  # another file than the row names
    assert ra.counts == {"scheduled": 3, "used": 1, "discarded": 2}
    ra.close()
    assert not ra.schedule(b"d", f, "f", 40, d)
    with pytest.raises(ValueError):
        ReadAhead(workers=0)

