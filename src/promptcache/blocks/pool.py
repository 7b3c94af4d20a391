"""The RAM block pool: ref-counted blocks under a byte budget, a hash map, a children index.

One LRU free queue per eviction level: ``IDLE`` blocks are evicted first (``on_evict``: demotion),
then outside bytes (``reclaim_outside``), then ``ACTIVE``; ``PROTECTED`` never. About 280 B per
block (BENCHMARKS.md). The invariants are checked in ``pool_check``."""

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
from .pool_check import check_pool

__all__ = [
    "ACTIVE", "EMPTY_SESSIONS", "IDLE", "LEVELS", "MAX_AGENTS_PER_BLOCK", "MAX_INTERNED",
    "PERSISTED", "PROTECTED", "SNAPSHOT", "TRUNCATABLE", "Block", "BlockPool",
    "pack_tokens", "unpack_tokens",
]

MAX_INTERNED = 1 << 16  # distinct start offsets / byte sizes shared between blocks


class BlockPool:
    """Blocks in RAM under a byte budget; only unreferenced blocks are evicted."""

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
        # bytes held outside within the budget; the hook frees at least those asked, returns freed
        self.outside_bytes = 0
        self.reclaim_outside: Callable[[int], int] | None = None

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
        """Set a block's eviction level (unreferenced: raised, most recent; lowered, least)."""
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

    def can_allocate(self, nbytes: int, nblocks: int = 1) -> bool:
        """Whether the blocks fit after evicting every unreferenced block and outside bytes."""
        outside = 0 if self.reclaim_outside is not None else self.outside_bytes
        if self.max_blocks is not None:
            evictable = len(self._queues[IDLE]) + len(self._queues[ACTIVE])
            if self.num_blocks - evictable + nblocks > self.max_blocks:
                return False
        return nbytes <= self.budget_bytes and (
            self.used_bytes + outside - self.evictable_bytes + nbytes <= self.budget_bytes
        )

    def make_room(self, nbytes: int, nblocks: int = 1) -> bool:
        """Evict until ``nblocks`` blocks of ``nbytes`` fit; False (none evicted) if impossible."""
        if not self.can_allocate(nbytes, nblocks):
            return False
        self.shrink_to(self.budget_bytes - nbytes)
        if self.max_blocks is not None:
            while self.num_blocks + nblocks > self.max_blocks and self.evict() is not None:
                pass
        return True

    def shrink_to(self, target: int) -> int:
        """Free bytes (idle, outside, active) down to at most ``target``; returns the bytes used."""
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
        """Count ``nbytes`` held outside in the budget, making room first; False if no fit."""
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
        self, *, block_hash: BlockHash | None, parent_hash: BlockHash, tokens: bytes, start: int,
        extra_keys: tuple[bytes, ...], flags: int, ns: Namespace, payload: Any, nbytes: int,
        now: float,
    ) -> Block:
        """Create a block held by the caller (``ref_cnt == 1``); call ``can_allocate`` first."""
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
        """One shared int object per distinct value (bounded table)."""
        got = self._ints.get(value)
        if got is not None:
            return got
        if len(self._ints) < MAX_INTERNED:
            self._ints[value] = value
        return value

    def ref(self, block: Block, now: float | None = None) -> None:
        """Take a reference: the block leaves the free queue."""
        if block.ref_cnt == 0:
            self._queues[block.level].remove(block)
            self._level_bytes[block.level] -= block.nbytes
            self.num_used_blocks += 1
        block.ref_cnt += 1
        if now is not None:
            block.last_access = now

    def unref(self, block: Block) -> None:
        """Drop a reference; at zero the block joins the LRU, or is discarded if private."""
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
        """Unref tail-first, so the tail is evicted before the head."""
        for block in reversed(blocks):
            self.unref(block)

    def evict(self) -> Block | None:
        """Evict the LRU unreferenced idle (else active) block through ``on_evict``."""
        block = self._queues[IDLE].peekleft() or self._queues[ACTIVE].peekleft()
        if block is None:
            return None
        self._drop(block)
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(block)
        return block

    def remove(self, block: Block) -> bool:
        """Delete a block without demotion (a referenced one goes private); True if it was in."""
        if block.block_hash is None or self._map.get(block.block_hash) is not block:
            return False
        if block.ref_cnt == 0:
            self._drop(block)
        else:
            self._unhash(block)
        return True

    def _drop(self, block: Block) -> None:
        # unreferenced and hashed: it keeps its hash (the eviction hook needs it)
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

    def replace_payload(self, block: Block, payload: Any, nbytes: int, flags: int) -> bool:
        """Swap a referenced block's payload; False (nothing changed) if the bytes cannot fit."""
        if block.ref_cnt <= 0:
            raise InvariantError("replace_payload needs a referenced block")
        extra = nbytes - block.nbytes
        if extra > 0 and not self.make_room(extra):
            return False
        block.payload = payload
        block.nbytes = self._intern(nbytes)
        block.flags = flags
        self.used_bytes += extra
        return True

    def copy_on_write(self, block: Block, copy_payload: Callable[[Any], Any], now: float) -> Block | None:
        """A block the caller may modify: itself if private and unshared, else a copy (or None)."""
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

    def check(self) -> None:
        """Raise InvariantError on the first broken invariant."""
        check_pool(self)
