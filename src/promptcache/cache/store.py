"""Storing blocks: ``store`` creates the blocks of a token sequence not stored yet (from a
``ChainCursor``), dedups against stored ones (session recorded, snapshot upgrade), drops
partial tails a longer block supersedes, and hands new blocks to write-through tiers."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..blocks.pool import PERSISTED, SNAPSHOT, TRUNCATABLE, Block, BlockPool
from ..blocks.tokens import RequestTokens, to_request_tokens
from ..hashing import BlockHash
from ..meta import ExtraKeySpan, Namespace, extra_keys_for
from ..stats import SAVE_POINTS, Counters
from ..tiers.base import Tier
from . import matcher as _matcher
from .levels import Levels
from .lower import ALL_TIERS, LowerWriter, in_tiers
from .miss import NOT_STORED, GoneMemory
from .policy import Expiry, Faults
from .types import ChainCursor, PayloadAdapter, check_ns, check_spans

logger = logging.getLogger(__name__)


def check_store(ns: Namespace, tokens: Any, num_tokens: int, payload_for: Any,
                extra_keys: Sequence[ExtraKeySpan], session_id: str | None,
                agent_id: str | None, save_point: str, cursor: ChainCursor | None,
                block_size: int) -> tuple[RequestTokens, tuple[ExtraKeySpan, ...], int]:
    """``store``'s arguments checked (ValueError): tokens from the cursor, spans, cursor start."""
    check_ns(ns, block_size)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int):
        raise ValueError(f"num_tokens must be an integer, got {num_tokens!r}")
    offset = 0
    if cursor is not None:
        if not isinstance(cursor, ChainCursor) or cursor.ns != ns:
            raise ValueError("cursor must be a ChainCursor of the same namespace")
        if cursor.start > num_tokens:
            raise ValueError(f"cursor start {cursor.start} is past num_tokens {num_tokens}")
        offset = cursor.start
        # only the tokens from the cursor on are read (and validated)
        tokens = (RequestTokens(tokens.arr[offset:num_tokens])
                  if isinstance(tokens, RequestTokens) else tokens[offset:num_tokens])
    req = to_request_tokens(tokens, allow_empty=cursor is not None)
    spans = check_spans(extra_keys)
    if not 0 <= num_tokens - offset <= req.n:
        raise ValueError(f"num_tokens must be in [0, {offset + req.n}], got {num_tokens}")
    if save_point not in SAVE_POINTS:
        raise ValueError(f"save_point must be one of {SAVE_POINTS}, got {save_point!r}")
    if session_id is not None and (not isinstance(session_id, str) or not session_id):
        raise ValueError(f"session_id must be a non-empty string or None, got {session_id!r}")
    if agent_id is not None and (not isinstance(agent_id, str) or not agent_id):
        raise ValueError(f"agent_id must be a non-empty string or None, got {agent_id!r}")
    if not callable(payload_for):
        raise ValueError("payload_for must be callable")
    return req, spans, offset


def first_unstored(ns: Namespace, tokens: Any, num_tokens: int, cursor: ChainCursor | None,
                   cause: str, extra_keys: Sequence[ExtraKeySpan], block_size: int
                   ) -> tuple[BlockHash | None, BlockHash | None] | None:
    """``note_not_stored``'s arguments checked (ValueError) and its keys (first unstored
    full block, the cursor's block); None when nothing after the cursor was unsaved."""
    check_ns(ns, block_size)
    if not isinstance(cause, str) or not cause:
        raise ValueError(f"cause must be a non-empty string, got {cause!r}")
    start = 0 if cursor is None else cursor.start
    parent = None if cursor is None else cursor.parent
    if start >= num_tokens:
        return None  # nothing after the cursor was left unsaved
    bs = ns.block_size
    spans = check_spans(extra_keys)
    first: BlockHash | None = None
    if start + bs <= num_tokens:
        part = tokens.arr if isinstance(tokens, RequestTokens) else tokens
        arr = to_request_tokens(part[start:start + bs]).arr
        extra = extra_keys_for(spans, start, start + bs) if spans else ()
        first = _matcher.block_hash(ns.root if parent is None else parent, arr, extra)
    return first, parent


