"""Random store / lookup / acquire / release / evict / delete sequences, with the
pool's invariants and the matching contract checked after every step."""

from collections import Counter

import hypothesis.strategies as st
import numpy as np
from core_helpers import BYTES_PER_TOKEN, FakeTier, make_cache, ns_of, payload_for
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

BS = 3
NS = ns_of(BS)
tokens_st = st.lists(st.integers(1, 3), min_size=1, max_size=14)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tier = FakeTier()
        # room for 8 full blocks; snapshots add 4 bytes each
        self.cache = make_cache(block_size=BS, budget=8 * BS * BYTES_PER_TOKEN + 8, lower=[self.tier])
        self.hits: list = []

    def check_match(self, tokens, num_tokens, metas) -> None:
        assert 0 <= num_tokens <= len(tokens) - 1
        covered = []
        pos = 0
        for meta in metas:
            assert meta.start == pos
            covered.extend(meta.token_ids)
            pos = meta.end
        assert len(covered) >= num_tokens
        if metas:
            assert metas[-1].start < num_tokens
        assert covered[:num_tokens] == tokens[:num_tokens]

    @rule(tokens=tokens_st, cut=st.integers(0, 14), truncatable=st.booleans(),
          session=st.sampled_from([None, "a", "b"]))
    def store(self, tokens, cut, truncatable, session):
        n = min(cut, len(tokens))
        created = self.cache.store(NS, tokens, n, payload_for, truncatable=truncatable,
                                   session_id=session)
        assert 0 <= created <= -(-n // BS)

    @rule(tokens=tokens_st)
    def lookup(self, tokens):
        m = self.cache.lookup(tokens, NS)
        self.check_match(tokens, m.num_tokens, m.blocks)
        assert sum(m.tokens_by_tier.values()) == m.num_tokens

    @rule(tokens=tokens_st)
    def acquire(self, tokens):
        hit = self.cache.acquire(tokens, NS)
        self.check_match(tokens, hit.num_tokens, [m for m, _ in hit.blocks])
        for meta, payload in hit.blocks:
            np.testing.assert_array_equal(payload["0.k"][:, 0], np.arange(meta.start, meta.end))
        assert sum(hit.tokens_by_tier.values()) == hit.num_tokens
        self.hits.append(hit)

    @precondition(lambda self: self.hits)
    @rule(i=st.integers(0, 100))
    def release(self, i):
        self.cache.release(self.hits.pop(i % len(self.hits)))

    @rule(k=st.integers(0, 3))
    def evict(self, k):
        # exactly the k least recently used unreferenced blocks go (all if fewer)
        lru = [b.block_hash for b in self.cache.pool.lru_order()]
        assert self.cache.evict(k) == min(k, len(lru))
        left = {b.block_hash for b in self.cache.pool.blocks()}
        assert not left & set(lru[:k]) and set(lru[k:]) <= left

    @rule(session=st.sampled_from(["a", "b"]))
    def delete_session(self, session):
        # exactly the blocks of that session alone go, in RAM and in the lower tier, each
        # counted once (a block held by both is one block)
        ram = {b.block_hash for b in self.cache.pool.blocks() if b.sessions == (session,)}
        lower = {h for h, (_, _, s) in self.tier.blocks.items() if s == {session}}
        assert self.cache.delete_session(session) == len(ram | lower)
        assert all(session not in b.sessions for b in self.cache.pool.blocks())
        assert all(session not in s for _, _, s in self.tier.blocks.values())

    @invariant()
    def pool_invariants(self):
        self.cache.check()  # free + used == total, map <-> blocks, bytes <= budget
        pool = self.cache.pool
        assert pool.used_bytes <= pool.budget_bytes
        expected = Counter(id(b) for h in self.hits for b in h._held)
        for block in pool.blocks():
            assert block.ref_cnt == expected.get(id(block), 0) >= 0

    def teardown(self):
        for hit in self.hits:
            self.cache.release(hit)
        self.cache.check()
        assert self.cache.pool.num_used_blocks == 0


CacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestCacheMachine = CacheMachine.TestCase
