"""Token-granular matching: the four strategies, partial tails, collisions, snapshots."""

import pytest
from core_helpers import PayloadRecorder, make_cache, ns_of, payload_for

from promptcache.cache import matcher
from promptcache.hashing import chain_hashes, hash_block
from promptcache.meta import ExtraKeySpan

NS = ns_of(4)
SEQ = list(range(1, 13))  # three full blocks of 4


def stored(tokens=SEQ, **kw):
    cache = make_cache()
    cache.store(NS, tokens, len(tokens), payload_for, **kw)
    return cache


def test_exact_match_leaves_the_last_token_to_recompute():
    cache = stored()
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 11 and m.matched_tokens == 12 and m.miss is None
    assert [b.token_ids for b in m.blocks] == [(1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12)]
    assert [b.block_hash for b in m.blocks] == chain_hashes(NS.root, SEQ, 4)
    assert [b.start for b in m.blocks] == [0, 4, 8]
    assert m.tiers == ["ram", "ram", "ram"] and m.tokens_by_tier == {"ram": 11}


def test_prefix_cached_is_shorter():
    cache = stored(SEQ[:8])
    m = cache.lookup(SEQ + [13, 14], NS)
    assert m.num_tokens == 8 and len(m.blocks) == 2
    assert m.miss is not None and (m.miss.position, m.miss.restorable, m.miss.cause) == (8, 8, "cold")


def test_supersequence_cached_is_longer_truncates():
    cache = stored()
    m = cache.lookup(SEQ[:6], NS)
    assert m.num_tokens == 5 and [b.start for b in m.blocks] == [0, 4]
    assert m.tokens_by_tier == {"ram": 5} and m.miss is None


def test_longest_common_prefix():
    cache = stored()
    req = SEQ[:6] + [99, 98, 97, 96]
    m = cache.lookup(req, NS)
    assert m.num_tokens == 6 and len(m.blocks) == 2 and m.blocks[1].token_ids == (5, 6, 7, 8)
    assert m.miss is not None and (m.miss.position, m.miss.cause) == (6, "diverged")


def test_divergence_inside_the_first_block_and_cold_start():
    cache = stored()
    m = cache.lookup([1, 2, 50, 60, 70], NS)
    assert m.num_tokens == 2 and m.blocks[0].token_ids == (1, 2, 3, 4)
    m = cache.lookup([50, 60, 70], NS)
    assert m.num_tokens == 0 and m.blocks == [] and m.miss is not None
    assert (m.miss.position, m.miss.cause) == (0, "diverged")
    empty = make_cache()
    m = empty.lookup(SEQ, NS)
    assert m.num_tokens == 0 and m.miss is not None and m.miss.cause == "cold"


def test_partial_tail_block_is_stored_and_matched():
    cache = make_cache()
    assert cache.store(NS, SEQ[:10], 10, payload_for) == 3
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 10 and [b.token_ids for b in m.blocks][-1] == (9, 10)
    assert m.miss is not None and m.miss.cause == "cold"
    # without the partial tail
    cache2 = make_cache()
    assert cache2.store(NS, SEQ[:10], 10, payload_for, include_partial=False) == 2
    assert cache2.lookup(SEQ, NS).num_tokens == 8


def test_longest_child_wins_among_partial_and_full_children():
    cache = make_cache()
    cache.store(NS, SEQ[:10], 10, payload_for)  # partial child (9, 10)
    cache.store(NS, SEQ[:8] + [9, 30, 31, 32], 12, payload_for)  # full child (9, 30, 31, 32)
    assert cache.lookup(SEQ[:8] + [9, 30, 31, 32, 33], NS).num_tokens == 12
    assert cache.lookup(SEQ[:8] + [9, 30, 77], NS).num_tokens == 10
    m = cache.lookup(SEQ[:10] + [5], NS)
    assert m.num_tokens == 10 and m.blocks[-1].token_ids == (9, 10)
    m = cache.lookup(SEQ[:8] + [9, 10, 11, 12, 13], NS)
    assert m.num_tokens == 10 and m.miss is not None and m.miss.cause == "cold"


def test_forced_hash_collision_is_harmless(monkeypatch):
    # every block with the same parent gets the same hash, whatever its tokens
    monkeypatch.setattr(matcher, "hash_block", lambda parent, toks, extra=(): hash_block(parent, [0], extra))
    cache = make_cache()
    rec = PayloadRecorder()
    assert cache.store(NS, SEQ[:8], 8, rec) == 2
    other = [7, 7, 7, 7, 8, 8, 8, 8, 9]
    # same hash chain as SEQ[:8], other tokens: never a hit, and storing it is refused
    m = cache.lookup(other, NS)
    assert m.num_tokens == 0 and m.matched_tokens == 0
    assert cache.store(NS, other, 9, rec) == 0
    assert cache.stats().collisions == 1
    h = cache.acquire(other, NS)
    assert h.num_tokens == 0 and h.blocks == []
    cache.release(h)
    m = cache.lookup(SEQ[:8] + [1], NS)
    assert m.num_tokens == 8 and [b.token_ids for b in m.blocks] == [(1, 2, 3, 4), (5, 6, 7, 8)]
    cache.check()


