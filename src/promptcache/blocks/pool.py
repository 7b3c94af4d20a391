"""The RAM block pool: ref-counted blocks, a hash map, a children index, LRU eviction.

``Block`` itself (its flags, eviction levels and packed tokens) is in ``block.py``;
the names are re-exported here.

A block exists in the pool only while it holds cached state. Its life:

* ``allocate`` creates it with ``ref_cnt == 1`` (held by the caller) after
  ``make_room`` evicted least recently used unreferenced blocks for its bytes;
* ``ref`` / ``unref`` count its users (a live ``Hit``, a ``store`` in progress);
  a block with ``ref_cnt == 0`` sits in the free queue of its eviction level (LRU
  order) and is the only kind that can be evicted; ``release_chain`` unrefs a
  sequence tail-first so a chain's tail is evicted before its head;
* ``evict`` / ``make_room`` drop the LRU unreferenced block through the
  ``on_evict`` hook (demotion to the lower tiers): an ``IDLE`` block first, an
  ``ACTIVE`` one (the latest chain of an active session) only when no idle block is
  left, a ``PROTECTED`` one (a cache breakpoint within its ttl) never; the cache
  policy sets the levels (``set_level``); ``remove`` deletes a block without the hook
  (session / tenant deletion, TTL).

Bytes held outside the pool but counted in its budget (the engine's live session
state: ``outside_bytes``, given back through the ``reclaim_outside`` hook) are
reclaimed after the idle blocks and before the active ones: ``make_room`` evicts
idle blocks, then asks the holder to release, then evicts active blocks.

Index layout (kept small: about 280 B per block besides its token ids, see
BENCHMARKS.md): one hash map ``block_hash -> Block`` (the identity of a block: a
hash is held by at most one block); the children index lives in the parent block
itself (``Block.kids``: None, one block or a list), and children whose parent is
not a block in the map (namespace roots, parents evicted or only in a lower tier)
are kept in ``_detached`` keyed by the parent hash, adopted back when a block with
that hash is allocated. Block start offsets and byte sizes are interned (blocks
at one depth share one int object). Blocks carry no id: a block is identified by
its hash (or by identity when private).

The invariants ``check`` verifies are ``check_pool``'s (the end of this module).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import InvariantError
from ..hashing import BlockHash
from ..meta import Namespace
from .block import (
    ACTIVE,
    EMPTY_SESSIONS,
    IDLE,
    LEVELS,
    MAX_AGENTS_PER_BLOCK,
    PERSISTED,
    PROTECTED,
    SNAPSHOT,
    TRUNCATABLE,
    Block,
    pack_tokens,
    unpack_tokens,
)
from .free_queue import FreeQueue

__all__ = [
    "ACTIVE", "EMPTY_SESSIONS", "IDLE", "LEVELS", "MAX_AGENTS_PER_BLOCK", "MAX_INTERNED",
    "PERSISTED", "PROTECTED", "SNAPSHOT", "TRUNCATABLE", "Block", "BlockPool",
    "pack_tokens", "unpack_tokens",
]

MAX_INTERNED = 1 << 16  # distinct start offsets / byte sizes shared between blocks


class BlockPool:
    """Blocks in RAM under a byte budget; LRU eviction of unreferenced blocks only, idle
    ones before active ones; protected ones never (one free queue per level)."""

    def __init__(
        self, budget_bytes: int, on_evict: Callable[[Block], None] | None = None,
        max_blocks: int | None = None,
    ) -> None:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative integer, got {budget_bytes!r}")
        if max_blocks is not None and (isinstance(max_blocks, bool) or max_blocks < 1):
            raise ValueError(f"max_blocks must be a positive integer or None, got {max_blocks!r}")
        self.budget_bytes = budget_bytes
        # at most this many blocks (each one MLX buffer: Metal caps a process's buffers)
        self.max_blocks = max_blocks
        self.on_evict = on_evict
        self._map: dict[BlockHash, Block] = {}
        # children whose parent is not a block in the map: parent hash -> child(ren)
        self._detached: dict[BlockHash, Block | list[Block]] = {}
        self._ints: dict[int, int] = {}
        # unreferenced blocks, one LRU queue per eviction level
        self._queues: tuple[FreeQueue[Block], ...] = tuple(FreeQueue() for _ in LEVELS)
        self._level_bytes = [0 for _ in LEVELS]
        self.used_bytes = 0
        self.num_blocks = 0
        self.num_used_blocks = 0
        self.num_evictions = 0
        # bytes held outside the pool within its budget, and the hook that releases
        # at least the bytes asked (returns those released; 0: nothing left to give)
        self.outside_bytes = 0
        self.reclaim_outside: Callable[[int], int] | None = None

    # ---- queries -------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks (protected ones included)."""
        return sum(len(q) for q in self._queues)

    @property
    def evictable_bytes(self) -> int:
        """Bytes that eviction can reclaim: unreferenced idle and active blocks."""
        return self._level_bytes[IDLE] + self._level_bytes[ACTIVE]

    @property
    def protected_bytes(self) -> int:
        """Bytes of unreferenced protected blocks (referenced ones count as used)."""
        return self._level_bytes[PROTECTED]

    def __len__(self) -> int:
        return len(self._map)

    def get(self, block_hash: BlockHash) -> Block | None:
        return self._map.get(block_hash)

    def _kids_of(self, parent_hash: BlockHash) -> Block | list[Block] | None:
        parent = self._map.get(parent_hash)
        if parent is not None:
            return parent.kids
        return self._detached.get(parent_hash)

    def children(self, parent_hash: BlockHash) -> list[Block]:
        found = self._kids_of(parent_hash)
        if found is None:
            return []
        return list(found) if isinstance(found, list) else [found]

    def find_child(self, parent_hash: BlockHash, tokens: bytes) -> Block | None:
        """The child of ``parent_hash`` whose packed token ids equal ``tokens``."""
        parent = self._map.get(parent_hash)
        found = parent.kids if parent is not None else self._detached.get(parent_hash)
        if found is None:
            return None
        if isinstance(found, Block):
            return found if found.tokens == tokens else None
        for block in found:
            if block.tokens == tokens:
                return block
        return None

    def blocks(self) -> list[Block]:
        """Every hashed block (a snapshot list; order of insertion)."""
        return list(self._map.values())

    def lru_order(self) -> list[Block]:
        """Evictable blocks, next to be evicted first (idle, then active)."""
        return [*self._queues[IDLE], *self._queues[ACTIVE]]

    def level_order(self, level: int) -> list[Block]:
        """The unreferenced blocks of one level, least recently used first."""
        return list(self._queues[level])

    def set_level(self, block: Block, level: int) -> None:
        """Set a block's eviction level. An unreferenced block moves queues: raised, it
        enters the new queue as most recently used; lowered, as least recently used
        (it stopped being wanted: it goes before the blocks already there)."""
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        old = block.level
        if old == level:
            return
        if block.ref_cnt == 0 and block.in_free_queue:
            self._queues[old].remove(block)
            self._level_bytes[old] -= block.nbytes
            if level > old:
                self._queues[level].append(block)
            else:
                self._queues[level].appendleft(block)
            self._level_bytes[level] += block.nbytes
        block.level = level

    # ---- allocation ----------------------------------------------------------
    def can_allocate(self, nbytes: int, nblocks: int = 1) -> bool:
        """Whether ``nblocks`` blocks of ``nbytes`` in all fit after evicting every
        unreferenced block and releasing the bytes held outside if needed."""
        outside = 0 if self.reclaim_outside is not None else self.outside_bytes
        if self.max_blocks is not None:
            evictable = len(self._queues[IDLE]) + len(self._queues[ACTIVE])
            if self.num_blocks - evictable + nblocks > self.max_blocks:
                return False
        return nbytes <= self.budget_bytes and (
            self.used_bytes + outside - self.evictable_bytes + nbytes <= self.budget_bytes
        )

    def make_room(self, nbytes: int, nblocks: int = 1) -> bool:
        """Evict LRU unreferenced idle blocks, then release bytes held outside, then
        evict active blocks, until ``nblocks`` blocks of ``nbytes`` in all fit (bytes
        and, with ``max_blocks``, the count). False if impossible (nothing is evicted
        then)."""
        if not self.can_allocate(nbytes, nblocks):
            return False
        self.shrink_to(self.budget_bytes - nbytes)
        if self.max_blocks is not None:
            while self.num_blocks + nblocks > self.max_blocks and self.evict() is not None:
                pass
        return True

    def shrink_to(self, target: int) -> int:
        """Free bytes in ``make_room``'s order until at most ``target`` are used (blocks
        and outside bytes); returns the bytes used then (above ``target`` when what is
        left cannot be freed)."""
        while self.used_bytes + self.outside_bytes > target:
            if self._queues[IDLE].peekleft() is not None:
                self.evict()
                continue
            if self.outside_bytes and self.reclaim_outside is not None:
                freed = min(self.outside_bytes, max(0, self.reclaim_outside(
                    self.used_bytes + self.outside_bytes - target)))
                if freed:
                    self.outside_bytes -= freed
                    continue
            if self.evict() is None:
                break
        return self.used_bytes + self.outside_bytes

    def hold_outside(self, nbytes: int) -> bool:
        """Count ``nbytes`` held outside the pool in its budget, making room first;
        False (nothing counted) if they cannot fit."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if not self.make_room(nbytes, 0):
            return False
        self.outside_bytes += nbytes
        return True

    def drop_outside(self, nbytes: int) -> None:
        """Bytes held outside were given back by their holder (not through the hook)."""
        self.outside_bytes = max(0, self.outside_bytes - nbytes)

    def allocate(
        self,
        *,
        block_hash: BlockHash | None,
        parent_hash: BlockHash,
        tokens: bytes,
        start: int,
        extra_keys: tuple[bytes, ...],
        flags: int,
        ns: Namespace,
        payload: Any,
        nbytes: int,
        now: float,
    ) -> Block:
        """Create a block held by the caller (``ref_cnt == 1``), evicting as needed.

        Call ``can_allocate`` first: a block that cannot fit raises InvariantError.
        """
        if block_hash is not None and block_hash in self._map:
            raise InvariantError("a block with this hash is already in the pool")
        if not self.make_room(nbytes):
            raise InvariantError(f"no room for {nbytes} bytes (call can_allocate first)")
        block = Block(
            block_hash, parent_hash, tokens, self._intern(start), extra_keys, flags, ns,
            payload, self._intern(nbytes), now,
        )
        block.ref_cnt = 1
        self.num_blocks += 1
        self.num_used_blocks += 1
        self.used_bytes += nbytes
        if block_hash is not None:
            self._map[block_hash] = block
            block.kids = self._detached.pop(block_hash, None)
            self._add_child(block)
        return block

    def _intern(self, value: int) -> int:
        """One shared int object per distinct value (bounded table): blocks at the same
        depth share their start offset, blocks of one shape their byte size."""
        got = self._ints.get(value)
        if got is not None:
            return got
        if len(self._ints) < MAX_INTERNED:
            self._ints[value] = value
        return value

    # ---- references ----------------------------------------------------------
    def ref(self, block: Block, now: float | None = None) -> None:
        """Take a reference (a hit or a store uses the block): it leaves the free queue."""
        if block.ref_cnt == 0:
            self._queues[block.level].remove(block)
            self._level_bytes[block.level] -= block.nbytes
            self.num_used_blocks += 1
        block.ref_cnt += 1
        if now is not None:
            block.last_access = now

    def unref(self, block: Block) -> None:
        """Drop a reference; at zero the block becomes evictable (most recent end of
        the LRU), or is discarded if it is private."""
        if block.ref_cnt <= 0:
            raise InvariantError(f"unref of an unreferenced block {block!r}")
        block.ref_cnt -= 1
        if block.ref_cnt:
            return
        self.num_used_blocks -= 1
        if block.block_hash is None:
            self._discard(block)
        else:
            self._queues[block.level].append(block)
            self._level_bytes[block.level] += block.nbytes

    def release_chain(self, blocks: list[Block]) -> None:
        """Unref the blocks of one sequence tail-first: the tail enters the LRU
        before the head, so it is evicted first."""
        for block in reversed(blocks):
            self.unref(block)

    # ---- eviction and removal --------------------------------------------------
    def evict(self) -> Block | None:
        """Evict the least recently used unreferenced idle block (else active block)
        through ``on_evict``; protected blocks are never evicted."""
        block = self._queues[IDLE].peekleft() or self._queues[ACTIVE].peekleft()
        if block is None:
            return None
        self._drop(block)
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block)
        return block

    def remove(self, block: Block) -> bool:
        """Delete a block without demotion. A referenced block leaves the map at once
        (no new hit can find it) and is discarded when its last user releases it.
        Returns True if the block was in the map."""
        if block.block_hash is None or self._map.get(block.block_hash) is not block:
            return False
        if block.ref_cnt == 0:
            self._drop(block)
        else:
            self._unhash(block)
        return True

    def _drop(self, block: Block) -> None:
        # an unreferenced, hashed block: out of the queue, the map and the budget.
        # It keeps its hash (the eviction hook needs it); nothing refers to it any more.
        self._queues[block.level].remove(block)
        self._level_bytes[block.level] -= block.nbytes
        if block.block_hash is not None:
            self._unindex(block)
        self._discard(block)

    def _unhash(self, block: Block) -> None:
        # a referenced block becomes private: discarded at its last unref
        if block.block_hash is None:
            return
        self._unindex(block)
        block.block_hash = None

    def _unindex(self, block: Block) -> None:
        # out of the map and of its parent's children; its own children are detached
        h = block.block_hash
        if h is None:
            return
        self._remove_child(block)
        del self._map[h]
        if block.kids is not None:
            self._detached[h] = block.kids
            block.kids = None

    def _discard(self, block: Block) -> None:
        self.used_bytes -= block.nbytes
        self.num_blocks -= 1

    # ---- payload changes -----------------------------------------------------
    def replace_payload(self, block: Block, payload: Any, nbytes: int, flags: int) -> bool:
        """Swap a block's payload (e.g. upgrade to one with a snapshot). The block must
        be referenced by the caller. False (nothing changed) if the bytes cannot fit."""
        if block.ref_cnt <= 0:
            raise InvariantError("replace_payload needs a referenced block")
        extra = nbytes - block.nbytes
        if extra > 0 and not self.make_room(extra):
            return False
        # (referenced: not in a queue, so no level bytes to move)
        block.payload = payload
        block.nbytes = self._intern(nbytes)
        block.flags = flags
        self.used_bytes += extra
        return True

    def copy_on_write(self, block: Block, copy_payload: Callable[[Any], Any], now: float) -> Block | None:
        """The caller holds ``block`` and wants to modify it. A private block with no
        other user is returned as is; a shared or hashed block yields a new private
        copy (held by the caller, who loses its reference on the original). None if
        the copy does not fit the budget (the original is still held then)."""
        if block.ref_cnt <= 0:
            raise InvariantError("copy_on_write needs a referenced block")
        if block.block_hash is None and block.ref_cnt == 1:
            return block
        if not self.can_allocate(block.nbytes):
            return None
        # hold the original so making room cannot evict it
        copy = self.allocate(
            block_hash=None, parent_hash=block.parent_hash, tokens=block.tokens,
            start=block.start, extra_keys=block.extra_keys, flags=block.flags & ~PERSISTED,
            ns=block.ns, payload=copy_payload(block.payload), nbytes=block.nbytes, now=now,
        )
        copy.sessions = block.sessions
        copy.agents = block.agents
        self.unref(block)
        return copy

    # ---- children index ------------------------------------------------------
    def _add_child(self, block: Block) -> None:
        ph = block.parent_hash
        parent = self._map.get(ph)
        cur = parent.kids if parent is not None else self._detached.get(ph)
        new: Block | list[Block]
        if cur is None:
            new = block
        elif isinstance(cur, list):
            cur.append(block)
            return
        else:
            new = [cur, block]
        if parent is not None:
            parent.kids = new
        else:
            self._detached[ph] = new

    def _remove_child(self, block: Block) -> None:
        ph = block.parent_hash
        parent = self._map.get(ph)
        cur = parent.kids if parent is not None else self._detached.get(ph)
        new: Block | list[Block] | None
        if cur is block:
            new = None
        elif isinstance(cur, list) and block in cur:
            cur.remove(block)
            if len(cur) != 1:
                return
            new = cur[0]
        else:
            raise InvariantError(f"block {block!r} missing from the children index")
        if parent is not None:
            parent.kids = new
        elif new is None:
            del self._detached[ph]
        else:
            self._detached[ph] = new

    # ---- invariants (tests) ----------------------------------------------------
    def check(self) -> None:
        """Verify every invariant (``check_pool``); raise InvariantError on the first
        broken one."""
        check_pool(self)


# ---- the invariants (tests, the admin check) ------------------------------------
# ``num_free_blocks + num_used_blocks == num_blocks``, ``used_bytes <= budget_bytes``, and
# the hash map, the children index and the blocks agree both ways. A *private* block
# (``block_hash is None``: copy-on-write, or removed while referenced) is not in the map;
# it is discarded when its last reference goes.

def check_pool(pool: BlockPool) -> None:
    """Verify every invariant of ``pool``; raise InvariantError on the first broken one."""
    for q in pool._queues:
        q.check()
    if pool.num_free_blocks + pool.num_used_blocks != pool.num_blocks:
        raise InvariantError(
            f"free {pool.num_free_blocks} + used {pool.num_used_blocks} != total {pool.num_blocks}"
        )
    if pool.used_bytes > pool.budget_bytes:
        raise InvariantError(f"used bytes {pool.used_bytes} > budget {pool.budget_bytes}")
    for level, queue in enumerate(pool._queues):
        level_bytes = 0
        for block in queue:
            if block.ref_cnt != 0:
                raise InvariantError(f"referenced block in the free queue: {block!r}")
            if block.block_hash is None or pool._map.get(block.block_hash) is not block:
                raise InvariantError(f"free block not in the map: {block!r}")
            if block.level != level:
                raise InvariantError(f"level {block.level} block in queue {level}: {block!r}")
            level_bytes += block.nbytes
        if level_bytes != pool._level_bytes[level]:
            raise InvariantError(f"level {level} bytes {pool._level_bytes[level]} != "
                                 f"{level_bytes}")
    hashed_bytes = 0
    num_children = 0
    for h, block in pool._map.items():
        if block.block_hash != h:
            raise InvariantError(f"map key does not match block hash: {block!r}")
        if block.ref_cnt < 0:
            raise InvariantError(f"negative ref count: {block!r}")
        if (block.ref_cnt == 0) != block.in_free_queue:
            raise InvariantError(f"free queue membership disagrees with ref count: {block!r}")
        if not any(kid is block for kid in pool.children(block.parent_hash)):
            raise InvariantError(f"block missing from the children index: {block!r}")
        hashed_bytes += block.nbytes
        num_children += _check_kids(pool, h, block.kids)
    for parent, kids in pool._detached.items():
        if parent in pool._map:
            raise InvariantError(f"detached children of a block in the map: {parent.hex()[:12]}")
        num_children += _check_kids(pool, parent, kids)
    if num_children != len(pool._map):
        raise InvariantError(f"children index holds {num_children} blocks, map {len(pool._map)}")
    private = pool.num_blocks - len(pool._map)
    if private < 0:
        raise InvariantError(f"{len(pool._map)} mapped blocks but num_blocks {pool.num_blocks}")
    if private == 0 and hashed_bytes != pool.used_bytes:
        raise InvariantError(f"used bytes {pool.used_bytes} != sum of blocks {hashed_bytes}")

def _check_kids(pool: BlockPool, parent: BlockHash, kids: Block | list[Block] | None) -> int:
    if kids is None:
        return 0
    group = kids if isinstance(kids, list) else [kids]
    if len(group) < (2 if isinstance(kids, list) else 1):
        raise InvariantError("a children list with fewer than two blocks")
    for kid in group:
        if kid.parent_hash != parent or kid.block_hash is None or pool._map.get(kid.block_hash) is not kid:
            raise InvariantError(f"children index holds a stale block: {kid!r}")
    return len(group)
