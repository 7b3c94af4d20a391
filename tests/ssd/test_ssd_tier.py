"""Unit tests of the SSD tier: exact values for every rule."""

import threading
import time
from pathlib import Path

import pytest
from ssd_helpers import NS, NS_BOB, FakeClock, chain, make_tier, payload_for

from promptcache.meta import BlockMeta

SIZE = len(payload_for(0))


def block_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*.safetensors") if "quarantine" not in p.parts)


def test_payloads_have_equal_size():
    assert {len(payload_for(i)) for i in range(10)} == {SIZE}


def test_put_get_round_trip_meta_and_children(tmp_path):
    tier = make_tier(tmp_path)
    ms = chain(NS, 3)
    for i, m in enumerate(ms):
        assert tier.put(m, payload_for(i), ["s1"]) is True
    tier.flush()
    for i, m in enumerate(ms):
        assert tier.get_meta(m.block_hash) == m
        assert tier.get(m.block_hash) == payload_for(i)
    assert tier.children(NS.root) == [ms[0]]
    assert tier.children(ms[0].block_hash) == [ms[1]]
    assert tier.children(ms[2].block_hash) == []
    assert tier.get_meta(b"\x00" * 32) is None
    assert tier.get(b"\x00" * 32) is None
    s = tier.stats()
    assert (s["spills"], s["hits"], s["misses"]) == (3, 3, 1)
    assert (s["blocks_on_disk"], s["bytes_on_disk"], s["bytes_written"]) == (3, 3 * SIZE, 3 * SIZE)
    assert s["reload_latency_ms"]["count"] == 3
    assert s["degraded"] is False
    assert tier.sessions_of(ms[1].block_hash) == ["s1"]
    files = block_files(tmp_path)
    assert files == sorted(m.block_hash.hex() + ".safetensors" for m in ms)
    tier.close()


def test_children_lists_siblings_sorted_by_hash(tmp_path):
    tier = make_tier(tmp_path)
    a = chain(NS, 2, first_token=0)
    b = chain(NS, 2, first_token=100)
    c_meta = BlockMeta(
        b[1].block_hash, a[0].block_hash, b[1].token_ids, 4, namespace_key=NS.key, tenant="alice"
    )
    for i, m in enumerate([a[0], a[1], c_meta]):
        tier.put(m, payload_for(i))
    tier.flush()
    kids = tier.children(a[0].block_hash)
    assert kids == sorted([a[1], c_meta], key=lambda m: m.block_hash)
    tier.close()


def test_survives_reopen_and_counts_bytes_written(tmp_path):
    tier = make_tier(tmp_path)
    ms = chain(NS, 2)
    for i, m in enumerate(ms):
        tier.put(m, payload_for(i), ["s"])
    tier.close()
    tier = make_tier(tmp_path)
    assert tier.startup_report is not None and tier.startup_report.problems == 0
    assert tier.get(ms[1].block_hash) == payload_for(1)
    assert tier.get_meta(ms[0].block_hash) == ms[0]
    s = tier.stats()
    assert (s["blocks_on_disk"], s["bytes_on_disk"], s["bytes_written"]) == (2, 2 * SIZE, 2 * SIZE)
    tier.close()


def test_queued_blocks_are_visible_before_they_are_written(tmp_path):
    tier = make_tier(tmp_path)
    ms = chain(NS, 2)
    with tier.catalog.write_lock:  # the writer cannot write while we hold it
        tier.put(ms[0], payload_for(0))
        tier.put(ms[1], payload_for(1))
        assert tier.get_meta(ms[1].block_hash) == ms[1]
        assert tier.children(ms[0].block_hash) == [ms[1]]
        assert tier.get(ms[0].block_hash) == payload_for(0)
        assert block_files(tmp_path) == []
    tier.flush()
    assert len(block_files(tmp_path)) == 2
    assert tier.stats()["queue_depth"] == 0
    tier.close()


def test_same_block_twice_is_written_once(tmp_path):
    tier = make_tier(tmp_path)
    m = chain(NS, 1)[0]
    tier.put(m, payload_for(0), ["a"])
    tier.flush()
    tier.put(m, payload_for(0), ["b"])
    tier.flush()
    s = tier.stats()
    assert (s["spills"], s["dedup_writes"], s["bytes_written"]) == (1, 1, SIZE)
    assert tier.sessions_of(m.block_hash) == ["a", "b"]
    tier.close()


