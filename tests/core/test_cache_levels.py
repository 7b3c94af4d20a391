"""Cache breakpoints and active sessions (cache/levels.py through PromptCache): exact
blocks kept and evicted, on a controllable clock."""

from __future__ import annotations

from typing import Any

import pytest
from core_helpers import FakeTier, make_cache, ns_of, payload_for
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from promptcache.blocks.pool import ACTIVE, IDLE, PROTECTED
from promptcache.cache import PromptCache, matcher
from promptcache.hashing import BlockHash

BS = 4
BLOCK = BS * 8  # bytes of a full block (8 bytes per token)
NS = ns_of(BS)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def chain(tokens: list[int]) -> list[BlockHash]:
    """The hashes of the full blocks of ``tokens``, computed independently of the cache."""
    out, parent = [], NS.root
    for s in range(0, len(tokens) - len(tokens) % BS, BS):
        import numpy as np

        parent = matcher.block_hash(parent, np.asarray(tokens[s:s + BS], dtype="<u4"), ())
        out.append(parent)
    return out


def seq(i: int, n: int = 8) -> list[int]:
    return [i * 1000 + j for j in range(n)]


def store(cache: PromptCache, tokens: list[int]) -> None:
    cache.store(NS, tokens, len(tokens), payload_for, snapshot_at_end=False)


def held(cache: PromptCache) -> set[BlockHash]:
    return {b.block_hash for b in cache.pool.blocks() if b.block_hash is not None}


def storm(cache: PromptCache, first: int, count: int) -> list[list[BlockHash]]:
    out = []
    for i in range(first, first + count):
        store(cache, seq(i))
        out.append(chain(seq(i)))
    return out


def make(clock: Clock, blocks: int = 20, **kw: Any) -> PromptCache:
    return make_cache(BS, blocks * BLOCK, clock=clock, **kw)


def test_breakpoint_blocks_survive_an_eviction_storm_then_expire_after_their_ttl() -> None:
    clock = Clock()
    cache = make(clock, protect_share=0.5)
    prompt = seq(1, 12)
    store(cache, prompt)
    bp = chain(prompt)
    assert cache.protect(prompt, NS, 8, 300.0) == 2  # the breakpoint after token 8
    assert [cache.pool.get(h).level for h in bp] == [PROTECTED, PROTECTED, IDLE]  # type: ignore[union-attr]
    assert cache.pool.protected_bytes == 2 * BLOCK
    clock.t += 299.0
    stormed = storm(cache, 100, 40)  # 80 blocks through a 20-block pool
    # the two breakpoint blocks and the 18 most recent storm blocks; the third block of
    # the prompt (after the breakpoint) went with the storm
    assert held(cache) == {bp[0], bp[1], *[h for c in stormed[-9:] for h in c]}
    assert cache.lookup(prompt, NS).num_tokens == 8
    clock.t += 1.0  # the ttl is over
    assert cache.levels_snapshot()["protections_expired"] == 1
    assert [cache.pool.get(h).level for h in bp[:2]] == [IDLE, IDLE]  # type: ignore[union-attr]
    evicted = cache.stats().evictions
    new = storm(cache, 200, 1)
    # expired breakpoint blocks are the first to go, the tail first
    assert cache.stats().evictions == evicted + 2
    assert held(cache) == {*new[0], *[h for c in stormed[-9:] for h in c]}
    cache.check()


def storm_chains(first: int, count: int) -> list[list[BlockHash]]:
    return [chain(seq(i)) for i in range(first, first + count)]


def test_renewed_breakpoint_lasts_ttl_from_its_last_use() -> None:
    clock = Clock()
    cache = make(clock, protect_share=0.5)
    prompt = seq(1, 8)
    store(cache, prompt)
    bp = chain(prompt)
    cache.protect(prompt, NS, 8, 300.0)
    clock.t += 200.0
    cache.protect(prompt, NS, 8, 300.0)  # the client used it again: same key, renewed
    assert list(cache.levels.protections().values()) == [(tuple(bp), 1500.0)]
    clock.t += 299.0
    storm(cache, 100, 40)
    assert cache.pool.get(bp[0]) is not None and cache.pool.get(bp[1]) is not None
    clock.t += 1.0
    storm(cache, 200, 10)
    assert cache.pool.get(bp[0]) is None and cache.pool.get(bp[1]) is None


