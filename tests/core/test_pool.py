import pytest

from promptcache.blocks.pool import PERSISTED, TRUNCATABLE, Block, BlockPool, pack_tokens
from promptcache.errors import InvariantError
from promptcache.hashing import BlockHash
from promptcache.meta import Namespace

NS = Namespace("m", 2)


def H(i: int) -> BlockHash:
    return BlockHash(i.to_bytes(32, "big"))


def alloc(pool: BlockPool, i: int, parent: int = 0, nbytes: int = 10, now: float = 0.0) -> Block:
    return pool.allocate(
        block_hash=H(i), parent_hash=H(parent), tokens=pack_tokens([i, i]), start=0,
        extra_keys=(), flags=TRUNCATABLE, ns=NS, payload={"i": i}, nbytes=nbytes, now=now,
    )


def num(block: Block) -> int:
    """The ``i`` of ``H(i)``: blocks carry no id, their hash identifies them."""
    assert block.block_hash is not None
    return int.from_bytes(block.block_hash, "big")


def make(budget: int = 100) -> tuple[BlockPool, list[int]]:
    evicted: list[int] = []
    pool = BlockPool(budget, on_evict=lambda b: evicted.append(num(b)))
    return pool, evicted


def test_allocate_assigns_hashes_refs_and_bytes():
    pool, _ = make()
    blocks = [alloc(pool, i + 1) for i in range(3)]
    assert [num(b) for b in blocks] == [1, 2, 3] and len({id(b) for b in blocks}) == 3
    assert [b.ref_cnt for b in blocks] == [1, 1, 1]
    assert (pool.num_blocks, pool.num_used_blocks, pool.num_free_blocks, pool.used_bytes) == (3, 3, 0, 30)
    assert pool.get(H(2)) is blocks[1]
    assert pool.children(H(0)) == blocks
    pool.check()
    with pytest.raises(InvariantError):
        alloc(pool, 2)  # the hash is taken


def test_ref_counting_moves_blocks_in_and_out_of_the_free_queue():
    pool, _ = make()
    a = alloc(pool, 1)
    pool.ref(a, now=5.0)
    assert a.ref_cnt == 2 and a.last_access == 5.0
    pool.unref(a)
    assert a.ref_cnt == 1 and pool.num_free_blocks == 0
    pool.unref(a)
    assert a.ref_cnt == 0 and pool.num_free_blocks == 1 and pool.evictable_bytes == 10
    pool.check()
    with pytest.raises(InvariantError):
        pool.unref(a)
    pool.ref(a)
    assert pool.num_free_blocks == 0 and pool.num_used_blocks == 1 and pool.evictable_bytes == 0
    pool.check()


def test_lru_eviction_order_and_referenced_blocks_are_never_evicted():
    pool, evicted = make(budget=50)
    blocks = [alloc(pool, i + 1) for i in range(5)]  # 50 bytes, all held
    assert not pool.can_allocate(10)
    assert not pool.make_room(10) and evicted == []
    for i in (3, 0, 4):  # released in this order -> LRU order H(4), H(1), H(5)
        pool.unref(blocks[i])
    assert [num(b) for b in pool.lru_order()] == [4, 1, 5]
    pool.ref(blocks[0])  # a hit takes H(1) out of the queue; re-release makes it MRU
    pool.unref(blocks[0])
    assert [num(b) for b in pool.lru_order()] == [4, 5, 1]
    alloc(pool, 10, nbytes=20)  # needs two evictions
    assert evicted == [4, 5]
    assert pool.get(H(4)) is None and pool.get(H(5)) is None and pool.get(H(1)) is blocks[0]
    assert pool.num_evictions == 2 and pool.used_bytes == 50
    pool.check()
    # H(2) and H(3) are still referenced: only H(1) may go
    assert pool.can_allocate(10) and not pool.can_allocate(11)


def test_release_chain_is_tail_first_so_tails_are_evicted_first():
    pool, evicted = make(budget=100)
    chain = [alloc(pool, 1, 0), alloc(pool, 2, 1), alloc(pool, 3, 2)]
    other = [alloc(pool, 7, 0), alloc(pool, 8, 7)]
    pool.release_chain(chain)
    pool.release_chain(other)
    assert [num(b) for b in pool.lru_order()] == [3, 2, 1, 8, 7]
    assert pool.evict() is chain[2] and pool.evict() is chain[1]
    assert evicted == [3, 2]
    pool.check()