def test_rewrite_goes_to_the_other_name_and_removes_the_old_file(tmp_path):
    tier = make_tier(tmp_path)
    m = chain(NS, 1)[0]
    hx = m.block_hash.hex()
    tier.put(m, payload_for(0))
    tier.flush()
    assert block_files(tmp_path) == [hx + ".safetensors"]
    tier.put(m, payload_for(7))
    tier.flush()
    assert block_files(tmp_path) == [hx + ".1.safetensors"]
    assert tier.get(m.block_hash) == payload_for(7)
    tier.put(m, payload_for(8))
    tier.flush()
    assert block_files(tmp_path) == [hx + ".safetensors"]
    assert tier.get(m.block_hash) == payload_for(8)
    s = tier.stats()
    assert (s["spills"], s["blocks_on_disk"], s["bytes_on_disk"]) == (3, 1, SIZE)
    assert tier.check().problems == 0
    tier.close()


def test_sessions_delete_only_blocks_left_without_any(tmp_path):
    tier = make_tier(tmp_path)
    a, b, c = chain(NS, 3)
    tier.put(a, payload_for(0), ["s1"])
    tier.put(b, payload_for(1), ["s1", "s2"])
    tier.put(c, payload_for(2))  # never had a session: kept
    tier.flush()
    tier.add_sessions(c.block_hash, ["s3"])
    assert tier.delete_session("s1") == 1
    assert tier.get_meta(a.block_hash) is None
    assert tier.get_meta(b.block_hash) == b
    assert tier.delete_session("s2") == 1
    assert tier.get_meta(b.block_hash) is None
    assert tier.delete_session("nobody") == 0
    assert tier.delete_session("s3") == 1
    assert block_files(tmp_path) == []
    assert tier.stats()["blocks_on_disk"] == 0
    with pytest.raises(ValueError):
        tier.delete_session("")
    tier.close()


def test_block_without_sessions_survives_session_deletes(tmp_path):
    tier = make_tier(tmp_path)
    a = chain(NS, 1)[0]
    tier.put(a, payload_for(0))
    tier.flush()
    assert tier.delete_session("s1") == 0
    assert tier.get(a.block_hash) == payload_for(0)
    tier.close()


def test_delete_session_cancels_queued_blocks(tmp_path):
    tier = make_tier(tmp_path)
    a, b = chain(NS, 2)
    with tier.catalog.write_lock:
        tier.put(a, payload_for(0), ["gone"])
        tier.put(b, payload_for(1), ["gone", "kept"])
        assert tier.delete_session("gone") == 1
    tier.flush()
    assert tier.get_meta(a.block_hash) is None
    assert tier.sessions_of(b.block_hash) == ["kept"]
    assert block_files(tmp_path) == [b.block_hash.hex() + ".safetensors"]
    tier.close()


def test_delete_tenant(tmp_path):
    tier = make_tier(tmp_path)
    alice = chain(NS, 3)
    bob = chain(NS_BOB, 2)
    for i, m in enumerate(alice + bob):
        tier.put(m, payload_for(i))
    tier.flush()
    assert tier.tenants() == [("alice", 3, 3 * SIZE), ("bob", 2, 2 * SIZE)]
    assert tier.delete_tenant("bob") == 2
    assert all(tier.get_meta(m.block_hash) is None for m in bob)
    assert all(tier.get_meta(m.block_hash) == m for m in alice)
    assert list((tmp_path / NS_BOB.key / "bob").rglob("*.safetensors")) == []
    assert tier.delete_tenant(None) == 3
    assert tier.stats()["bytes_on_disk"] == 0
    assert block_files(tmp_path) == []
    tier.close()


