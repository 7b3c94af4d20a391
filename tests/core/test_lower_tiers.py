"""Demotion to and promotion from lower tiers (an in-memory fake Tier)."""

import dataclasses

import numpy as np
import pytest
from core_helpers import BYTES_PER_TOKEN, FakeTier, make_cache, ns_of, payload_for

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig

NS = ns_of(4)
SEQ = list(range(1, 13))
BLOCK = 4 * BYTES_PER_TOKEN


def demoted(budget=3 * BLOCK, **kw):
    tier = FakeTier()
    cache = make_cache(budget=budget, lower=[tier], **kw)
    cache.store(NS, SEQ, 12, payload_for, snapshot_at_end=False, session_id="s1")
    assert cache.evict() == 3
    return cache, tier


def test_evicted_blocks_are_demoted_and_promoted_back():
    cache, tier = demoted()
    assert len(tier.blocks) == 3 and cache.stats().demotions == 3
    assert all(s == {"s1"} for _, _, s in tier.blocks.values())
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 11 and m.tiers == ["ssd"] * 3 and m.tokens_by_tier == {"ssd": 11}
    assert [b.token_ids for b in m.blocks] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
    assert tier.gets == []  # lookup reads metadata only
    hit = cache.acquire(SEQ, NS)
    assert hit.num_tokens == 11 and hit.tokens_by_tier == {"ssd": 11} and hit.tiers == ["ssd"] * 3
    for (meta, payload), start in zip(hit.blocks, (0, 4, 8), strict=True):
        assert meta.start == start
        np.testing.assert_array_equal(payload["0.k"], payload_for(start, start + 4, False)["0.k"])
    s = cache.stats()
    assert (s.promotions, s.ram_blocks, s.hit_tokens_by_tier) == (3, 3, {"ssd": 11})
    cache.release(hit)
    assert cache.lookup(SEQ, NS).tiers == ["ram"] * 3
    # promoted blocks are known to be in the lower tier: no second write on eviction
    cache.evict()
    assert cache.stats().demotions == 3
    cache.check()


def test_mixed_tiers_ram_head_ssd_tail():
    cache, tier = demoted()
    assert cache.store(NS, SEQ, 4, payload_for, snapshot_at_end=False) == 1
    m = cache.lookup(SEQ, NS)
    assert m.tiers == ["ram", "ssd", "ssd"] and m.tokens_by_tier == {"ram": 4, "ssd": 7}
    hit = cache.acquire(SEQ, NS)
    assert hit.num_tokens == 11 and hit.tokens_by_tier == {"ram": 4, "ssd": 7}
    cache.release(hit)


def test_partial_tail_found_through_lower_children():
    tier = FakeTier()
    cache = make_cache(lower=[tier])
    cache.store(NS, SEQ[:10], 10, payload_for)
    cache.evict()
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 10 and m.tiers == ["ssd"] * 3 and m.blocks[-1].token_ids == (9, 10)


def test_promotion_without_room_cuts_the_hit():
    cache, tier = demoted()
    other = [100, 101, 102, 103]
    cache.store(NS, other, 4, payload_for, snapshot_at_end=False)
    busy = cache.acquire(other + [1], NS)  # holds one of the three blocks of RAM
    assert busy.num_tokens == 4
    hit = cache.acquire(SEQ, NS)
    assert hit.num_tokens == 8 and len(hit.blocks) == 2
    assert hit.miss is not None and hit.miss.cause == "promotion_failed" and hit.miss.restorable == 8
    s = cache.stats()
    assert (s.promotions, s.promotion_failures, s.hit_tokens, s.miss_tokens) == (2, 1, 4 + 8, 1 + 4)
    assert s.ram_bytes == s.ram_budget_bytes == 3 * BLOCK
    cache.release(hit)
    cache.release(busy)
    cache.check()


def test_tier_read_error_is_a_counted_miss():
    cache, tier = demoted()
    tier.fail_get = True
    hit = cache.acquire(SEQ, NS)
    assert hit.num_tokens == 0 and hit.blocks == []
    s = cache.stats()
    assert (s.tier_errors, s.promotions, s.ram_blocks) == (1, 0, 0)
    cache.release(hit)
    cache.check()


def test_corrupt_and_vanished_blocks_are_counted_misses():
    cache, tier = demoted()
    tier.corrupt = True
    assert cache.acquire(SEQ, NS).num_tokens == 0
    assert cache.stats().tier_errors == 1
    tier.corrupt = False
    tier.get = lambda h, ns=None: None  # type: ignore[method-assign]  # payload lost after lookup
    assert cache.acquire(SEQ, NS).num_tokens == 0
    assert cache.stats().promotion_failures == 1
    head = next(h for h, (m, _, _) in tier.blocks.items() if m.start == 0)
    tier.blocks.pop(head)
    assert cache.acquire(SEQ, NS).num_tokens == 0


def test_metadata_errors_are_counted_misses():
    cache, tier = demoted()
    tier.fail_meta = True
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 0
    hit = cache.acquire(SEQ, NS)
    assert hit.num_tokens == 0
    assert cache.stats().tier_errors >= 2


def test_lower_tier_metadata_with_other_tokens_is_ignored():
    cache, tier = demoted()
    h, (meta, data, sessions) = next((h, e) for h, e in tier.blocks.items() if e[0].start == 0)
    forged = dataclasses.replace(meta, token_ids=(9, 9, 9, 9))
    tier.blocks[h] = (forged, data, sessions)
    assert cache.lookup(SEQ, NS).num_tokens == 0


