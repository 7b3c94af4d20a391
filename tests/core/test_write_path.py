"""Writing RAM blocks to lower tiers without silent loss (cache/lower.py): write-through
that waits for room instead of dropping, demotion with back-pressure, persist at
close within a time limit, and encoding off the request path. The lower tier is a
QueueTier: a bounded queue whose writer runs only while its gate is open, so every
state is reached without timing."""

from __future__ import annotations

import logging
import threading

import numpy as np
from core_helpers import BYTES_PER_TOKEN, FakeTier, QueueTier, make_cache, ns_of, payload_for

from promptcache.cache.types import NumpyAdapter

NS = ns_of(4)
BLOCK = 4 * BYTES_PER_TOKEN


def seq(n_blocks: int, first: int = 1) -> list[int]:
    return list(range(first, first + 4 * n_blocks))


class CountingAdapter(NumpyAdapter):
    def __init__(self) -> None:
        self.threads: list[str] = []

    def to_buffer(self, payload):  # type: ignore[no-untyped-def]
        self.threads.append(threading.current_thread().name)
        return super().to_buffer(payload)


def test_write_through_burst_waits_for_room_and_keeps_the_order():
    tier = QueueTier(capacity=4)
    adapter = CountingAdapter()
    cache = make_cache(lower=[tier], write_through=True, adapter=adapter)
    assert cache.store(NS, seq(12), 48, payload_for) == 12
    s = cache.stats()
    assert (s.write_through, s.write_through_deferred, s.unwritten_blocks) == (4, 8, 8)
    assert adapter.threads == []  # nothing was encoded on the request path
    assert cache.flush(timeout=0) is False
    tier.gate.set()
    assert cache.flush(timeout=None) is True
    assert tier.write_order == [4 * i for i in range(12)]
    s = cache.stats()
    assert (s.write_through, s.unwritten_blocks, s.demotion_failures) == (12, 0, 0)
    assert all(t != threading.current_thread().name for t in adapter.threads)
    assert len(adapter.threads) == 12
    cache.evict()
    assert cache.stats().demotions == 0  # all persisted: no second write
    cache.close()


def test_blocks_stored_while_others_wait_go_behind_them():
    tier = QueueTier(capacity=2)
    cache = make_cache(lower=[tier], write_through=True)
    cache.store(NS, seq(3), 12, payload_for)  # 2 accepted, 1 waits
    cache.store(NS, seq(3, first=100), 12, payload_for)  # all 3 wait behind it
    assert cache.stats().unwritten_blocks == 4
    tier.gate.set()
    assert cache.flush() is True
    assert tier.write_order == [0, 4, 8, 0, 4, 8]
    assert len(tier.blocks) == 6
    cache.close()


def test_evicting_an_unwritten_block_writes_it_first():
    tier = QueueTier(capacity=1)
    cache = make_cache(budget=3 * BLOCK, lower=[tier], write_through=True)
    cache.store(NS, seq(3), 12, payload_for, snapshot_at_end=False)  # 1 accepted, 2 unwritten
    assert cache.stats().unwritten_blocks == 2
    opener = threading.Thread(target=lambda: (tier.wait_for_waiting_put(), tier.gate.set()))
    opener.start()
    # a new sequence evicts the LRU blocks (tails first): they must be written first
    cache.store(NS, seq(1, first=500), 4, payload_for, snapshot_at_end=False)
    opener.join()
    assert cache.flush() is True
    assert len(tier.blocks) == 4
    assert cache.lookup(seq(3) + [0], NS).num_tokens == 12
    s = cache.stats()
    assert (s.demotion_failures, s.evicted_dropped, s.unwritten_blocks) == (0, 0, 0)
    cache.close()


def test_an_evicted_block_that_finds_no_room_in_time_is_a_counted_failure():
    tier = QueueTier(capacity=1)
    cache = make_cache(budget=2 * BLOCK, lower=[tier], demote_timeout_s=0.01)
    cache.store(NS, seq(2), 8, payload_for, snapshot_at_end=False)
    assert cache.evict(2) == 2  # the first fills the queue, the second cannot get in
    s = cache.stats()
    assert (s.demotions, s.demotion_failures) == (1, 1)
    assert tier.put_timeouts == [0.01, 0.01]
    cache.close(persist=False)


