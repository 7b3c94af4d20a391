"""PromptCache policy: dedup, budget, refs, TTL, sessions, tenants, stats, bad input."""

import numpy as np
import pytest
from core_helpers import BYTES_PER_TOKEN, PayloadRecorder, make_cache, ns_of, payload_for

from promptcache.cache import Hit

NS = ns_of(4)
SEQ = list(range(1, 13))
BLOCK_BYTES = 4 * BYTES_PER_TOKEN


def test_dedup_100_sequences_sharing_a_1000_token_prefix():
    ns = ns_of(64)
    cache = make_cache(block_size=64, budget=10**8)
    prefix = list(range(1000, 2000))  # 1,000 tokens: 15 full blocks + 40 tokens of block 16
    created = []
    for i in range(100):
        seq = prefix + [5000 + i * 24 + j for j in range(24)]  # 1,024 tokens = 16 blocks
        created.append(cache.store(ns, seq, len(seq), payload_for, save_point="end_prefill"))
    assert created == [16] + [1] * 99
    s = cache.stats()
    assert s.ram_blocks == 15 + 100
    # each sequence's last block also holds its end snapshot (one float32)
    assert s.ram_bytes == (15 + 100) * 64 * BYTES_PER_TOKEN + 100 * 4 == 59_280
    assert s.dedup_blocks == 99 * 15
    assert s.saves["end_prefill"] == 100 and s.blocks_saved["end_prefill"] == 115
    m = cache.lookup(prefix + [5000 + 7 * 24 + j for j in range(24)] + [1], ns)
    assert m.num_tokens == 1024
    cache.check()


def test_store_creates_only_missing_blocks_and_returns_the_count():
    cache = make_cache()
    rec = PayloadRecorder()
    assert cache.store(NS, SEQ, 8, rec) == 2
    assert cache.store(NS, SEQ, 12, rec) == 1
    assert rec.calls == [(0, 4, False), (4, 8, True), (8, 12, True)]
    assert cache.store(NS, SEQ, 12, rec) == 0 and len(rec.calls) == 3
    assert cache.store(NS, SEQ, 0, rec) == 0
    assert cache.stats().ram_bytes == 3 * BLOCK_BYTES + 2 * 4  # two snapshot arrays of 4 bytes
    cache.check()


def test_block_larger_than_the_budget_is_dropped():
    cache = make_cache(budget=100)

    def big_second(start, end, snap):
        if start == 4:
            return {"x": np.zeros(200, dtype=np.uint8)}
        return payload_for(start, end, False)

    assert cache.store(NS, SEQ, 12, big_second) == 1
    s = cache.stats()
    assert (s.drops, s.ram_blocks, s.ram_bytes) == (1, 1, BLOCK_BYTES)
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 4
    # the miss says why the chain stops there: the block did not fit the RAM budget
    assert (m.miss.cause, m.miss.position) == ("not_stored: budget", 4)


def test_blocks_of_a_live_hit_are_never_evicted():
    cache = make_cache(budget=3 * BLOCK_BYTES)
    cache.store(NS, SEQ, 12, payload_for, snapshot_at_end=False)
    hit = cache.acquire(SEQ, NS)
    assert hit.num_tokens == 11 and [b.ref_cnt for b in hit._held] == [1, 1, 1]
    other = [100 + i for i in range(12)]
    assert cache.store(NS, other, 12, payload_for, snapshot_at_end=False) == 0
    s = cache.stats()
    assert (s.drops, s.evictions, s.ram_blocks, s.ram_used_blocks) == (1, 0, 3, 3)
    cache.release(hit)
    cache.release(hit)  # idempotent
    assert cache.stats().ram_free_blocks == 3
    assert cache.store(NS, other, 12, payload_for, snapshot_at_end=False) == 3
    s = cache.stats()
    assert (s.evictions, s.evicted_dropped, s.ram_blocks, s.ram_bytes) == (3, 3, 3, 3 * BLOCK_BYTES)
    assert cache.lookup(SEQ, NS).miss.cause == "evicted"
    cache.check()


def test_eviction_order_is_lru_and_tail_first_through_the_cache():
    evicted = []
    cache = make_cache(budget=6 * BLOCK_BYTES, on_evict=lambda meta, payload: evicted.append(meta.token_ids[0]))
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    b = [51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62]
    cache.store(NS, a, 12, payload_for, snapshot_at_end=False)
    cache.store(NS, b, 12, payload_for, snapshot_at_end=False)
    hit = cache.acquire(a[:6], NS)  # touches a's first two blocks (5 tokens restored)
    assert hit.num_tokens == 5 and len(hit.blocks) == 2
    cache.release(hit)
    assert cache.evict(4) == 4
    # a's tail (never touched) first, then b tail-first, then a's touched chain tail-first
    assert evicted == [9, 59, 55, 51]
    assert cache.evict() == 2 and evicted[4:] == [5, 1]