def test_capacity_evicts_least_recently_used_first(tmp_path):
    clock = FakeClock()
    tier = make_tier(tmp_path, budget_bytes=3 * SIZE, clock=clock)
    ms = chain(NS, 5)
    for i in range(3):
        tier.put(ms[i], payload_for(i))
        tier.flush()
        clock.advance(1)
    assert tier.get(ms[0].block_hash) == payload_for(0)  # b0 becomes the most recent
    clock.advance(1)
    tier.put(ms[3], payload_for(3))
    tier.flush()
    live = [i for i, m in enumerate(ms) if tier.get_meta(m.block_hash) is not None]
    assert live == [0, 2, 3]
    clock.advance(1)
    tier.put(ms[4], payload_for(4))
    tier.flush()
    live = [i for i, m in enumerate(ms) if tier.get_meta(m.block_hash) is not None]
    assert live == [0, 3, 4]
    s = tier.stats()
    assert (s["evictions_capacity"], s["blocks_on_disk"], s["bytes_on_disk"]) == (2, 3, 3 * SIZE)
    assert len(block_files(tmp_path)) == 3
    tier.close()


def test_block_larger_than_capacity_is_dropped(tmp_path):
    tier = make_tier(tmp_path, budget_bytes=SIZE - 1)
    assert tier.put(chain(NS, 1)[0], payload_for(0)) is False
    tier.flush()
    s = tier.stats()
    assert s["dropped_spills"]["budget"] == 1 and s["spills"] == 0
    tier.close()


def test_ttl_expires_unused_blocks(tmp_path):
    clock = FakeClock()
    tier = make_tier(tmp_path, ttl_seconds=100, clock=clock)
    a, b = chain(NS, 2)
    tier.put(a, payload_for(0))
    tier.put(b, payload_for(1))
    tier.flush()
    clock.advance(50)
    assert tier.get(a.block_hash) == payload_for(0)  # refreshes a's expiry to t+150
    tier.flush()
    clock.advance(60)  # t+110: b (expiry t+100) is expired, a is not
    assert tier.get_meta(b.block_hash) is None
    assert tier.get(b.block_hash) is None
    assert tier.children(a.block_hash) == []
    assert tier.get_meta(a.block_hash) == a
    assert tier.sweep() == 1
    s = tier.stats()
    assert (s["evictions_ttl"], s["blocks_on_disk"], s["bytes_on_disk"]) == (1, 1, SIZE)
    assert block_files(tmp_path) == [a.block_hash.hex() + ".safetensors"]
    clock.advance(50)
    assert tier.sweep() == 1
    assert tier.stats()["blocks_on_disk"] == 0
    tier.close()


def test_full_queue_drops_and_counts(tmp_path):
    tier = make_tier(tmp_path, queue_size=2)
    ms = chain(NS, 5)
    with tier.catalog.write_lock:
        assert tier.put(ms[0], payload_for(0)) is True
        deadline = time.monotonic() + 5
        while tier.queued.queue.qsize() and time.monotonic() < deadline:  # writer took ms[0]
            time.sleep(0.005)
        results = [tier.put(m, payload_for(i + 1)) for i, m in enumerate(ms[1:])]
    assert results == [True, True, False, False]
    tier.flush()
    s = tier.stats()
    assert s["dropped_spills"]["queue_full"] == 2
    assert s["spills"] == 3
    assert [tier.get_meta(m.block_hash) is not None for m in ms] == [True, True, True, False, False]
    tier.close()


def test_put_never_blocks_while_the_writer_is_stuck(tmp_path):
    """The writer is held (we own its lock); 50 puts from another thread return at
    once: a put that waited would never return while we hold the lock (the join's
    bound only turns such a hang into a failure, it measures nothing)."""
    tier = make_tier(tmp_path, queue_size=4)
    ms = chain(NS, 50)
    results: list[bool] = []
    with tier.catalog.write_lock:
        assert tier.put(ms[0], payload_for(0))
        deadline = time.monotonic() + 30
        while tier.queued.queue.qsize() and time.monotonic() < deadline:  # the writer took ms[0]
            time.sleep(0.005)
        putter = threading.Thread(
            target=lambda: results.extend(tier.put(m, payload_for(i + 1)) for i, m in enumerate(ms[1:])))
        putter.start()
        putter.join(timeout=60)
        assert not putter.is_alive(), "a put waited for the stuck writer"
    tier.flush()
    assert results == [True] * 4 + [False] * 45  # exactly the queue's 4 places
    assert tier.stats()["dropped_spills"]["queue_full"] == 45
    tier.close()