def test_a_breakpoint_inside_a_block_is_renewed_by_another_continuation() -> None:
    clock = Clock()
    cache = make(clock, protect_share=0.5)
    one, two = seq(1, 6) + [7, 7], seq(1, 6) + [8, 8]  # the breakpoint after token 6
    store(cache, one)
    assert cache.protect(one, NS, 6, 300.0) == 2  # the block holding it is kept too
    clock.t += 10.0
    store(cache, two)
    assert cache.protect(two, NS, 6, 300.0) == 2
    [(hashes, until)] = cache.levels.protections().values()  # the same breakpoint
    assert (hashes, until) == (tuple(chain(two)), 1310.0)
    assert [cache.pool.get(h).level for h in chain(one)] == [PROTECTED, IDLE]  # type: ignore[union-attr]
    assert cache.lookup(seq(1, 6) + [9, 9], NS).num_tokens == 6


def test_protected_share_is_bounded_and_the_oldest_give_way() -> None:
    clock = Clock()
    cache = make(clock, protect_share=0.2)  # 4 of 20 blocks
    a, b, c = seq(1), seq(2), seq(3)
    for s in (a, b, c):
        store(cache, s)
    assert cache.protect(a, NS, 8, 3600.0) == 2
    clock.t += 1
    assert cache.protect(b, NS, 8, 300.0) == 2
    clock.t += 1
    assert cache.protect(c, NS, 8, 300.0) == 2  # a (the oldest) gives way
    keys = [k[3] for k in cache.levels.protections()]
    assert keys == [chain(b)[-1], chain(c)[-1]]
    assert cache.levels_snapshot()["protections_given_way"] == 1
    assert cache.pool.protected_bytes == 4 * BLOCK
    assert [cache.pool.get(h).level for h in chain(a)] == [IDLE, IDLE]  # type: ignore[union-attr]
    stormed = storm(cache, 100, 40)
    assert held(cache) == {*chain(b), *chain(c), *[h for s in stormed[-8:] for h in s]}
    # one protection alone larger than the share: all others give way, its head is kept
    d = seq(4, 24)
    store(cache, d)
    assert cache.protect(d, NS, 24, 300.0) == 4
    snap = cache.levels_snapshot()
    assert (snap["protections"], snap["protections_given_way"], snap["protections_trimmed"]) \
        == (1, 3, 1)
    assert [cache.pool.get(h).level for h in chain(d)] == [PROTECTED] * 4 + [IDLE] * 2  # type: ignore[union-attr]
    cache.check()


def test_a_shared_prefix_is_counted_once_and_kept_while_any_breakpoint_holds_it() -> None:
    clock = Clock()
    cache = make(clock, protect_share=0.5)
    long = seq(1, 16)
    store(cache, long)
    hs = chain(long)
    cache.protect(long, NS, 8, 300.0)  # system prompt breakpoint: 2 blocks
    clock.t += 100.0
    cache.protect(long, NS, 16, 300.0)  # the conversation's: 4 blocks (2 shared)
    assert cache.levels_snapshot()["protected_blocks"] == 4
    assert cache.pool.protected_bytes == 4 * BLOCK
    clock.t += 200.0  # the first ends; its blocks stay under the second
    cache.evict(None)
    assert [cache.pool.get(h) is not None for h in hs] == [True] * 4
    clock.t += 100.0
    cache.evict(None)
    assert held(cache) == set()


def test_a_protected_partial_tail_superseded_by_a_longer_block_passes_its_protection_on(
        ) -> None:
    clock = Clock()
    cache = make(clock, protect_share=0.5)
    short, longer = seq(1, 6), seq(1, 8)
    store(cache, short)  # blocks [0, 4) and the partial [4, 6)
    assert cache.protect(short, NS, 6, 300.0) == 2
    partial = list(cache.levels.protections().values())[0][0][1]
    store(cache, longer)  # [4, 8) supersedes the partial [4, 6)
    assert cache.pool.get(partial) is None
    assert list(cache.levels.protections().values()) == [(tuple(chain(longer)), 1300.0)]
    assert [cache.pool.get(h).level for h in chain(longer)] == [PROTECTED] * 2  # type: ignore[union-attr]
    store(cache, longer + [9, 9])
    assert cache.mark_active(longer + [9, 9], NS, "s") == 3  # 2 blocks + a partial
    store(cache, longer + [9, 9, 9, 9])  # supersedes that partial too
    [(hashes, _)] = cache.levels.active_sessions().values()
    assert hashes == tuple(chain(longer + [9, 9, 9, 9]))
    assert cache.pool.get(hashes[2]).level == ACTIVE  # type: ignore[union-attr]