@dataclass(eq=False)
class Store:
    pool: BlockPool
    lower: Sequence[Tier]
    writer: LowerWriter
    levels: Levels
    expiry: Expiry
    adapter: PayloadAdapter
    gone: GoneMemory
    faults: Faults
    counters: Counters

    def store(self, ns: Namespace, req: RequestTokens, num_tokens: int,
               payload_for: Callable[[int, int, bool], Any], spans: tuple[ExtraKeySpan, ...],
               session_id: str | None, truncatable: bool, snapshot_at_end: bool,
               include_partial: bool, offset: int = 0, cursor: ChainCursor | None = None,
               agent_id: str | None = None, *, now: float) -> int:
        """``req``, ``num_tokens`` count from ``offset`` (a cursor start); positions absolute."""
        pool, c, bs = self.pool, self.counters, ns.block_size
        held: list[Block] = []
        created: list[Block] = []
        upgraded: list[Block] = []
        parent = ns.root if cursor is None or cursor.parent is None else cursor.parent
        total = offset + num_tokens
        try:
            for start in range(offset, total, bs):
                end = min(start + bs, total)
                if end - start < bs and not include_partial:
                    break
                extra = extra_keys_for(spans, start, end) if spans else ()
                h = _matcher.block_hash(parent, req.arr[start - offset:end - offset], extra)
                want = req.slice_bytes(start - offset, end - offset)
                snap = snapshot_at_end and end == total
                flags = (TRUNCATABLE if truncatable else 0) | (SNAPSHOT if snap else 0)
                existing = pool.get(h)
                if existing is not None and not (
                    existing.parent_hash == parent and existing.start == start
                    and existing.tokens == want and existing.ns == ns
                ):
                    c.collisions += 1
                    logger.warning("hash collision at token %d: block not stored", start)
                    break
                if existing is not None and existing.ref_cnt == 0 and self.expiry.expired(existing, now):
                    self.expiry.remove(existing)
                    existing = None
                if existing is None and truncatable and end - start < bs:
                    # a partial tail already covered by a longer stored sibling adds nothing
                    existing = self._covering_sibling(parent, want, extra, ns, now)
                if existing is not None:
                    pool.ref(existing, now)
                    held.append(existing)
                    c.dedup_blocks += 1
                    if self._touch_existing(existing, session_id, snap, start, end, payload_for):
                        upgraded.append(existing)
                    if agent_id is not None:
                        existing.add_agent(agent_id)
                else:
                    payload = payload_for(start, end, snap)
                    nbytes = self.adapter.nbytes(payload)
                    if not pool.can_allocate(nbytes):
                        c.drops += 1
                        logger.debug("no room for a %d-byte block at token %d: dropped", nbytes, start)
                        # the next lookup stopping here says why: not_stored: budget
                        self.gone.record(h, None if start == 0 else parent,
                                         NOT_STORED, "budget")
                        break
                    block = pool.allocate(
                        block_hash=h, parent_hash=parent, tokens=want, start=start,
                        extra_keys=extra, flags=flags, ns=ns, payload=payload, nbytes=nbytes,
                        now=now,
                    )
                    if session_id is not None:
                        block.add_session(session_id)
                    self.levels.on_new_block(block)
                    if agent_id is not None:
                        block.add_agent(agent_id)
                    if truncatable:
                        self._drop_superseded(block)
                    self.gone.forget(h)
                    held.append(block)
                    created.append(block)
                parent = h
                if cursor is not None and end - start == bs:
                    cursor.start, cursor.parent = end, h
            if self.lower:
                for block in created + upgraded:
                    self.writer.offer(block)  # to the write-through tiers, if any
        finally:
            pool.release_chain(held)
        return len(created)

    def _covering_sibling(self, parent: BlockHash, want: bytes, extra: tuple[bytes, ...],
                          ns: Namespace, now: float) -> Block | None:
        """A stored truncatable sibling whose tokens extend ``want`` (same extra keys)."""
        for sib in self.pool.children(parent):
            if (sib.truncatable and sib.ns == ns and sib.extra_keys == extra
                    and len(sib.tokens) > len(want) and sib.tokens.startswith(want)
                    and not self.expiry.expired(sib, now)):
                return sib
        return None

    def _drop_superseded(self, block: Block) -> None:
        """Remove unreferenced partial siblings that prefix ``block``; their sessions move over."""
        bs = block.ns.block_size
        for sib in self.pool.children(block.parent_hash):
            if (sib is not block and sib.ref_cnt == 0 and sib.truncatable
                    and sib.num_tokens < bs and sib.num_tokens < block.num_tokens
                    and sib.extra_keys == block.extra_keys
                    and block.tokens.startswith(sib.tokens)):
                for sid in sib.sessions:
                    block.add_session(sid)
                if sib.block_hash is not None:
                    self.levels.supersede(sib.block_hash, block)
                for aid in sib.agents:
                    block.add_agent(aid)
                where, h = in_tiers(sib, len(self.lower)), sib.block_hash
                if self.pool.remove(sib):
                    self.counters.superseded += 1
                    if where and h is not None:
                        self._discard_lower(h, sib.ns, where)

    def _discard_lower(self, block_hash: BlockHash, ns: Namespace, where: list[int]) -> None:
        for tier in (self.lower[i] for i in where):
            try:
                tier.discard((block_hash,), ns=ns)
            except Exception as e:
                self.faults.tier_error(tier, e)

    def _touch_existing(self, block: Block, session_id: str | None, snap: bool, start: int,
                        end: int, payload_for: Callable[[int, int, bool], Any]) -> bool:
        """``block`` exists: record the session; upgrade to a snapshot if wanted (True)."""
        if session_id is not None and block.add_session(session_id):
            for tier in (self.lower[i] for i in in_tiers(block, len(self.lower))):
                try:
                    tier.add_sessions(block.meta().block_hash, (session_id,), ns=block.ns)
                except Exception as e:
                    self.faults.tier_error(tier, e)
        if snap and not block.restorable_at_end():
            payload = payload_for(start, end, True)
            nbytes = self.adapter.nbytes(payload)
            flags = (block.flags | SNAPSHOT) & ~(PERSISTED | ALL_TIERS)
            if self.pool.replace_payload(block, payload, nbytes, flags):
                self.counters.upgrades += 1
                self.levels.resized(block)
                return True
            self.counters.drops += 1
        return False