def test_a_deleted_unwritten_block_is_never_written():
    tier = QueueTier(capacity=1)
    cache = make_cache(lower=[tier], write_through=True)
    cache.store(NS, seq(3), 12, payload_for, session_id="s")
    cache.store(NS, seq(2, first=100), 8, payload_for, session_id="keep")
    assert cache.stats().unwritten_blocks == 4
    cache.delete_session("s")
    assert cache.stats().unwritten_blocks == 2
    tier.gate.set()
    assert cache.flush() is True
    assert sorted(m.token_ids[0] for m, _, _ in tier.blocks.values()) == [100, 104]
    cache.close()


def test_a_refusal_while_there_is_room_is_final_and_counted():
    tier = QueueTier(capacity=4)
    tier.refuse_put = True  # e.g. an admission rule
    cache = make_cache(lower=[tier], write_through=True)
    cache.store(NS, seq(3), 12, payload_for)
    s = cache.stats()
    assert (s.write_through, s.write_through_deferred, s.unwritten_blocks) == (0, 0, 0)
    assert s.demotion_failures == 3
    cache.close(persist=False)


def test_close_persists_every_ram_block_with_back_pressure():
    for write_through in (False, True):
        tier = QueueTier(capacity=4)
        tier.gate.set()
        cache = make_cache(budget=2000 * BLOCK, lower=[tier], write_through=write_through)
        for i in range(100):  # 100 sequences of 10 blocks: 1000 RAM blocks
            cache.store(NS, seq(10, first=1 + 1000 * i), 40, payload_for)
        assert cache.stats().ram_blocks == 1000
        cache.close()
        s = cache.stats()
        assert len(tier.blocks) == 1000
        assert s.persist_failures == 0 and s.demotion_failures == 0
        assert s.persisted_on_close + s.write_through == 1000
        if not write_through:
            assert s.persisted_on_close == 1000
            assert cache.last_persist is not None and cache.last_persist.written == 1000


def test_persist_gives_up_at_its_time_limit_and_names_what_is_missing(caplog):
    tier = QueueTier(capacity=2)  # the gate stays closed: the disk never writes
    cache = make_cache(lower=[tier])
    cache.store(NS, seq(5), 20, payload_for)
    with caplog.at_level(logging.INFO, logger="promptcache.cache.lower"):
        assert cache.persist(timeout=0.05) == 0
    report = cache.last_persist
    assert report is not None
    assert (report.blocks, report.written, report.failed, report.timed_out) == (5, 0, 5, True)
    assert report.failed_names[0].startswith("default@0:")
    assert cache.stats().persist_failures == 5
    assert "persisting 5 RAM blocks" in caplog.text
    assert "5 of 5 RAM blocks did not reach ssd (time limit reached): default@0:" in caplog.text
    cache.close(persist=False)


def test_persist_counts_blocks_a_tier_accepted_but_did_not_store():
    tier = QueueTier(capacity=8)
    tier.gate.set()
    tier.lose_writes = True
    cache = make_cache(lower=[tier])
    cache.store(NS, seq(3), 12, payload_for)
    assert cache.persist() == 0
    assert cache.stats().persist_failures == 3
    tier.lose_writes = False
    assert cache.persist() == 3  # not marked persisted: tried again
    cache.close()


def test_persist_skips_what_a_tier_already_holds():
    tier = FakeTier()
    cache = make_cache(lower=[tier], write_through=True)
    cache.store(NS, seq(3), 12, payload_for)
    assert len(tier.put_hits) == 3
    assert cache.persist() == 0 and len(tier.put_hits) == 3