def test_protected_blocks_are_persisted_at_once_unless_asked_not_to() -> None:
    clock = Clock()
    tier = FakeTier()
    cache = make(clock, protect_share=0.5, lower=[tier])
    a, b = seq(1), seq(2)
    store(cache, a)
    store(cache, b)
    assert tier.blocks == {}  # write-back: nothing written before an eviction
    cache.protect(a, NS, 8, 300.0)
    assert set(tier.blocks) == set(chain(a))
    assert all(cache.pool.get(h).persisted for h in chain(a))  # type: ignore[union-attr]
    cache.protect(b, NS, 8, 300.0, persist=False)
    assert set(tier.blocks) == set(chain(a))
    assert cache.stats().demotions == 0


def test_a_deleted_tenant_loses_its_protections() -> None:
    clock = Clock()
    cache = make(clock, protect_share=0.5)
    other = ns_of(BS, tenant="t2")
    store(cache, seq(1))
    cache.store(other, seq(2), 8, payload_for, snapshot_at_end=False)
    cache.protect(seq(1), NS, 8, 300.0)
    cache.protect(seq(2), other, 8, 300.0, key="k")
    cache.delete("t2")
    assert [k[1] for k in cache.levels.protections()] == ["default"]


def test_protect_rejects_bad_input() -> None:
    cache = make(Clock())
    with pytest.raises(ValueError, match="ttl_s"):
        cache.protect([1, 2, 3], NS, 3, 0)
    with pytest.raises(ValueError, match="num_tokens"):
        cache.protect([1, 2, 3], NS, -1, 300.0)
    with pytest.raises(ValueError, match="key"):
        cache.protect([1, 2, 3], NS, 3, 300.0, key="")
    with pytest.raises(ValueError, match="session"):
        cache.mark_active([1, 2, 3], NS, "")
    assert cache.protect([1, 2, 3], NS, 3, 300.0) == 0  # nothing stored: nothing protected


def test_subagents_on_a_shared_prefix_keep_their_own_tails_while_idle_chains_go() -> None:
    clock = Clock()
    cache = make(clock, blocks=20, active_session_s=600.0)
    prefix = seq(1, 8)  # system + tools: 2 blocks
    tails = {a: prefix + seq(10 + i, 8) for i, a in enumerate(("main", "a1", "a2", "a3"))}
    for agent, tokens in tails.items():
        store(cache, tokens)
        assert cache.mark_active(tokens, NS, f"s1/{agent}") == 4
    shared, own = chain(prefix), {a: chain(t)[2:] for a, t in tails.items()}
    assert [cache.pool.get(h).level for h in shared] == [ACTIVE, ACTIVE]  # type: ignore[union-attr]
    # 10 blocks are active; a storm of idle chains churns through the other 10
    stormed = storm(cache, 100, 30)
    kept = {*shared, *[h for hs in own.values() for h in hs]}
    assert held(cache) == kept | {h for c in stormed[-5:] for h in c}
    # main moves on: its previous tail is no longer its latest chain and goes first
    nxt = tails["main"] + seq(20, 8)
    store(cache, nxt)  # evicts the two oldest idle storm blocks
    cache.mark_active(nxt, NS, "s1/main")
    assert [cache.pool.get(h).level for h in chain(nxt)] == [ACTIVE] * 6  # type: ignore[union-attr]
    clock.t += 300.0
    cache.mark_active(tails["a1"], NS, "s1/a1")  # a1 is still working
    clock.t += 300.0  # main, a2 and a3 are quiet for 600 s; a1 only for 300 s
    snap = cache.levels_snapshot()
    assert (snap["active_sessions"], snap["sessions_idle"]) == (1, 3)
    assert [cache.pool.get(h).level for h in chain(tails["a1"])] == [ACTIVE] * 4  # type: ignore[union-attr]
    assert [cache.pool.get(h).level for h in own["a2"]] == [IDLE, IDLE]  # type: ignore[union-attr]
    stormed = storm(cache, 200, 10)
    assert held(cache) == {*chain(tails["a1"]), *[h for c in stormed[-8:] for h in c]}
    cache.check()