def test_acquire_records_stats():
    cache = make_cache()
    cache.store(NS, SEQ, 12, payload_for)
    cache.release(cache.acquire(SEQ, NS))
    cache.release(cache.acquire(SEQ[:6] + [99, 98], NS))
    cache.release(cache.acquire([77, 78], NS))
    s = cache.stats()
    assert (s.lookups, s.hit_tokens, s.miss_tokens) == (3, 11 + 6, 1 + 2 + 2)
    assert s.hit_tokens_by_tier == {"ram": 17}
    assert s.token_hit_rate == pytest.approx(17 / 22)
    assert s.misses_by_cause == {"diverged": 2}
    d = s.to_dict()
    assert d["token_hit_rate"] == pytest.approx(17 / 22) and d["ram_blocks"] == 3


def test_hit_blocks_carry_payloads():
    cache = make_cache()
    cache.store(NS, SEQ, 12, payload_for)
    hit = cache.acquire(SEQ[:7], NS)
    assert hit.num_tokens == 6 and hit.tokens_by_tier == {"ram": 6} and hit.tiers == ["ram", "ram"]
    (m0, p0), (m1, p1) = hit.blocks
    assert m0.token_ids == (1, 2, 3, 4) and p0["0.k"][:, 0].tolist() == [0, 1, 2, 3]
    assert m1.start == 4 and p1["0.k"][:, 0].tolist() == [4, 5, 6, 7]
    cache.release(hit)


def test_ttl_expires_ram_blocks():
    now = [0.0]
    cache = make_cache(ttl_seconds=10, clock=lambda: now[0])
    cache.store(NS, SEQ, 12, payload_for)
    now[0] = 5.0
    cache.release(cache.acquire(SEQ[:6], NS))  # touches the first two blocks at t=5
    now[0] = 12.0
    m = cache.lookup(SEQ, NS)
    assert m.num_tokens == 8 and m.miss.cause == "expired"
    hit = cache.acquire(SEQ, NS)
    assert hit.num_tokens == 8
    cache.release(hit)
    s = cache.stats()
    assert (s.expired, s.ram_blocks) == (1, 2)
    now[0] = 30.0
    assert cache.acquire(SEQ, NS).num_tokens == 0
    assert cache.stats().expired == 3 and cache.stats().ram_blocks == 0
    assert cache.lookup(SEQ, NS).miss.cause == "expired"
    # an expired block is replaced on store
    assert cache.store(NS, SEQ, 12, payload_for) == 3
    cache.check()


def test_delete_session():
    cache = make_cache()
    a = SEQ[:8]
    b = SEQ[:4] + [20, 21, 22, 23]
    cache.store(NS, a, 8, payload_for, session_id="s1")
    cache.store(NS, b, 8, payload_for, session_id="s2")
    cache.store(NS, [90, 91, 92, 93], 4, payload_for)  # no session: never deleted by session
    assert cache.delete_session("s1") == 1
    assert cache.lookup(a + [1], NS).num_tokens == 4
    assert cache.lookup(b + [1], NS).num_tokens == 8
    hit = cache.acquire(b + [1], NS)
    assert cache.delete_session("s2") == 2
    assert cache.lookup(b + [1], NS).num_tokens == 0
    assert cache.stats().ram_blocks == 3  # two referenced blocks linger until release
    cache.release(hit)
    s = cache.stats()
    assert (s.ram_blocks, s.ram_bytes) == (1, BLOCK_BYTES + 4)
    assert cache.delete_session("nobody") == 0
    cache.check()


def test_delete_by_tenant_and_all():
    cache = make_cache()
    na, nb = ns_of(4, "a"), ns_of(4, "b")
    cache.store(na, SEQ, 12, payload_for)
    cache.store(nb, SEQ, 8, payload_for)
    assert cache.delete("a") == 3
    assert cache.lookup(SEQ, na).num_tokens == 0 and cache.lookup(SEQ, nb).num_tokens == 8
    assert cache.delete() == 2 and cache.stats().ram_blocks == 0
    cache.check()