def test_non_truncatable_state_restores_only_at_snapshots():
    cache = make_cache()
    rec = PayloadRecorder()
    assert cache.store(NS, SEQ, 12, rec, truncatable=False) == 3
    assert rec.calls == [(0, 4, False), (4, 8, False), (8, 12, True)]
    m = cache.lookup(SEQ + [13], NS)
    assert m.num_tokens == 12 and len(m.blocks) == 3 and m.blocks[2].snapshot
    assert not m.blocks[0].truncatable and not m.blocks[0].snapshot
    # exact match: position 11 is inside a non-truncatable block -> no usable snapshot
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 0 and m.blocks == []
    assert m.miss is not None and (m.miss.position, m.miss.restorable, m.miss.cause) == (12, 0, "not_restorable")
    # a mid-prefill snapshot at 8 upgrades the existing block (no new block)
    rec.calls.clear()
    assert cache.store(NS, SEQ, 8, rec, truncatable=False) == 0
    assert rec.calls == [(4, 8, True)] and cache.stats().upgrades == 1
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 8 and len(m.blocks) == 2 and m.blocks[1].snapshot
    assert cache.lookup(SEQ[:10] + [50, 51], NS).num_tokens == 8
    cache.check()


def test_extra_keys_must_agree():
    img_a = (ExtraKeySpan(5, 7, b"image-a"),)
    img_b = (ExtraKeySpan(5, 7, b"image-b"),)
    cache = make_cache()
    cache.store(NS, SEQ[:10], 10, payload_for, extra_keys=img_a)
    assert cache.lookup(SEQ, NS, img_a).num_tokens == 10
    # another image: reuse stops at its first token (5), inside the block 4..8
    assert cache.lookup(SEQ, NS, img_b).num_tokens == 5
    assert cache.lookup(SEQ, NS).num_tokens == 4  # the stored image's place is unknown
    # both images stored: each request finds its own blocks
    cache.store(NS, SEQ[:10], 10, payload_for, extra_keys=img_b)
    assert cache.lookup(SEQ, NS, img_b).num_tokens == 10
    assert cache.lookup(SEQ, NS, img_a).num_tokens == 10
    assert cache.acquire(SEQ, NS, img_b).tiers == ["ram", "ram", "ram"]
    # the partial tail (8..10) was stored without an image: usable up to the image (9)
    img_c = (ExtraKeySpan(9, 10, b"image-c"),)
    cache2 = make_cache()
    cache2.store(NS, SEQ[:10], 10, payload_for)
    assert cache2.lookup(SEQ[:10] + [1], NS, img_c).num_tokens == 9


def test_extra_keys_in_order_reuse_stops_at_the_first_differing_span():
    """Two images in one block: swapped -> stop at the first; the second differs ->
    stop at the second; the stored block has a third image the request lacks ->
    only up to the end of the last shared one."""
    a, b, c = b"img-a", b"img-b", b"img-c"
    seq = list(range(1, 17))
    cache = make_cache(block_size=8)
    ns8 = ns_of(8)
    two = (ExtraKeySpan(9, 11, a), ExtraKeySpan(12, 14, b))
    cache.store(ns8, seq, 16, payload_for, extra_keys=two)
    assert cache.lookup(seq, ns8, two).num_tokens == 15
    swapped = (ExtraKeySpan(9, 11, b), ExtraKeySpan(12, 14, a))
    assert cache.lookup(seq, ns8, swapped).num_tokens == 9
    other = (ExtraKeySpan(9, 11, a), ExtraKeySpan(12, 14, c))
    assert cache.lookup(seq, ns8, other).num_tokens == 12
    fewer = (ExtraKeySpan(9, 11, a),)
    assert cache.lookup(seq, ns8, fewer).num_tokens == 11
    assert cache.lookup(seq, ns8).num_tokens == 8


def test_tenant_isolation():
    cache = stored()
    other = ns_of(4, tenant="other")
    m = cache.lookup(SEQ, other)
    assert m.num_tokens == 0 and m.miss is not None and m.miss.cause == "cold"
    assert cache.lookup(SEQ, NS).num_tokens == 11


def test_lookup_is_a_pure_query():
    cache = stored()
    lru_before = [b.block_hash for b in cache.pool.lru_order()]
    assert len(lru_before) == 3
    cache.lookup(SEQ, NS)
    assert [b.block_hash for b in cache.pool.lru_order()] == lru_before
    assert cache.stats().lookups == 0


def test_miss_cause_evicted():
    cache = make_cache(budget=1000)
    cache.store(NS, SEQ, 12, payload_for)
    assert cache.evict() == 3
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 0 and m.miss is not None and m.miss.cause == "evicted"
    # a partial-tail request below an evicted parent also says evicted
    cache.store(NS, SEQ[:4], 4, payload_for)
    m = cache.lookup(SEQ[:6], NS)
    assert m.num_tokens == 4 and m.miss is not None and m.miss.cause == "evicted"


@pytest.mark.parametrize("bs", [1, 3, 64])
def test_other_block_sizes(bs):
    ns = ns_of(bs)
    cache = make_cache(block_size=bs)
    toks = list(range(100, 300))
    cache.store(ns, toks, 150, payload_for)
    m = cache.lookup(toks, ns)
    assert m.num_tokens == 150
    assert sum(b.num_tokens for b in m.blocks) == 150
    assert cache.lookup(toks[:150], ns).num_tokens == 149