def test_an_upgraded_block_is_written_through_again():
    tier = FakeTier()
    cache = make_cache(lower=[tier], write_through=True)
    cache.store(NS, seq(2), 8, payload_for, truncatable=False, snapshot_at_end=False)
    cache.store(NS, seq(2), 8, payload_for, truncatable=False, snapshot_at_end=True)
    assert cache.stats().upgrades == 1
    assert len(tier.put_hits) == 3  # two blocks, then the upgraded one again
    h = cache.lookup(seq(2) + [0], NS).blocks[-1].block_hash
    _, data, _ = tier.blocks[h]
    assert b"0.s.0" in data
    arrays = cache.acquire(seq(2) + [0], NS).blocks[-1][1]
    np.testing.assert_array_equal(arrays["0.s.0"], np.array([8.0], dtype=np.float32))


def test_per_tier_policy_with_a_full_write_through_queue():
    """A write-back tier and a write-through tier (``policy``) whose queue is full: the
    new blocks go only to the write-through tier (waiting in RAM for room, in order),
    a new session reaches only the tiers holding the block, eviction writes each block
    to the write-back tier only, and persist writes only what a tier lacks."""
    back = FakeTier("back")
    through = QueueTier(capacity=2, name="through")
    through.policy = "write_through"  # type: ignore[attr-defined]
    cache = make_cache(budget=2000 * BLOCK, lower=[back, through], write_through=False)
    assert cache.store(NS, seq(5), 20, payload_for, session_id="s1") == 5
    s = cache.stats()
    assert (s.write_through, s.write_through_deferred, s.unwritten_blocks) == (2, 3, 3)
    assert back.put_hits == [] and len(through.put_timeouts) == 2
    through.gate.set()
    assert cache.flush(timeout=None) is True
    assert through.write_order == [0, 4, 8, 12, 16] and back.blocks == {}
    assert cache.stats().write_through == 5
    cache.store(NS, seq(5), 20, payload_for, session_id="s2")  # reaches the holder only
    assert all(sess == {"s1", "s2"} for _, _, sess in through.blocks.values())
    assert cache.store(NS, seq(2, first=500), 8, payload_for) == 2
    assert cache.flush(timeout=None) is True
    assert cache.evict(5) == 5  # the first five: each goes to the write-back tier only
    assert len(back.blocks) == 5 and len(through.put_timeouts) == 7
    assert cache.persist(timeout=None) == 2  # the last two: they lack only "back"
    assert len(back.blocks) == 7 and len(through.put_timeouts) == 7
    assert cache.stats().persist_failures == 0
    cache.close()


def test_protected_blocks_are_written_first_ahead_of_the_write_through_backlog():
    tier = QueueTier(capacity=2)
    cache = make_cache(lower=[tier], write_through=True)
    cache.store(NS, seq(3), 12, payload_for)  # 2 accepted, 1 waits
    cache.store(NS, seq(3, first=100), 12, payload_for)  # 3 wait behind it
    cache.store(NS, seq(3, first=200), 12, payload_for)  # 3 more
    assert cache.stats().unwritten_blocks == 7
    assert cache.protect(seq(3, first=200), NS, 8, 300.0) == 2  # a breakpoint: 2 blocks
    assert cache.stats().unwritten_blocks == 7
    tier.gate.set()
    assert cache.flush() is True
    # the two queued first, then the breakpoint's blocks, then the backlog in its order
    written = [(m.start, m.token_ids[0]) for m, _, _ in tier.blocks.values()]  # in order
    assert written == [(0, 1), (4, 5), (0, 200), (4, 204),
                       (8, 9), (0, 100), (4, 104), (8, 108), (8, 208)]
    cache.close()


def test_protected_blocks_go_to_write_back_tiers_at_once():
    tier = QueueTier(capacity=8)
    cache = make_cache(lower=[tier])  # write-back: nothing is written at store
    cache.store(NS, seq(3), 12, payload_for)
    assert cache.stats().unwritten_blocks == 0 and tier.queue == []
    cache.protect(seq(3), NS, 12, 300.0, persist=False)
    assert tier.queue == []
    cache.protect(seq(3), NS, 12, 300.0)
    assert [m.start for m, _, _ in tier.queue] == [0, 4, 8]
    tier.gate.set()
    assert cache.flush() is True
    cache.close()