@pytest.mark.parametrize(
    "tokens, msg",
    [
        ([], "empty"),
        ([1, -2, 3], "out of range"),
        ([1, 2**32], "out of range"),
        ([1, 2.5], "not an integer"),
        ([1, True], "not an integer"),
        (["a", "b"], "not an integer"),
        ("abc", "string"),
        (np.array([1.0, 2.0]), "integer dtype"),
        (np.array([[1, 2]]), "1-D"),
        (np.array([1, -1]), "out of range"),
        (None, "sequence of integers"),
    ],
)
def test_bad_tokens_raise_value_error(tokens, msg):
    cache = make_cache()
    with pytest.raises(ValueError, match=msg):
        cache.lookup(tokens, NS)
    with pytest.raises(ValueError, match=msg):
        cache.acquire(tokens, NS)
    with pytest.raises(ValueError, match=msg):
        cache.store(NS, tokens, 1, payload_for)


def test_token_inputs_of_every_kind_agree():
    cache = make_cache()
    cache.store(NS, SEQ, 12, payload_for)
    from array import array

    for toks in (SEQ, tuple(SEQ), np.array(SEQ, dtype=np.int64), np.array(SEQ, dtype=np.uint16),
                 array("I", SEQ), [np.int32(t) for t in SEQ]):
        assert cache.lookup(toks, NS).num_tokens == 11


@pytest.mark.parametrize(
    "payload, msg",
    [
        ({"x": np.array(["a", "b"])}, "unsupported dtype"),
        ({"x": np.array([object()], dtype=object)}, "unsupported dtype"),
        ({"x": [1, 2]}, "numpy array"),
        ([np.zeros(2)], "mapping"),
        ({1: np.zeros(2)}, "names"),
    ],
)
def test_bad_payload_raises_value_error_and_leaves_no_trace(payload, msg):
    cache = make_cache()
    with pytest.raises(ValueError, match=msg):
        cache.store(NS, SEQ, 12, lambda s, e, snap: payload_for(s, e, snap) if s == 0 else payload)
    s = cache.stats()
    assert (s.ram_blocks, s.ram_used_blocks, s.ram_free_blocks) == (1, 0, 1)
    cache.check()


def test_bad_arguments_raise_value_error():
    cache = make_cache()
    for kw in ({"save_point": "later"}, {"session_id": ""}, {"extra_keys": [b"x"]}):
        with pytest.raises(ValueError):
            cache.store(NS, SEQ, 12, payload_for, **kw)
    for n in (-1, 13, 1.0, True):
        with pytest.raises(ValueError, match="num_tokens"):
            cache.store(NS, SEQ, n, payload_for)
    with pytest.raises(ValueError, match="block_size"):
        cache.lookup(SEQ, ns_of(8))
    with pytest.raises(ValueError, match="Hit"):
        cache.release("hit")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cache.delete_session("")
    with pytest.raises(ValueError):
        cache.evict(-1)
    assert isinstance(cache.acquire(SEQ, NS), Hit)


def test_token_history_walks_the_stored_chains_of_one_namespace():
    """Sequences root to leaf, depth first by block hash; a branch starts a new sequence
    with the last ``overlap`` tokens before it; each block once; another tenant's
    blocks never; the walk stops past ``max_tokens``."""
    cache = make_cache()
    a = list(range(1, 11))  # blocks [1..4] [5..8] + partial [9, 10]
    b = list(range(1, 9)) + [50, 51, 52, 53, 54]  # shares two blocks, then its own
    cache.store(NS, a, len(a), payload_for)
    cache.store(NS, b, len(b), payload_for)
    other = ns_of(4, tenant="other")
    cache.store(other, [7, 7, 7, 7], 4, payload_for)
    # the branch after [5..8]: [9, 10] sorts first (hashes), [50..53] + [54] start anew
    assert cache.token_history(NS, 1000, overlap=3) == [
        (1, 2, 3, 4, 5, 6, 7, 8, 9, 10), (6, 7, 8, 50, 51, 52, 53, 54)]
    assert cache.token_history(other, 1000) == [(7, 7, 7, 7)]
    assert cache.token_history(NS, 0) == []
    # the walk stops once max_tokens are collected (blocks of 4: it stops after 4)
    assert sum(len(s) for s in cache.token_history(NS, 4)) == 4


def test_max_arrays_caps_the_ram_blocks_whatever_their_bytes():
    cache = make_cache(budget=10**8, max_arrays=5)
    a = list(range(1, 13))  # 3 blocks
    b = list(range(100, 112))  # 3 more: the cap evicts a's LRU tail-first
    assert cache.store(NS, a, 12, payload_for) == 3
    assert cache.store(NS, b, 12, payload_for) == 3
    s = cache.stats()
    assert s.ram_blocks == 5 and s.evictions == 1
    assert cache.lookup(a + [0], NS).num_tokens == 8  # its last block went first
    assert cache.lookup(b + [0], NS).num_tokens == 12
    cache.check()
