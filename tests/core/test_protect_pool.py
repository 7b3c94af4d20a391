"""Eviction levels of the block pool: idle blocks are evicted before the active ones,
protected blocks never; exact eviction order by block hash."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from promptcache.blocks.pool import (
    ACTIVE,
    IDLE,
    PROTECTED,
    TRUNCATABLE,
    Block,
    BlockPool,
    pack_tokens,
)
from promptcache.hashing import BlockHash
from promptcache.meta import Namespace

NS = Namespace("m", 2)


def H(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def num(block: Block) -> int:
    assert block.block_hash is not None
    return int.from_bytes(block.block_hash, "big")


def alloc(pool: BlockPool, i: int, nbytes: int = 10) -> Block:
    return pool.allocate(block_hash=H(i), parent_hash=H(0), tokens=pack_tokens([i, i]),
                         start=0, extra_keys=(), flags=TRUNCATABLE, ns=NS, payload={"i": i},
                         nbytes=nbytes, now=0.0)


def make(budget: int = 100) -> tuple[BlockPool, list[int]]:
    evicted: list[int] = []
    pool = BlockPool(budget, on_evict=lambda b: evicted.append(num(b)))
    return pool, evicted


def test_idle_blocks_go_before_active_ones_whatever_their_recency() -> None:
    pool, evicted = make()
    blocks = {i: alloc(pool, i) for i in range(1, 7)}
    pool.set_level(blocks[1], ACTIVE)  # referenced: only the level changes
    pool.set_level(blocks[2], ACTIVE)
    for i in (1, 2, 3, 4, 5, 6):  # 1 and 2 are the least recently used
        pool.unref(blocks[i])
    pool.check()
    assert [num(b) for b in pool.lru_order()] == [3, 4, 5, 6, 1, 2]
    assert [num(b) for b in pool.level_order(ACTIVE)] == [1, 2]
    while pool.evict() is not None:
        pass
    assert evicted == [3, 4, 5, 6, 1, 2]
    pool.check()


def test_protected_blocks_are_never_evicted_and_do_not_count_as_room() -> None:
    pool, evicted = make(budget=40)
    a, b, c, d = (alloc(pool, i) for i in (1, 2, 3, 4))
    pool.set_level(a, PROTECTED)
    pool.set_level(c, PROTECTED)
    for blk in (a, b, c, d):
        pool.unref(blk)
    assert (pool.evictable_bytes, pool.protected_bytes) == (20, 20)
    assert pool.can_allocate(20) and not pool.can_allocate(21)
    e = alloc(pool, 5, nbytes=20)  # evicts the idle ones, never the protected ones
    assert evicted == [2, 4]
    assert pool.evict() is None and not pool.can_allocate(1)
    pool.unref(e)
    assert pool.make_room(20) and evicted == [2, 4, 5]
    assert {num(x) for x in pool.level_order(PROTECTED)} == {1, 3}
    pool.check()


def test_a_lowered_block_goes_first_a_raised_one_last() -> None:
    pool, evicted = make()
    blocks = [alloc(pool, i) for i in range(1, 5)]
    for blk in blocks:
        pool.unref(blk)
    pool.set_level(blocks[0], ACTIVE)  # 1 leaves the idle queue
    pool.set_level(blocks[3], ACTIVE)  # raised: the most recent active block
    assert [num(x) for x in pool.level_order(ACTIVE)] == [1, 4]
    pool.set_level(blocks[3], IDLE)  # lowered: before every idle block
    assert [num(x) for x in pool.level_order(IDLE)] == [4, 2, 3]
    pool.set_level(blocks[1], PROTECTED)
    pool.set_level(blocks[1], ACTIVE)  # lowered from protected: the oldest active block
    assert [num(x) for x in pool.level_order(ACTIVE)] == [2, 1]
    while pool.evict() is not None:
        pass
    assert evicted == [4, 3, 2, 1]
    pool.check()


def test_levels_survive_references_and_removal() -> None:
    pool, evicted = make()
    a, b = alloc(pool, 1), alloc(pool, 2)
    pool.set_level(a, PROTECTED)
    pool.unref(a)
    pool.unref(b)
    pool.ref(a)  # a hit: out of the queue, still protected
    assert a.level == PROTECTED and pool.protected_bytes == 0
    pool.unref(a)
    assert pool.protected_bytes == 10
    assert pool.remove(a)  # deletion (session, TTL) removes protected blocks too
    assert pool.protected_bytes == 0 and pool.evict() is b and evicted == [2]
    with pytest.raises(ValueError):
        pool.set_level(b, 7)
    pool.check()


class Levels(RuleBasedStateMachine):
    """Random allocations, references and level changes: the invariants hold, and an
    eviction never takes a protected block, nor an active one while an idle one exists."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(200)
        self.blocks: list[Block] = []
        self.n = 0

    @rule(nbytes=st.integers(1, 30))
    def allocate(self, nbytes: int) -> None:
        if self.pool.can_allocate(nbytes):
            self.n += 1
            self.blocks.append(alloc(self.pool, self.n, nbytes))

    @rule(i=st.integers(0, 50))
    def unref(self, i: int) -> None:
        live = [b for b in self.blocks if b.ref_cnt > 0 and self.pool.get(b.block_hash or H(0)) is b]
        if live:
            self.pool.unref(live[i % len(live)])

    @rule(i=st.integers(0, 50))
    def ref(self, i: int) -> None:
        free = [b for b in self.blocks if b.ref_cnt == 0 and self.pool.get(b.block_hash or H(0)) is b]
        if free:
            self.pool.ref(free[i % len(free)])

    @rule(i=st.integers(0, 50), level=st.sampled_from([IDLE, ACTIVE, PROTECTED]))
    def set_level(self, i: int, level: int) -> None:
        alive = [b for b in self.blocks if self.pool.get(b.block_hash or H(0)) is b]
        if alive:
            self.pool.set_level(alive[i % len(alive)], level)

    @rule()
    def evict(self) -> None:
        idle = self.pool.level_order(IDLE)
        active = self.pool.level_order(ACTIVE)
        got = self.pool.evict()
        if idle:
            assert got is idle[0]
        elif active:
            assert got is active[0]
        else:
            assert got is None

    @invariant()
    def consistent(self) -> None:
        self.pool.check()


TestLevels = Levels.TestCase
TestLevels.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