def test_admission_min_tokens(tmp_path):
    tier = make_tier(tmp_path, admission_min_tokens=8)
    a, b = chain(NS, 2)  # ends at 4 and 8
    assert tier.put(a, payload_for(0)) is False
    assert tier.put(b, payload_for(1)) is True
    tier.flush()
    s = tier.stats()
    assert (s["dropped_spills"]["admission"], s["spills"]) == (1, 1)
    tier.close()


def test_admission_min_hits(tmp_path):
    tier = make_tier(tmp_path, admission_min_hits=2)
    a, b, c = chain(NS, 3)
    assert tier.put(a, payload_for(0), hits=1) is False
    assert tier.put(b, payload_for(1)) is False  # unknown hit count counts as 0
    assert tier.put(c, payload_for(2), hits=2) is True
    tier.flush()
    s = tier.stats()
    assert (s["dropped_spills"]["admission"], s["spills"]) == (2, 1)
    tier.close()


def test_daily_write_budget(tmp_path):
    clock = FakeClock(86400 * 20000 + 3600.0)  # 01:00 UTC
    tier = make_tier(tmp_path, daily_write_budget_bytes=2 * SIZE + SIZE // 2, clock=clock)
    ms = chain(NS, 4)
    assert [tier.put(m, payload_for(i)) for i, m in enumerate(ms[:3])] == [True, True, False]
    tier.flush()
    assert tier.stats()["dropped_spills"]["write_budget"] == 1
    assert tier.stats()["bytes_written_today"] == 2 * SIZE
    tier.close()
    tier = make_tier(tmp_path, daily_write_budget_bytes=2 * SIZE + SIZE // 2, clock=clock)
    assert tier.put(ms[2], payload_for(2)) is False  # the day's count survived the restart
    clock.advance(86400)
    assert tier.put(ms[2], payload_for(2)) is True
    tier.flush()
    s = tier.stats()
    assert (s["bytes_written"], s["bytes_written_today"]) == (3 * SIZE, SIZE)
    tier.close()


def test_bad_input_raises_value_error(tmp_path):
    tier = make_tier(tmp_path)
    m = chain(NS, 1)[0]
    with pytest.raises(ValueError):
        tier.put(m, "text")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tier.put(m, payload_for(0), "session")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        tier.put(BlockMeta(b"x", b"y", (1,), 0), payload_for(0))  # type: ignore[arg-type]
    bad_ns = BlockMeta(m.block_hash, m.parent_hash, m.token_ids, 0, namespace_key="../etc")
    with pytest.raises(ValueError):
        tier.put(bad_ns, payload_for(0))
    with pytest.raises(ValueError):
        tier.purge(older_than_s=-1)
    tier.close()


def test_put_after_close_is_dropped(tmp_path):
    tier = make_tier(tmp_path)
    tier.close()
    assert tier.put(chain(NS, 1)[0], payload_for(0)) is False
    assert tier.stats()["dropped_spills"]["closed"] == 1
    tier.close()  # idempotent


def test_purge_older_than(tmp_path):
    clock = FakeClock()
    tier = make_tier(tmp_path, clock=clock)
    a, b = chain(NS, 2)
    tier.put(a, payload_for(0))
    tier.flush()
    clock.advance(3600)
    tier.put(b, payload_for(1))
    tier.flush()
    assert tier.purge(older_than_s=1800) == 1
    assert tier.get_meta(a.block_hash) is None and tier.get_meta(b.block_hash) == b
    tier.close()


def test_concurrent_readers_and_writer(tmp_path):
    tier = make_tier(tmp_path)
    ms = chain(NS, 40)
    for i, m in enumerate(ms[:20]):
        tier.put(m, payload_for(i))
    tier.flush()
    errors: list[BaseException] = []

    def reader() -> None:
        try:
            for _ in range(5):
                for i, m in enumerate(ms[:20]):
                    assert tier.get(m.block_hash) == payload_for(i)
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for i, m in enumerate(ms[20:], start=20):
        assert tier.put(m, payload_for(i), timeout=None)  # back-pressure, no retry loop
    for t in threads:
        t.join()
    tier.flush()
    assert errors == []
    assert tier.stats()["blocks_on_disk"] == 40
    assert tier.check().problems == 0
    tier.close()
