"""The block pool's invariants (``BlockPool.check``): counts, bytes, and map / children index /
blocks agreeing both ways (private blocks are not in the map).
"""

from __future__ import annotations

from typing import Protocol

from ..errors import InvariantError
from ..hashing import BlockHash
from .block import Block
from .free_queue import FreeQueue


class PoolState(Protocol):
    """What the checker reads of a ``BlockPool`` (which it does not import: no cycle)."""

    budget_bytes: int
    used_bytes: int
    num_blocks: int
    num_used_blocks: int
    _map: dict[BlockHash, Block]
    _detached: dict[BlockHash, Block | list[Block]]
    _queues: tuple[FreeQueue[Block], ...]
    _level_bytes: list[int]

    @property
    def num_free_blocks(self) -> int: ...

    def children(self, parent_hash: BlockHash) -> list[Block]: ...


def check_pool(pool: PoolState) -> None:
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

def _check_kids(pool: PoolState, parent: BlockHash, kids: Block | list[Block] | None) -> int:
    if kids is None:
        return 0
    group = kids if isinstance(kids, list) else [kids]
    if len(group) < (2 if isinstance(kids, list) else 1):
        raise InvariantError("a children list with fewer than two blocks")
    for kid in group:
        if kid.parent_hash != parent or kid.block_hash is None or pool._map.get(kid.block_hash) is not kid:
            raise InvariantError(f"children index holds a stale block: {kid!r}")
    return len(group)