def test_block_larger_than_budget_cannot_be_allocated():
    pool, _ = make(budget=100)
    assert not pool.can_allocate(101)
    assert pool.can_allocate(100)
    with pytest.raises(InvariantError):
        alloc(pool, 1, nbytes=101)
    assert pool.num_blocks == 0 and pool.used_bytes == 0


def test_remove_unreferenced_and_referenced_blocks():
    pool, evicted = make()
    a, b = alloc(pool, 1), alloc(pool, 2)
    pool.unref(a)
    assert pool.remove(a) and pool.get(H(1)) is None and pool.used_bytes == 10
    assert pool.remove(b)  # referenced: leaves the map now, discarded at its last unref
    assert pool.get(H(2)) is None and b.block_hash is None
    assert pool.num_blocks == 1 and pool.used_bytes == 10
    pool.check()
    pool.unref(b)
    assert pool.num_blocks == 0 and pool.used_bytes == 0 and pool.num_free_blocks == 0
    assert evicted == []  # removal is not eviction: no demotion
    pool.check()
    assert not pool.remove(b)


def test_copy_on_write():
    pool, _ = make(budget=100)
    shared = alloc(pool, 1, nbytes=30)
    pool.ref(shared)  # a second user
    copy = pool.copy_on_write(shared, lambda p: dict(p, copied=True), now=1.0)
    assert copy is not None and copy is not shared
    assert copy.block_hash is None and copy.ref_cnt == 1 and copy.payload == {"i": 1, "copied": True}
    assert shared.ref_cnt == 1 and pool.get(H(1)) is shared and shared.payload == {"i": 1}
    assert pool.used_bytes == 60 and pool.num_blocks == 2
    pool.check()
    # a private block with one user is written in place
    assert pool.copy_on_write(copy, lambda p: p, now=2.0) is copy
    # even a hashed block used only by the caller is copied (others may hit it later)
    solo = pool.copy_on_write(shared, lambda p: dict(p), now=3.0)
    assert solo is not None and solo is not shared and shared.ref_cnt == 0
    pool.check()
    pool.unref(copy)
    pool.unref(solo)
    assert pool.num_blocks == 1 and pool.used_bytes == 30  # private copies are discarded
    pool.check()


def test_copy_on_write_without_room_keeps_the_original():
    pool, _ = make(budget=50)
    a = alloc(pool, 1, nbytes=30)
    assert pool.copy_on_write(a, lambda p: p, now=0.0) is None
    assert a.ref_cnt == 1 and pool.num_blocks == 1
    pool.check()


def test_replace_payload_accounts_bytes():
    pool, _ = make(budget=100)
    a = alloc(pool, 1, nbytes=30)
    assert pool.replace_payload(a, {"big": 1}, 60, TRUNCATABLE | PERSISTED)
    assert pool.used_bytes == 60 and a.nbytes == 60 and a.persisted
    assert not pool.replace_payload(a, {"huge": 1}, 101, TRUNCATABLE)
    assert pool.used_bytes == 60 and a.payload == {"big": 1}
    pool.check()


def test_bad_budget():
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            BlockPool(bad)  # type: ignore[arg-type]


def test_children_of_an_evicted_parent_are_detached_and_readopted():
    pool, evicted = make(budget=100)
    parent, kid, kid2 = alloc(pool, 1, 0), alloc(pool, 2, 1), alloc(pool, 3, 1)
    assert parent.kids == [kid, kid2] and pool.children(H(1)) == [kid, kid2]
    pool.unref(parent)  # the children stay referenced: the parent alone is evictable
    assert pool.evict() is parent and evicted == [1]
    assert parent.kids is None and pool.get(H(1)) is None
    assert pool.children(H(1)) == [kid, kid2] and pool.find_child(H(1), pack_tokens([3, 3])) is kid2
    pool.check()
    again = alloc(pool, 1, 0)  # e.g. promoted back from SSD: adopts its children
    assert again.kids == [kid, kid2] and pool.children(H(1)) == [kid, kid2]
    assert pool.children(H(0)) == [again]
    pool.check()
    pool.release_chain([kid])
    assert pool.remove(kid) and again.kids is kid2 and pool.children(H(1)) == [kid2]
    pool.release_chain([again])
    assert pool.remove(again) and pool.children(H(1)) == [kid2] and pool.children(H(0)) == []
    pool.check()
    pool.unref(kid2)
    assert pool.evict() is kid2 and pool.children(H(1)) == [] and pool.num_blocks == 0
    pool.check()