def test_write_through_and_demotion_failures():
    tier = FakeTier()
    cache = make_cache(lower=[tier], write_through=True)
    assert cache.store(NS, SEQ, 12, payload_for) == 3
    assert len(tier.blocks) == 3 and cache.stats().write_through == 3
    cache.evict()
    assert cache.stats().demotions == 0  # already persisted
    tier2 = FakeTier()
    tier2.fail_put = True
    cache2 = make_cache(lower=[tier2])
    cache2.store(NS, SEQ, 12, payload_for)
    assert cache2.evict() == 3
    s = cache2.stats()
    assert (s.demotion_failures, s.tier_errors, s.demotions) == (3, 3, 0)
    tier2.fail_put = False
    tier2.refuse_put = True
    cache2.store(NS, SEQ, 4, payload_for)
    cache2.evict()
    assert cache2.stats().demotion_failures == 4


def test_deletes_reach_lower_tiers_and_stats_merge():
    cache, tier = demoted()
    assert cache.stats().tiers == {"ssd": {"blocks": 3, "bytes": sum(len(b) for _, b, _ in tier.blocks.values())}}
    assert cache.delete_session("s1") == 3 and tier.blocks == {}
    cache2, tier2 = demoted()
    assert cache2.delete("default") == 3 and tier2.blocks == {}
    tier2.stats = lambda: (_ for _ in ()).throw(RuntimeError("down"))  # type: ignore[method-assign]
    assert cache2.stats().tiers == {"ssd": {"error": "down"}}
    cache2.close()
    assert tier2.closed


def test_default_codec_round_trip():
    tier = FakeTier()
    cache = PromptCache(CacheConfig(block_size=4, ram_budget_bytes=10**6), lower=[tier])
    cache.store(NS, SEQ, 12, payload_for)
    cache.evict()
    assert tier.blocks and next(iter(tier.blocks.values()))[1][:8] != b"{"  # safetensors bytes
    hit = cache.acquire(SEQ, NS)
    assert hit.num_tokens == 11 and cache.stats().promotions == 3
    np.testing.assert_array_equal(hit.blocks[2][1]["0.s.0"], np.array([12.0], dtype=np.float32))


def test_reuse_counts_travel_with_demotion():
    tier = FakeTier()
    cache = make_cache(budget=3 * BLOCK, lower=[tier])
    cache.store(NS, SEQ, 12, payload_for, snapshot_at_end=False)
    for _ in range(2):
        cache.release(cache.acquire(SEQ[:9], NS))  # reuses the first two blocks
    cache.evict()
    # evicted LRU first: the third block (never reused), then the two reused ones
    assert tier.put_hits == [0, 2, 2]


def test_promoted_block_keeps_its_sessions_for_deletion():
    cache, tier = demoted()
    cache.release(cache.acquire(SEQ, NS))  # promote all three back into RAM
    assert cache.lookup(SEQ, NS).tiers == ["ram"] * 3
    assert cache.delete_session("s1") >= 3
    assert cache.lookup(SEQ, NS).num_tokens == 0
    assert tier.blocks == {}
    cache.check()


def test_a_plan_cuts_the_match_before_promotion_and_reads_are_timed():
    """``acquire(plan=)``: the engine's restore planner sees the match (tiers, blocks)
    and takes its first tokens; the blocks past the cut are neither promoted nor
    referenced. A run read with ``get_many`` is timed into ``hit.reads``."""

    class ManyTier(FakeTier):
        def get_many(self, hashes, *, ns=None):
            return [(self.get(h, ns=ns), self.sessions_of(h, ns=ns)) for h in hashes]

    tier = ManyTier()
    cache = make_cache(budget=3 * BLOCK, lower=[tier])
    cache.store(NS, SEQ, 12, payload_for, snapshot_at_end=False)
    cache.evict()
    assert cache.store(NS, SEQ, 4, payload_for, snapshot_at_end=False) == 1
    seen = []

    def recompute_lower(match):
        seen.append((match.tiers, match.num_tokens))
        return 4

    hit = cache.acquire(SEQ, NS, plan=recompute_lower)
    assert seen == [(["ram", "ssd", "ssd"], 11)]
    assert (hit.num_tokens, hit.tokens_by_tier, hit.tiers, hit.reads) == (4, {"ram": 4}, ["ram"], ())
    assert cache.stats().promotions == 0
    cache.release(hit)
    with pytest.raises(ValueError, match="only at a block's end"):
        cache.acquire(SEQ, NS, plan=lambda m: 6)
    cache.check()
    assert all(b.ref_cnt == 0 for b in cache.pool.blocks())
    hit = cache.acquire(SEQ, NS, plan=lambda m: m.num_tokens)
    assert hit.num_tokens == 11 and hit.tokens_by_tier == {"ram": 4, "ssd": 7}
    (read,) = hit.reads
    assert (read.tier, read.blocks, read.nbytes) == ("ssd", 2, 2 * BLOCK) and read.seconds >= 0
    cache.release(hit)
    # every block in RAM now: the plan is not asked
    hit = cache.acquire(SEQ, NS, plan=lambda m: pytest.fail("asked"))
    assert hit.num_tokens == 11
    cache.release(hit)
    cache.check()