def test_active_blocks_go_when_no_idle_block_is_left_and_keep_their_level_when_promoted() -> None:
    clock = Clock()
    tier = FakeTier()
    cache = make(clock, blocks=4, lower=[tier])
    a = seq(1, 8)
    store(cache, a)
    cache.mark_active(a, NS, "s")
    store(cache, seq(2, 8))  # idle: fills the pool
    store(cache, seq(3, 8))  # the idle chain goes, not the active one
    assert held(cache) == {*chain(a), *chain(seq(3, 8))}
    store(cache, seq(4, 16))  # 4 blocks: nothing idle is left, so the active chain goes too
    assert held(cache) == set(chain(seq(4, 16)))
    assert set(chain(a)) <= set(tier.blocks)  # demoted
    hit = cache.acquire(a + [7], NS)  # promoted back: active again
    assert hit.num_tokens == 8
    cache.release(hit)
    assert [cache.pool.get(h).level for h in chain(a)] == [ACTIVE, ACTIVE]  # type: ignore[union-attr]


def test_no_session_levels_when_switched_off() -> None:
    cache = make(Clock(), active_session_s=None)
    store(cache, seq(1))
    assert cache.mark_active(seq(1), NS, "s") == 0
    assert [cache.pool.get(h).level for h in chain(seq(1))] == [IDLE, IDLE]  # type: ignore[union-attr]


def tok(a: int, b: int, n: int) -> list[int]:
    """Sequences on a small tree: a shared first block per ``a``, a tail per ``b``."""
    return ([1000 + a] * BS + [2000 + 10 * a + b] * (3 * BS))[:n]


LENGTHS = st.one_of(st.sampled_from([2 * BS, 3 * BS + 1, 4 * BS]), st.integers(2, 4 * BS))


class LevelsMachine(RuleBasedStateMachine):
    """Stores, protections, sessions, time and evictions in any order: a protected
    block is never evicted, an active one only when no idle block is left, every
    block's level is the one its claims give, the protected bytes stay in the share."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.violations: list[str] = []
        self.cache = make(self.clock, blocks=12, protect_share=0.25, active_session_s=500.0,
                          on_evict=self._evicted)

    def _evicted(self, meta: Any, payload: Any) -> None:
        level = self.cache.levels.level_of(meta.block_hash)
        if level == PROTECTED:
            self.violations.append(f"protected block evicted: {meta.start}")
        if level == ACTIVE and self.cache.pool.level_order(IDLE):
            self.violations.append(f"active block evicted before idle ones: {meta.start}")

    @rule(a=st.integers(0, 1), b=st.integers(0, 1), n=LENGTHS,
          snap=st.booleans())
    def store(self, a: int, b: int, n: int, snap: bool) -> None:
        self.cache.store(NS, tok(a, b, n), n, payload_for, snapshot_at_end=snap)

    @rule(a=st.integers(0, 1), b=st.integers(0, 1), n=LENGTHS,
          pos=LENGTHS, ttl=st.sampled_from([50.0, 300.0]),
          key=st.sampled_from([None, "k1", "k2"]))
    def protect(self, a: int, b: int, n: int, pos: int, ttl: float, key: str | None) -> None:
        got = self.cache.protect(tok(a, b, n), NS, min(pos, n), ttl, key=key)
        assert got <= (min(pos, n) + BS - 1) // BS

    @rule(a=st.integers(0, 1), b=st.integers(0, 1), n=LENGTHS,
          s=st.sampled_from(["s1", "s2", "s3"]))
    def active(self, a: int, b: int, n: int, s: str) -> None:
        self.cache.mark_active(tok(a, b, n), NS, s)

    @rule(dt=st.sampled_from([1.0, 60.0, 250.0, 600.0]))
    def advance(self, dt: float) -> None:
        self.clock.t += dt

    @rule(k=st.integers(1, 6))
    def evict(self, k: int) -> None:
        self.cache.evict(k)

    @rule(a=st.integers(0, 1), b=st.integers(0, 1), n=LENGTHS)
    def hit(self, a: int, b: int, n: int) -> None:
        self.cache.release(self.cache.acquire(tok(a, b, n), NS))

    @invariant()
    def consistent(self) -> None:
        cache = self.cache
        cache.levels_snapshot()  # ticks the clock
        cache.check()
        assert self.violations == []
        for block in cache.pool.blocks():
            assert block.block_hash is not None
            assert block.level == cache.levels.level_of(block.block_hash)
        assert cache.levels.protected_bytes() <= cache.levels.limit_bytes
        now = self.clock.t
        for _, until in cache.levels.protections().values():
            assert until > now


TestLevelsMachine = LevelsMachine.TestCase
TestLevelsMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