def test_start_offsets_and_sizes_are_shared_int_objects():
    pool, _ = make(budget=10**9)
    blocks = [
        pool.allocate(block_hash=H(i), parent_hash=H(100 + i), tokens=pack_tokens([i]),
                      start=int("128000"), extra_keys=(), flags=TRUNCATABLE, ns=NS, payload=None,
                      nbytes=int("1048576"), now=0.0)
        for i in range(1, 4)
    ]
    assert [b.start for b in blocks] == [128000] * 3 and [b.nbytes for b in blocks] == [1048576] * 3
    assert blocks[0].start is blocks[1].start is blocks[2].start
    assert blocks[0].nbytes is blocks[2].nbytes
    assert pool.used_bytes == 3 * 1048576
    pool.check()


class Outside:
    """A holder of bytes outside the pool (the engine's live states): LRU items."""

    def __init__(self, items: list[int]) -> None:
        self.items = items
        self.calls: list[int] = []

    def reclaim(self, nbytes: int) -> int:
        self.calls.append(nbytes)
        freed = 0
        while self.items and freed < nbytes:
            freed += self.items.pop(0)
        return freed


def test_make_room_evicts_idle_blocks_then_outside_bytes_then_active_blocks():
    from promptcache.blocks.pool import ACTIVE

    pool, evicted = make(100)
    out = Outside([15, 15])
    pool.reclaim_outside = out.reclaim
    idle, active = alloc(pool, 1), alloc(pool, 2)
    pool.set_level(active, ACTIVE)
    for b in (idle, active):
        pool.unref(b)
    assert pool.hold_outside(30) and pool.outside_bytes == 30
    assert pool.used_bytes == 20
    # 50 free: 70 more evict the idle block first (10), then ask for the 10 missing
    # (the holder gives one item, 15)
    assert pool.make_room(70)
    assert (evicted, out.calls, out.items, pool.outside_bytes) == ([1], [10], [15], 15)
    # 95 more (of 75 free): the rest of the outside bytes, then the active block
    assert pool.make_room(95)
    assert (evicted, out.calls, out.items, pool.outside_bytes) == ([1, 2], [10, 20], [], 0)
    assert pool.used_bytes == 0
    pool.check()


def test_outside_bytes_that_cannot_fit_are_not_counted():
    pool, evicted = make(100)
    a = alloc(pool, 1, nbytes=80)  # referenced: never evicted
    pool.reclaim_outside = Outside([]).reclaim
    assert not pool.hold_outside(21) and pool.outside_bytes == 0 and evicted == []
    assert pool.hold_outside(20) and pool.outside_bytes == 20
    assert pool.can_allocate(20)  # the outside bytes can be reclaimed
    pool.drop_outside(20)
    assert pool.outside_bytes == 0
    pool.unref(a)
    pool.check()


def test_shrink_to_releases_outside_bytes_before_active_blocks():
    from promptcache.blocks.pool import ACTIVE

    pool, evicted = make(100)
    out = Outside([25])
    pool.reclaim_outside = out.reclaim
    b = alloc(pool, 1, nbytes=50)
    pool.set_level(b, ACTIVE)
    pool.unref(b)
    assert pool.hold_outside(25)
    assert pool.shrink_to(50) == 50
    assert (evicted, pool.outside_bytes, pool.used_bytes) == ([], 0, 50)
    assert pool.shrink_to(0) == 0 and evicted == [1]


def test_max_blocks_caps_the_count_evicting_idle_then_active_blocks():
    from promptcache.blocks.pool import ACTIVE

    evicted: list[int] = []
    pool = BlockPool(1000, on_evict=lambda b: evicted.append(num(b)), max_blocks=3)
    a, b, c = alloc(pool, 1), alloc(pool, 2), alloc(pool, 3)
    pool.set_level(a, ACTIVE)
    for x in (a, b, c):
        pool.unref(x)
    # a fourth block: the LRU idle one (2) goes, though 970 bytes are free
    d = alloc(pool, 4)
    assert evicted == [2] and pool.num_blocks == 3
    # a run of 2 more (the lower tiers' batched promotion): idle 3, then active 1
    assert pool.make_room(20, 2)
    assert evicted == [2, 3, 1] and pool.num_blocks == 1
    # referenced blocks count and are never evicted: 3 referenced leave no room
    e, f = alloc(pool, 5), alloc(pool, 6)
    assert not pool.can_allocate(10) and not pool.make_room(10) and pool.num_blocks == 3
    assert pool.can_allocate(10, 0)  # bytes outside the pool hold no block
    for x in (d, e, f):
        pool.unref(x)
    pool.check()


def test_max_blocks_must_be_positive():
    with pytest.raises(ValueError):
        BlockPool(100, max_blocks=0)
