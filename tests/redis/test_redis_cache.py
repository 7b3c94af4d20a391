"""PromptCache over the Redis tier: two caches (two servers) share blocks through one
Redis; RAM -> SSD -> Redis order; a chain is looked up and read in a fixed number of
round trips; faults are counted misses; deletion and tenants reach Redis."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from redis_servers import RedisServer

from harness.redisproc import wait_until
from promptcache.cache import PromptCache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.meta import Namespace
from promptcache.tiers.redis import RedisTier
from promptcache.tiers.ssd import SSDTier

Make = Callable[..., RedisTier]
BS = 4
BLOCK_BYTES = BS * 2 * 4
NS = Namespace("test-model", BS)
SEQ = list(range(1, 4 * 50 + 3))  # 50 full blocks and a partial one


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    x = np.arange(start, end, dtype=np.float32).reshape(-1, 1).repeat(2, axis=1)
    return {"0.k": x}


def cache_on(*lower: object, budget: int = 1 << 20) -> PromptCache:
    return PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=budget), lower=lower,  # type: ignore[arg-type]
                       write_through=True)


def round_trips(tier: RedisTier) -> int:
    return int(tier.stats()["round_trips"])


def test_two_caches_share_a_conversation(make_tier: Make, redis_url: str) -> None:
    ta, tb = make_tier(redis_url), make_tier(redis_url)
    a, b = cache_on(ta), cache_on(tb)
    assert a.store(NS, SEQ, len(SEQ), payload_for, session_id="chat") == 51
    ta.flush()
    before = round_trips(tb)
    m = b.lookup(SEQ + [999], NS)
    assert m.num_tokens == len(SEQ) and m.tokens_by_tier == {"redis": len(SEQ)}
    # one pipelined lookup of the 50 full blocks, then the children (index + liveness)
    assert round_trips(tb) - before == 3
    before = round_trips(tb)
    hit = b.acquire(SEQ + [999], NS)
    assert hit.num_tokens == len(SEQ) and hit.tokens_by_tier == {"redis": len(SEQ)}
    assert round_trips(tb) - before == 4  # the same lookup, then one read of all 51 blocks
    for meta, payload in hit.blocks:
        np.testing.assert_array_equal(payload["0.k"], payload_for(meta.start, meta.end, False)["0.k"])
    b.release(hit)
    st = b.stats()
    assert (st.promotions, st.hit_tokens_by_tier) == (51, {"redis": len(SEQ)})
    # promoted blocks carry their sessions, and are known to be in Redis: no rewrite
    assert all(blk.sessions == ("chat",) for blk in b.pool.blocks())
    writes = tb.stats()["writes"]
    b.evict()
    tb.flush()
    assert tb.stats()["writes"] == writes
    b.check()


def test_ram_then_ssd_then_redis(make_tier: Make, redis_url: str, tmp_path: Path) -> None:
    ta = make_tier(redis_url)
    a = cache_on(ta)
    a.store(NS, SEQ, len(SEQ), payload_for)
    ta.flush()
    ssd = SSDTier(SSDConfig(path=tmp_path / "ssd", fsync=False))
    tb = make_tier(redis_url)
    b = cache_on(ssd, tb)
    try:
        b.store(NS, SEQ, 40, payload_for)  # 10 blocks: in RAM and (write-through) on SSD
        ssd.flush()
        b.evict(5)  # the 5 LRU of them leave RAM (they stay on SSD)
        m = b.lookup(SEQ + [0], NS)
        assert m.num_tokens == len(SEQ)
        assert m.tokens_by_tier == {"ram": 20, "ssd": 20, "redis": len(SEQ) - 40}
        hit = b.acquire(SEQ + [0], NS)
        assert hit.tokens_by_tier == {"ram": 20, "ssd": 20, "redis": len(SEQ) - 40}
        b.release(hit)
    finally:
        b.close(persist=False)


def test_no_room_in_ram_cuts_the_hit_before_reading(make_tier: Make, redis_url: str) -> None:
    ta = make_tier(redis_url)
    cache_on(ta).store(NS, SEQ, len(SEQ), payload_for)
    ta.flush()
    tb = make_tier(redis_url)
    b = cache_on(tb, budget=10 * BLOCK_BYTES)
    hit = b.acquire(SEQ + [0], NS)
    assert hit.num_tokens == 40 and hit.miss is not None and hit.miss.cause == "promotion_failed"
    st = b.stats()
    assert (st.promotions, st.ram_bytes, st.ram_budget_bytes) == (10, 10 * BLOCK_BYTES,
                                                                  10 * BLOCK_BYTES)
    assert tb.stats()["bytes_read"] == sum(  # only what fitted was read
        len(tb.get(bm.block_hash, ns=NS) or b"") for bm, _ in hit.blocks)
    b.release(hit)
    b.check()


def test_corrupt_value_is_a_counted_miss_and_deleted(make_tier: Make, redis_url: str,
                                                     redis_server: RedisServer) -> None:
    ta = make_tier(redis_url)
    cache_on(ta).store(NS, SEQ[:20], 20, payload_for)
    ta.flush()
    client = redis_server.client()
    key = next(k for k in client.scan_iter(match="*:b:*")
               if client.hget(k, "m") and b'"s":8,' in client.hget(k, "m"))
    client.hset(key, "p", b"garbage")
    tb = make_tier(redis_url)
    b = cache_on(tb)
    hit = b.acquire(SEQ[:20] + [0], NS)
    assert hit.num_tokens == 8  # blocks 0 and 1; block 2 was damaged
    assert tb.stats()["corrupt"] == 1 and client.exists(key) == 0
    assert b.stats().promotion_failures == 1
    b.release(hit)


def test_redis_down_is_a_counted_miss(make_tier: Make, tmp_path: Path) -> None:
    srv = RedisServer(tmp_path / "r").start()
    try:
        tier = make_tier(srv.url, start_prober=False)
        cache = cache_on(tier, budget=8 * BLOCK_BYTES)
        cache.store(NS, SEQ[:16], 16, payload_for)
        tier.flush()
        cache.evict()
        srv.kill()
        for _ in range(5):
            hit = cache.acquire(SEQ[:16] + [0], NS)
            assert hit.num_tokens == 0
            cache.release(hit)
        assert cache.stats().tier_errors == 3  # then the circuit is open: skipped at once
        assert tier.stats()["skipped_ops"] >= 2
        assert cache.store(NS, SEQ, 20, payload_for) == 5  # stores go on in RAM
    finally:
        srv.stop()


def test_session_and_tenant_deletion_reach_redis(make_tier: Make, redis_url: str,
                                                 redis_server: RedisServer) -> None:
    ta = make_tier(redis_url)
    a = cache_on(ta)
    other = NS.with_tenant("other")
    a.store(NS, SEQ[:12], 12, payload_for, session_id="s1")
    a.store(other, SEQ[:12], 12, payload_for, session_id="s1")
    ta.flush()
    tb = make_tier(redis_url)
    b = cache_on(tb)
    # tenant isolation: identical tokens in another tenant hit nothing of the first
    assert b.lookup(SEQ[:12], NS.with_tenant("third")).num_tokens == 0
    assert b.delete_session("s1") == 3 + 3  # both tenants (no tenant given)
    assert list(redis_server.client().scan_iter(match="promptcache:*:b:*")) == []
    a = cache_on(ta)  # (server A's RAM still holds its copies: a deletion reaches the
    a.store(NS, SEQ[:12], 12, payload_for)  # RAM of the server that receives it only)
    a.store(other, SEQ[:12], 12, payload_for)
    ta.flush()
    assert b.delete(tenant="other") == 3
    assert list(redis_server.client().scan_iter(match="promptcache:*:other:*")) == []
    assert b.lookup(SEQ[:12] + [0], NS).num_tokens == 12


def test_session_deletion_within_one_tenant_reaches_redis(make_tier: Make, redis_url: str,
                                                         redis_server: RedisServer) -> None:
    """Two tenants use the same session id: deleting it for one leaves the other's
    blocks, in RAM and in Redis."""
    ta = make_tier(redis_url)
    a = cache_on(ta)
    other = NS.with_tenant("other")
    a.store(NS, SEQ[:12], 12, payload_for, session_id="s1")
    a.store(other, SEQ[:12], 12, payload_for, session_id="s1")
    ta.flush()
    b = cache_on(make_tier(redis_url))
    assert b.delete_session("s1", tenant="other") == 3
    assert list(redis_server.client().scan_iter(match="promptcache:*:other:*:b:*")) == []
    assert len(list(redis_server.client().scan_iter(match="promptcache:*:default:*:b:*"))) == 3
    assert b.lookup(SEQ[:12] + [0], NS).num_tokens == 12
    assert b.lookup(SEQ[:12] + [0], other).num_tokens == 0
    assert a.delete_session("s1", tenant="other") == 3  # a's RAM copies of "other" only
    assert a.lookup(SEQ[:12] + [0], NS).num_tokens == 12


def test_write_through_burst_waits_for_a_full_redis_queue(make_tier: Make, redis_url: str
                                                          ) -> None:
    """Redis write-through (the only write-through tier) through a queue of 2 while its
    writer is held: the blocks that find the queue full wait in RAM and reach Redis
    once it drains, in order, none dropped."""
    tier = make_tier(redis_url, queue_size=2)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20), lower=[tier],
                        write_through=False)
    try:
        with tier._write_lock:  # the writer blocks on its first batch
            cache.store(NS.with_tenant("first"), SEQ[:4], 4, payload_for)
            wait_until(lambda: tier._queue.qsize() == 0, timeout=30,
                       what="the writer took the first block")
            assert cache.store(NS, SEQ[:200], 200, payload_for) == 50
            s = cache.stats()
            assert (s.write_through, s.write_through_deferred, s.unwritten_blocks) == (3, 48, 48)
            assert tier.stats()["dropped_writes_total"] == 0
        assert cache.flush(timeout=60)
        s = cache.stats()
        assert (s.write_through, s.unwritten_blocks, s.demotion_failures) == (51, 0, 0)
        st = tier.stats()
        assert (st["writes"], st["dropped_writes_total"]) == (51, 0)
        assert cache_on(make_tier(redis_url)).lookup(SEQ[:200], NS).num_tokens == 199
    finally:
        cache.close(persist=False)


def test_persist_writes_every_tier_that_lacks_a_block(make_tier: Make, redis_url: str,
                                                      tmp_path: Path) -> None:
    """SSD write-back + Redis write-through: at a clean shutdown the SSD gets every RAM
    block (Redis holds them already and is not written again); both are verified."""
    ssd = SSDTier(SSDConfig(path=tmp_path / "ssd", fsync=False, policy="write_back"))
    redis_tier = make_tier(redis_url)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20),
                        lower=[ssd, redis_tier], write_through=False)
    try:
        cache.store(NS, SEQ[:16], 16, payload_for, session_id="s1")
        assert cache.flush(timeout=60)
        hs = [blk.block_hash for blk in cache.pool.blocks()]
        assert ssd.get_metas(hs) == [None] * 4 and redis_tier.stats()["writes"] == 4
        assert cache.persist(timeout=60) == 4
        report = cache.last_persist
        assert report is not None and (report.blocks, report.written, report.failed) == (4, 4, 0)
        assert all(m is not None for m in ssd.get_metas(hs))
        assert redis_tier.stats()["writes"] == 4  # not written twice
        assert all(blk.persisted for blk in cache.pool.blocks())
        assert cache.persist(timeout=60) == 0  # nothing left to write
    finally:
        cache.close(persist=False)


def test_per_tier_write_policy(make_tier: Make, redis_url: str, tmp_path: Path) -> None:
    """SSD write-back + Redis write-through: a stored block goes to Redis at once and to
    the SSD only when it leaves RAM; nothing is written twice."""
    ssd = SSDTier(SSDConfig(path=tmp_path / "ssd", fsync=False, policy="write_back"))
    redis_tier = make_tier(redis_url)  # policy write_through (the default)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20),
                        lower=[ssd, redis_tier], write_through=False)
    try:
        cache.store(NS, SEQ[:16], 16, payload_for, session_id="s1")
        redis_tier.flush()
        ssd.flush()
        hs = [blk.block_hash for blk in cache.pool.blocks()]
        assert len(hs) == 4
        assert all(m is not None for m in redis_tier.get_metas(hs, ns=NS))
        assert ssd.get_metas(hs) == [None] * 4
        # a session added to a block that only Redis holds reaches Redis
        cache.store(NS, SEQ[:16], 16, payload_for, session_id="s2")
        redis_tier.flush()
        assert redis_tier.sessions_of(hs[0], ns=NS) == ["s1", "s2"]
        assert cache.evict() == 4
        ssd.flush()
        redis_tier.flush()
        assert all(m is not None for m in ssd.get_metas(hs))
        assert redis_tier.stats()["writes"] == 4  # not written again on eviction
        assert cache.stats().demotions == 4
    finally:
        cache.close(persist=False)


def test_lookup_asks_a_window_then_the_rest(make_tier: Make, redis_url: str,
                                            monkeypatch: object) -> None:
    from promptcache.cache import matcher

    monkeypatch.setattr(matcher, "LOWER_WINDOW", 8)  # type: ignore[attr-defined]
    ta = make_tier(redis_url)
    cache_on(ta).store(NS, SEQ[:80], 80, payload_for)  # 20 blocks
    ta.flush()
    tb = make_tier(redis_url)
    b = cache_on(tb)
    before = tb.stats()
    assert b.lookup(SEQ[:80] + [0], NS).num_tokens == 80
    after = tb.stats()
    assert after["meta_lookups"] - before["meta_lookups"] == 20  # 8, then the other 12
    assert after["round_trips"] - before["round_trips"] == 2 + 1  # + the children index
    # a cold prompt costs one window of hashes and one round trip, not its whole length
    cold = list(range(10_000, 10_000 + 4 * 50))
    before = tb.stats()
    assert b.lookup(cold, NS).num_tokens == 0
    after = tb.stats()
    assert after["meta_lookups"] - before["meta_lookups"] == 8
    # the window, then the root's children (SEQ's first block) and their liveness
    assert after["round_trips"] - before["round_trips"] == 3
