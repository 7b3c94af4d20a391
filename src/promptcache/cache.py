"""PromptCache: the one policy module (lookup, store, promote, demote, delete, TTL, stats).

RAM is the block pool (``blocks.pool``); lower tiers (SSD, Redis) implement
``tiers.base.Tier`` and hold encoded payload bytes (``codec``). See
docs/INTERFACES.md for the contract, ``blocks.matcher`` for the matching rule and
``cache_lower`` for how blocks reach the lower tiers (per-tier write policy).

Failure policy: any exception from a lower tier (``TierError``, or a tier breaking
its contract) and undecodable bytes are counted and treated as a miss; nothing a
tier does fails a call here, and no reference stays pinned.
Bad input raises ``ValueError``. Every public method holds one re-entrant lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .blocks import matcher as _matcher
from .blocks.matcher import (
    EVICTED,
    EXPIRED,
    RAM,
    Entry,
    GoneMemory,
    LowerEntry,
    Matcher,
    MissInfo,
    entry_tier,
)
from .blocks.pool import PERSISTED, SNAPSHOT, TRUNCATABLE, Block, BlockPool
from .blocks.tokens import RequestTokens, to_request_tokens
from .cache_levels import Levels
from .cache_lower import (
    ALL_TIERS,
    DEMOTE_TIMEOUT_S,
    MAX_TIERS,
    LowerWriter,
    PersistReport,
    in_tiers,
    mark_in_tier,
)
from .cache_types import (
    ChainCursor,
    DecodeFn,
    EncodeFn,
    Hit,
    Match,
    NumpyAdapter,
    PayloadAdapter,
    check_ns,
    check_spans,
)
from .config import CacheConfig
from .errors import TierError
from .hashing import BlockHash
from .meta import BlockMeta, ExtraKeySpan, Namespace, extra_keys_for
from .stats import SAVE_POINTS, CacheStats, Counters, snapshot
from .tiers.base import LazyPayload, Tier

logger = logging.getLogger(__name__)

# A chain's blocks in one remote tier are read in batches of at most this many bytes
# (RAM is reserved for a whole batch before it is read).
PROMOTE_BATCH_BYTES = 64 * 1024 * 1024
_UNFETCHED = object()
_FAILED = object()

__all__ = [
    "RAM", "CacheStats", "ChainCursor", "Hit", "Match", "MissInfo", "NumpyAdapter", "PayloadAdapter", "PromptCache",
]

class PromptCache:
    """Multi-tier prompt cache: RAM block pool + lower tiers (see module docstring)."""

    def __init__(
        self,
        config: CacheConfig,
        adapter: PayloadAdapter | None = None,
        lower: Sequence[Tier] = (),
        *,
        write_through: bool = False,
        encode: EncodeFn | None = None,
        decode: DecodeFn | None = None,
        on_evict: Callable[[BlockMeta, Any], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        demote_timeout_s: float = DEMOTE_TIMEOUT_S,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise ValueError(f"config must be a CacheConfig, got {type(config).__name__}")
        self.config = config
        self.adapter: PayloadAdapter = adapter if adapter is not None else NumpyAdapter()
        self.lower: list[Tier] = list(lower)
        if len(self.lower) > MAX_TIERS:
            raise ValueError(f"at most {MAX_TIERS} lower tiers, got {len(self.lower)}")
        self.write_through = write_through
        # the per-tier write policy: the tiers that get every new block at store (every
        # tier when the cache is write_through; else the tiers whose ``policy`` is
        # "write_through", e.g. the shared Redis tier); the others get a block when it
        # leaves RAM
        wt_tiers = (range(len(self.lower)) if write_through else
                    [i for i, t in enumerate(self.lower)
                     if getattr(t, "policy", None) == "write_through"])
        self._encode = encode
        self._decode = decode
        self._extra_on_evict = on_evict
        self._clock = clock
        self._now = clock()
        self._lock = threading.RLock()
        self._c = Counters()
        self.gone = GoneMemory(config.explain_history)
        self.pool = BlockPool(config.resolved_ram_budget(), on_evict=self._on_block_evicted)
        self._writer = LowerWriter(
            self.lower, self._source, self._is_live, self._lock, self._c, self._on_tier_error,
            write_through=wt_tiers, demote_timeout_s=demote_timeout_s,
        )
        self.levels = Levels(self.pool, share=config.protect_share,
                             active_s=config.active_session_s, persist=self._persist_first)
        self._matcher = Matcher(
            self.pool, self.lower, self.gone,
            is_expired=self._is_expired, on_tier_error=self._on_tier_error,
        )
        # ops hooks (``advisor.py``): ``evicted(meta)`` for every evicted block,
        # ``acquired(tokens, ns, spans, hit_tokens, miss)`` after every acquire; called
        # under the lock, must be cheap, and may not fail a call (errors are logged)
        self.observers: list[Any] = []

    # ---- codec (lazy: the SSD side provides it) ---------------------------------
    def _enc(self, arrays: Mapping[str, np.ndarray], meta: Mapping[str, str]) -> bytes:
        if self._encode is None:
            from . import codec

            self._encode = codec.encode
        return self._encode(arrays, meta)

    def _dec(self, data: bytes) -> tuple[dict[str, np.ndarray], dict[str, str]]:
        if self._decode is None:
            from . import codec

            self._decode = codec.decode
        return self._decode(data)

    # ---- helpers -------------------------------------------------------------
    def _is_expired(self, block: Block) -> bool:
        ttl = self.config.ttl_seconds
        return ttl is not None and self._now - block.last_access > ttl

    def _on_tier_error(self, tier: Any, exc: BaseException) -> None:
        self._c.tier_errors += 1
        logger.warning("cache tier %s failed: %s", getattr(tier, "name", tier), exc)

    def _expire_lru(self) -> None:
        """Remove expired unreferenced blocks from the LRU end of the free queue."""
        if self.config.ttl_seconds is None:
            return
        for block in self.pool.lru_order():
            if not self._is_expired(block):
                break
            self._remove_expired(block)

    def _remove_expired(self, block: Block) -> None:
        if block.block_hash is not None:
            self.gone.record(block.block_hash, block.parent_hash, EXPIRED)
        if self.pool.remove(block):
            self._c.expired += 1

    def _source(self, block: Block) -> LazyPayload:
        """The block's payload as a ``PayloadSource``: encoded (arrays -> numpy ->
        safetensors) by the first tier writer that needs the bytes, off the request
        path, once for every tier."""
        adapter, payload, hx = self.adapter, block.payload, block.meta().block_hash.hex()

        def make() -> bytes:
            extra = {k: v for k, v in adapter.meta(payload).items() if k != "block_hash"}
            return self._enc(adapter.to_numpy(payload), {**extra, "block_hash": hx})

        return LazyPayload(make, block.nbytes)

    def _is_live(self, block: Block) -> bool:
        return block.block_hash is not None and self.pool.get(block.block_hash) is block

    def _notify(self, event: str, *args: Any) -> None:
        for obs in self.observers:
            try:
                getattr(obs, event)(*args)
            except Exception:
                logger.exception("cache observer %r failed on %s", obs, event)

    def _on_block_evicted(self, block: Block) -> None:
        """The demotion hook: every evicted block passes here exactly once."""
        self._c.evictions += 1
        h = block.block_hash
        if self.observers and h is not None:
            self._notify("evicted", block.meta())
        if h is not None:
            self.gone.record(h, block.parent_hash, EVICTED)
        if self.lower and not block.persisted and h is not None:
            ok, failed = self._writer.demote(block)
            self._c.demotions += ok
            self._c.demotion_failures += failed
        elif not self.lower:
            self._c.evicted_dropped += 1
        if self._extra_on_evict is not None and h is not None:
            try:
                self._extra_on_evict(block.meta(), block.payload)
            except Exception:
                logger.exception("on_evict hook failed for block %r", block)

    # ---- lookup / acquire / release ------------------------------------------
    def lookup(self, tokens: Any, ns: Namespace, extra_keys: Sequence[ExtraKeySpan] = (),
               explain: bool = False) -> Match:
        """The longest restorable cached prefix of ``tokens`` (a pure query: no LRU
        change, no stats). ``explain`` is accepted for symmetry: ``miss`` is always set
        on a short match."""
        req = to_request_tokens(tokens)
        check_ns(ns, self.config.block_size)
        spans = check_spans(extra_keys)
        with self._lock:
            self._now = self._clock()
            raw = self._matcher.match(req, ns, spans)
            return Match(raw.entries, raw.num_tokens, raw.matched_tokens, raw.miss)

    def stored_after(self, tokens: Any, ns: Namespace, position: int, limit: int = 32,
                     extra_keys: Sequence[ExtraKeySpan] = ()) -> list[int]:
        """The stored token ids that follow ``tokens[:position]`` in the stored block
        closest to ``tokens`` there (a pure query, for miss explanations: the cached
        side of a divergence); at most ``limit``, empty when nothing is stored."""
        req = to_request_tokens(tokens)
        check_ns(ns, self.config.block_size)
        spans = check_spans(extra_keys)
        with self._lock:
            self._now = self._clock()
            return self._matcher.stored_after(req, ns, spans, position, limit)

    def acquire(self, tokens: Any, ns: Namespace, extra_keys: Sequence[ExtraKeySpan] = (),
                session_id: str | None = None) -> Hit:
        """Lookup + promote lower-tier blocks into RAM + reference the blocks."""
        req = to_request_tokens(tokens)
        check_ns(ns, self.config.block_size)
        spans = check_spans(extra_keys)
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            self._expire_lru()
            raw = self._matcher.match(req, ns, spans)
            sources = [entry_tier(e) for e in raw.entries]
            held, num = self._take(raw.entries, raw.num_tokens, ns, req.n)
            sources = sources[: len(held)]
            miss = raw.miss
            if num < raw.num_tokens:
                miss = MissInfo(position=raw.matched_tokens, restorable=num, num_tokens=req.n,
                                cause="promotion_failed")
            by_tier: Counter[str] = Counter()
            for b, tier in zip(held, sources, strict=True):
                by_tier[tier] += min(b.end, num) - b.start
            c = self._c
            c.lookups += 1
            c.hit_tokens += num
            c.miss_tokens += req.n - num
            c.hit_tokens_by_tier.update(by_tier)
            if miss is not None:
                c.misses_by_cause[miss.cause] += 1
            if self.observers:
                self._notify("acquired", req, ns, spans, num, miss)
            return Hit(held, num, req.n, dict(by_tier), sources, miss)

    def _take(self, entries: list[Entry], num_tokens: int, ns: Namespace, n: int
              ) -> tuple[list[Block], int]:
        """Reference RAM entries, then promote lower ones in order; on a failed
        promotion cut the hit at the last restorable position before it. On any
        exception every reference taken here is given back before it propagates
        (nothing stays pinned)."""
        now = self._now
        taken: list[Block] = []  # every reference this call holds, in order
        try:
            for e in entries:
                if isinstance(e, Block):
                    self.pool.ref(e, now)
                    taken.append(e)
                    e.hits += 1
            held: list[Block] = []
            cut = len(entries)
            fetched: dict[int, Any] = {}
            for i, e in enumerate(entries):
                if isinstance(e, Block):
                    held.append(e)
                    continue
                if i not in fetched and getattr(e.source, "get_many", None) is not None:
                    fetched = self._fetch_run(entries, i, ns)
                block = self._promote(e, ns, fetched.pop(i, _UNFETCHED))
                if block is None:
                    cut = i
                    break
                taken.append(block)
                held.append(block)
        except BaseException:
            for b in reversed(taken):
                self.pool.unref(b)
            raise
        if cut == len(entries):
            return held, num_tokens
        for e in entries[cut + 1 :]:
            if isinstance(e, Block):
                self.pool.unref(e)
        # the last restorable position inside what we hold
        num = 0
        for b in reversed(held):
            if b.end <= n - 1 and b.restorable_at_end():
                num = b.end
                break
        keep = [b for b in held if b.start < num]
        self.pool.release_chain(held[len(keep) :])
        return keep, num

    def _fetch_run(self, entries: list[Entry], i: int, ns: Namespace) -> dict[int, Any]:
        """Read the run of entries from ``i`` on that live in the same remote tier with
        one ``get_many`` (one round trip), after reserving RAM for all of them; the run
        ends at another tier, at ``PROMOTE_BATCH_BYTES`` or where RAM cannot hold more.
        Returns ``{index: (payload, sessions) | None | _FAILED}``."""
        src = entries[i].source  # type: ignore[union-attr]
        get_many = getattr(src, "get_many", None)
        run: list[int] = []
        hashes: list[BlockHash] = []
        total = 0
        for j in range(i, len(entries)):
            e = entries[j]
            if not isinstance(e, LowerEntry) or e.source is not src:
                break
            if run and total + e.meta.nbytes > PROMOTE_BATCH_BYTES:
                break
            if self.pool.get(e.meta.block_hash) is not None or not self.pool.can_allocate(
                    total + e.meta.nbytes):
                break
            run.append(j)
            hashes.append(e.meta.block_hash)
            total += e.meta.nbytes
        if get_many is None or not run or not self.pool.make_room(total):  # RAM first
            return {}
        try:
            got = get_many(hashes, ns=ns)
        except Exception as e:  # a tier breaking its contract is a tier failure too
            self._on_tier_error(src, e)
            return dict.fromkeys(run, _FAILED)
        if not isinstance(got, list) or len(got) != len(run):
            self._on_tier_error(src, TierError("get_many returned a wrong number of blocks"))
            return dict.fromkeys(run, _FAILED)
        return dict(zip(run, got, strict=True))

    def _promote(self, entry: LowerEntry, ns: Namespace, fetched: Any = None) -> Block | None:
        """Promote one lower-tier block into RAM. ``fetched``: what ``_fetch_run`` read
        for it (``(payload, sessions)``, None: absent, ``_FAILED``), or ``_UNFETCHED``."""
        meta = entry.meta
        c = self._c
        if fetched is _FAILED:
            return None
        existing = self.pool.get(meta.block_hash)
        if existing is not None:
            if existing.ref_cnt:
                c.promotion_failures += 1
                return None
            self._remove_expired(existing)
        if not self.pool.make_room(meta.nbytes):  # reserve RAM before reading
            c.promotion_failures += 1
            return None
        source: Tier = entry.source  # type: ignore[assignment]
        # the sessions that wrote it, so delete_session also reaches this copy: a block
        # whose sessions cannot be read is not promoted (it would escape them)
        try:
            if fetched is _UNFETCHED:
                data = source.get(meta.block_hash, ns=ns)
                sessions = source.sessions_of(meta.block_hash, ns=ns) if data is not None else []
            elif fetched is None:
                data, sessions = None, []
            else:
                data, sessions = fetched
        except Exception as e:
            self._on_tier_error(source, e)
            return None
        if data is None:
            c.promotion_failures += 1
            return None
        try:
            arrays, payload_meta = self._dec(data)
            if payload_meta.get("block_hash", meta.block_hash.hex()) != meta.block_hash.hex():
                raise TierError("the stored payload belongs to another block")
            payload = self.adapter.from_numpy(arrays, payload_meta)
            nbytes = self.adapter.nbytes(payload)
        except Exception as e:  # corrupt or foreign bytes: a counted miss
            self._on_tier_error(entry.source, e)
            return None
        if not self.pool.can_allocate(nbytes):
            c.promotion_failures += 1
            return None
        flags = (TRUNCATABLE if meta.truncatable else 0) | (SNAPSHOT if meta.snapshot else 0)
        block = self.pool.allocate(
            block_hash=meta.block_hash, parent_hash=meta.parent_hash,
            tokens=np.asarray(meta.token_ids, dtype="<u4").tobytes(), start=meta.start,
            extra_keys=tuple(meta.extra_keys), flags=flags, ns=ns, payload=payload,
            nbytes=nbytes, now=self._now,
        )
        block.hits = 1
        self.levels.on_new_block(block)
        mark_in_tier(block, self.lower.index(source), len(self.lower))
        for sid in sessions:
            block.add_session(str(sid))
        self.gone.forget(meta.block_hash)
        c.promotions += 1
        return block

    def release(self, hit: Hit) -> None:
        """Unreference a hit's blocks (tail-first); they become evictable. Idempotent."""
        if not isinstance(hit, Hit):
            raise ValueError(f"release expects a Hit, got {type(hit).__name__}")
        with self._lock:
            if hit.released:
                return
            hit.released = True
            self.pool.release_chain(hit._held)

    # ---- store ---------------------------------------------------------------
    def store(
        self,
        ns: Namespace,
        tokens: Any,
        num_tokens: int,
        payload_for: Callable[[int, int, bool], Any],
        *,
        extra_keys: Sequence[ExtraKeySpan] = (),
        session_id: str | None = None,
        agent_id: str | None = None,
        truncatable: bool = True,
        snapshot_at_end: bool = True,
        include_partial: bool = True,
        save_point: str = "mid_prefill",
        cursor: ChainCursor | None = None,
    ) -> int:
        """Store the blocks of ``tokens[:num_tokens]`` that are not stored yet; returns
        the number of blocks created. ``payload_for(start, end, snapshot)`` is called
        only for blocks that must be created (or upgraded with a snapshot).

        ``cursor``: resume the walk at ``cursor.start`` (a block boundary whose parent
        hash it knows) instead of re-hashing the chain from the root, and move it to
        the end of the last full block stored or found; only ``tokens[cursor.start:
        num_tokens]`` is read, so repeated saves of a growing sequence cost only their
        new blocks.

        ``session_id`` / ``agent_id``: recorded on every block stored or found (the
        agent, a client's subagent id, in RAM only)."""
        check_ns(ns, self.config.block_size)
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
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            created = self._store(ns, req, num_tokens - offset, payload_for, spans,
                                  session_id, truncatable, snapshot_at_end, include_partial,
                                  offset, cursor, agent_id)
            self._c.saves[save_point] += 1
            self._c.blocks_saved[save_point] += created
            return created

    def _store(self, ns: Namespace, req: RequestTokens, num_tokens: int,
               payload_for: Callable[[int, int, bool], Any], spans: tuple[ExtraKeySpan, ...],
               session_id: str | None, truncatable: bool, snapshot_at_end: bool,
               include_partial: bool, offset: int = 0, cursor: ChainCursor | None = None,
               agent_id: str | None = None) -> int:
        """``req`` holds the tokens from ``offset`` (a cursor's start) on; ``num_tokens``
        counts from there too; block positions below are absolute."""
        pool, c, bs = self.pool, self._c, ns.block_size
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
                if existing is not None and existing.ref_cnt == 0 and self._is_expired(existing):
                    self._remove_expired(existing)
                    existing = None
                if existing is None and truncatable and end - start < bs:
                    # a partial tail already covered by a longer stored sibling adds nothing
                    existing = self._covering_sibling(parent, want, extra, ns)
                if existing is not None:
                    pool.ref(existing, self._now)
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
                        break
                    block = pool.allocate(
                        block_hash=h, parent_hash=parent, tokens=want, start=start,
                        extra_keys=extra, flags=flags, ns=ns, payload=payload, nbytes=nbytes,
                        now=self._now,
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
                    self._writer.offer(block)  # to the write-through tiers, if any
        finally:
            pool.release_chain(held)
        return len(created)

    def _covering_sibling(self, parent: BlockHash, want: bytes, extra: tuple[bytes, ...],
                          ns: Namespace) -> Block | None:
        """A stored truncatable sibling whose tokens extend ``want`` (same extra keys)."""
        for sib in self.pool.children(parent):
            if (sib.truncatable and sib.ns == ns and sib.extra_keys == extra
                    and len(sib.tokens) > len(want) and sib.tokens.startswith(want)
                    and not self._is_expired(sib)):
                return sib
        return None

    def _drop_superseded(self, block: Block) -> None:
        """Remove unreferenced partial siblings whose tokens are a prefix of ``block``'s
        (e.g. the end-of-prefill tail once the end-of-generation block exists): the
        longer block restores every position they could. Their sessions move over."""
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
                    self._c.superseded += 1
                    if where and h is not None:
                        self._discard_lower(h, sib.ns, where)

    def _discard_lower(self, block_hash: BlockHash, ns: Namespace, where: list[int]) -> None:
        for tier in (self.lower[i] for i in where):
            try:
                tier.discard((block_hash,), ns=ns)
            except Exception as e:
                self._on_tier_error(tier, e)

    def _touch_existing(self, block: Block, session_id: str | None, snap: bool, start: int,
                        end: int, payload_for: Callable[[int, int, bool], Any]) -> bool:
        """A store found ``block`` already there: record the session (in RAM and in the
        lower tiers that hold it); upgrade it with a snapshot payload if one is wanted.
        True if the payload was upgraded."""
        if session_id is not None and block.add_session(session_id):
            for tier in (self.lower[i] for i in in_tiers(block, len(self.lower))):
                try:
                    tier.add_sessions(block.meta().block_hash, (session_id,), ns=block.ns)
                except Exception as e:
                    self._on_tier_error(tier, e)
        if snap and not block.restorable_at_end():
            payload = payload_for(start, end, True)
            nbytes = self.adapter.nbytes(payload)
            flags = (block.flags | SNAPSHOT) & ~(PERSISTED | ALL_TIERS)
            if self.pool.replace_payload(block, payload, nbytes, flags):
                self._c.upgrades += 1
                self.levels.resized(block)
                return True
            self._c.drops += 1
        return False

    # ---- levels: protection (cache breakpoints, prompt_cache_key), active sessions --
    def protect(self, tokens: Any, ns: Namespace, num_tokens: int, ttl_s: float, *,
                key: str | None = None, persist: bool = True,
                extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        """Keep the RAM blocks holding ``tokens[:num_tokens]`` from eviction for
        ``ttl_s`` seconds (``cache_levels``): a cache breakpoint (``key`` None: renewed
        when the same prefix is protected again, whatever follows it; the block that
        holds the breakpoint is protected too, as a truncatable state restores inside
        it) or the latest chain of ``key`` (it
        replaces the key's previous chain). With ``persist`` the blocks are put into
        the lower tiers at once. Protected blocks take at most ``protect_share`` of
        the RAM budget (oldest protections give way). Returns the blocks protected."""
        req = to_request_tokens(tokens)
        check_ns(ns, self.config.block_size)
        spans = check_spans(extra_keys)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be a non-negative integer, got {num_tokens!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise ValueError(f"ttl_s must be a positive number, got {ttl_s!r}")
        if key is not None and (not isinstance(key, str) or not key):
            raise ValueError(f"key must be a non-empty string or None, got {key!r}")
        end = min(num_tokens, req.n)
        full = self._full_hashes(req, ns, spans, end)
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            chain = self._ram_chain(req, ns, spans, end, full)
            if not chain:
                return 0
            if key is not None:
                claim: tuple[Any, ...] = ("key", ns.tenant, ns.key, key)
            else:  # the prefix itself: its last whole block and the tokens after it
                whole = min(end // ns.block_size, len(chain))
                anchor = chain[whole - 1] if whole else ns.root
                claim = ("breakpoint", ns.tenant, ns.key, anchor,
                         req.slice_bytes(whole * ns.block_size, end))
            return self.levels.protect(claim, chain, float(ttl_s), self._now, persist=persist)

    def mark_active(self, tokens: Any, ns: Namespace, session: str, *,
                    extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        """The RAM chain holding ``tokens`` is the latest chain of ``session`` (any
        key the caller chooses: the server uses tenant, session and agent): evicted
        only after idle blocks until the session is quiet for ``active_session_s``.
        Returns the number of blocks in the chain."""
        req = to_request_tokens(tokens)
        check_ns(ns, self.config.block_size)
        spans = check_spans(extra_keys)
        if not isinstance(session, str) or not session:
            raise ValueError(f"session must be a non-empty string, got {session!r}")
        full = self._full_hashes(req, ns, spans, req.n)
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            chain = self._ram_chain(req, ns, spans, req.n, full)
            return self.levels.mark_active(("session", ns.tenant, ns.key, session), chain,
                                           self._now)

    def levels_snapshot(self) -> dict[str, Any]:
        """Protection and session-level gauges and counters (``cache_levels``)."""
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            return self.levels.snapshot()

    @staticmethod
    def _full_hashes(req: RequestTokens, ns: Namespace, spans: tuple[ExtraKeySpan, ...],
                     end: int) -> list[BlockHash]:
        """The chained hashes of the whole blocks of ``req`` that start before ``end``
        (no lock needed: pure hashing, done before the cache lock is taken)."""
        bs, parent, out = ns.block_size, ns.root, []
        for start in range(0, min(end, req.n - req.n % bs), bs):
            extra = extra_keys_for(spans, start, start + bs) if spans else ()
            parent = _matcher.block_hash(parent, req.arr[start:start + bs], extra)
            out.append(parent)
        return out

    def _ram_chain(self, req: RequestTokens, ns: Namespace, spans: tuple[ExtraKeySpan, ...],
                   end: int, full: list[BlockHash]) -> list[BlockHash]:
        """The hashes of the RAM blocks that hold ``req`` up to ``end`` (blocks starting
        before ``end``), head first; stops at the first position RAM does not hold.
        ``full``: ``_full_hashes``. Where no whole block matches, the stored child
        holding the most of the request's tokens there (a partial tail, or a longer
        truncatable block)."""
        bs, parent, out = ns.block_size, ns.root, []
        for i, start in enumerate(range(0, end, bs)):
            stop = min(start + bs, req.n)
            if i < len(full):
                h = full[i]
                block = self.pool.get(h)
                if block is not None and block.ns == ns and block.start == start \
                        and block.tokens == req.slice_bytes(start, stop):
                    out.append(h)
                    parent = h
                    continue
            want = req.slice_bytes(start, min(stop, end))
            best: Block | None = None
            for sib in self.pool.children(parent):
                if sib.ns != ns or sib.start != start or sib.block_hash is None:
                    continue
                if not (sib.tokens.startswith(want)
                        or req.slice_bytes(start, start + sib.num_tokens) == sib.tokens):
                    continue
                if best is None or sib.num_tokens > best.num_tokens:
                    best = sib
            if best is not None and best.block_hash is not None:
                out.append(best.block_hash)
            break
        return out

    def _persist_first(self, blocks: list[Block]) -> None:
        """Protected blocks go to every lower tier at once, ahead of the write-through
        backlog (``LowerWriter.offer_first``), not when they are evicted."""
        self._writer.offer_first(blocks)

    # ---- eviction, deletion ----------------------------------------------------
    def evict(self, num_blocks: int | None = None) -> int:
        """Evict (demote) up to ``num_blocks`` LRU unreferenced blocks (None: all)."""
        if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0):
            raise ValueError(f"num_blocks must be a non-negative integer or None, got {num_blocks!r}")
        with self._lock:
            self._now = self._clock()
            self.levels.tick(self._now)
            done = 0
            while num_blocks is None or done < num_blocks:
                if self.pool.evict() is None:
                    break
                done += 1
            return done

    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        """Remove the session from the blocks of ``tenant`` (None: of every tenant) in
        every tier; blocks left with no session are deleted. Returns the number of
        blocks deleted (all tiers)."""
        if not isinstance(session_id, str) or not session_id:
            raise ValueError(f"session_id must be a non-empty string, got {session_id!r}")
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant must be a non-empty string or None, got {tenant!r}")
        with self._lock:
            count = 0
            for block in self.pool.blocks():
                if session_id in block.sessions and (tenant is None or block.ns.tenant == tenant):
                    block.sessions = tuple(s for s in block.sessions if s != session_id)
                    if not block.sessions and self.pool.remove(block):
                        count += 1
            for tier in self.lower:
                try:
                    count += int(tier.delete_session(session_id, tenant))
                except Exception as e:
                    self._on_tier_error(tier, e)
            return count

    def delete(self, tenant: str | None = None) -> int:
        """Delete every block of ``tenant`` (None: every block) in every tier."""
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant must be a non-empty string or None, got {tenant!r}")
        with self._lock:
            count = 0
            for block in self.pool.blocks():
                if (tenant is None or block.ns.tenant == tenant) and self.pool.remove(block):
                    count += 1
            self.levels.drop(lambda key: tenant is None or key[1] == tenant)
            for tier in self.lower:
                try:
                    count += int(tier.delete_tenant(tenant))
                except Exception as e:
                    self._on_tier_error(tier, e)
            return count

    # ---- quarantine (``engine/shadow.py``: a block that failed verification) ------
    def quarantine_chain(self, block_hash: BlockHash, ns: Namespace) -> int:
        """Remove the block and every block chained after it (its descendants) from
        RAM and every lower tier, so nothing restores from it again. Returns the
        number of distinct blocks removed."""
        with self._lock:
            doomed: list[BlockHash] = []
            seen: set[BlockHash] = set()
            todo = [block_hash]
            while todo:
                h = todo.pop()
                if h in seen:
                    continue
                seen.add(h)
                doomed.append(h)
                todo.extend(b.block_hash for b in self.pool.children(h)
                            if b.block_hash is not None and b.ns == ns)
                for tier in self.lower:
                    try:
                        todo.extend(m.block_hash for m in tier.children(h, ns=ns))
                    except Exception as e:
                        self._on_tier_error(tier, e)
            present: set[BlockHash] = set()
            for h in doomed:
                block = self.pool.get(h)
                if block is not None and self.pool.remove(block):
                    present.add(h)
            for tier in self.lower:
                try:
                    present.update(m.block_hash for m in tier.get_metas(doomed, ns=ns)
                                   if m is not None)
                    tier.discard(doomed, ns=ns)
                except Exception as e:
                    self._on_tier_error(tier, e)
            logger.warning("quarantined the chain from block %s: %d blocks",
                           block_hash.hex()[:16], len(present))
            return len(present)

    # ---- RAM budget (``autotune.py`` moves it within its bounds) -----------------
    def resize_ram(self, budget_bytes: int) -> int:
        """Set the RAM budget; shrinking evicts (demotes) LRU blocks. Blocks in use are
        never evicted, so the budget set may stay above ``budget_bytes`` by what they
        hold. Returns the budget in force."""
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative integer, got {budget_bytes!r}")
        with self._lock:
            self._now = self._clock()
            pool = self.pool
            while pool.used_bytes > budget_bytes and pool.evict() is not None:
                pass
            pool.budget_bytes = max(budget_bytes, pool.used_bytes)
            return pool.budget_bytes

    # ---- sessions (listing; ``sessions.py`` reaps idle ones) ---------------------
    def sessions(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Every session with blocks, per tier: ``{"tenant", "session_id", "tiers":
        {"ram": {"blocks", "bytes"}, "<tier>": {"blocks", "bytes", "last_use"}}}`` (a
        lower tier that can list its sessions reports the wall-clock time its blocks
        were last used), sorted by tenant and session."""
        out: dict[tuple[str, str], dict[str, Any]] = {}

        def row(t: str, sid: str) -> dict[str, Any]:
            return out.setdefault((t, sid), {"tenant": t, "session_id": sid, "tiers": {}})

        with self._lock:
            for b in self.pool.blocks():
                if b.block_hash is None or (tenant is not None and b.ns.tenant != tenant):
                    continue
                for sid in b.sessions:
                    ram = row(b.ns.tenant, sid)["tiers"].setdefault("ram", {"blocks": 0, "bytes": 0})
                    ram["blocks"] += 1
                    ram["bytes"] += b.nbytes
            for tier in self.lower:
                listing = getattr(tier, "sessions", None)
                if listing is None:
                    continue
                try:
                    for t, sid, n, nbytes, last in listing(tenant):
                        row(t, sid)["tiers"][tier.name] = {"blocks": n, "bytes": nbytes,
                                                           "last_use": last}
                except Exception as e:
                    self._on_tier_error(tier, e)
        return [out[k] for k in sorted(out)]

    # ---- export / import (``packs.py`` builds portable packs on these three) -----
    def ram_metas(self, ns: Namespace, session_id: str | None = None) -> list[BlockMeta]:
        """The metadata of the RAM blocks of ``ns`` (of one session's, if given)."""
        with self._lock:
            return [b.meta() for b in self.pool.blocks()
                    if b.block_hash is not None and b.ns == ns
                    and (session_id is None or session_id in b.sessions)]

    def read_block(self, block_hash: BlockHash, ns: Namespace
                   ) -> tuple[BlockMeta, bytes, tuple[str, ...]] | None:
        """A stored block as ``(meta, payload bytes in the codec, sessions)``: from RAM
        (encoded here) or else the first lower tier that has it (bytes as stored,
        checksum-verified by the tier). None if no tier has it. The RAM LRU order
        does not change (a lower tier may count the read as a hit)."""
        with self._lock:
            block = self.pool.get(block_hash)
            ram = None
            if block is not None and block.ns == ns:
                ram = (block.meta(), self._source(block), tuple(block.sessions))
        if ram is not None:  # payloads are immutable: encode without holding the lock
            return ram[0], ram[1].encode(), ram[2]
        with self._lock:
            for tier in self.lower:
                try:
                    found = tier.get_meta(block_hash, ns=ns)
                    data = tier.get(block_hash, ns=ns) if found is not None else None
                    if found is None or data is None:
                        continue
                    return found, data, tuple(tier.sessions_of(block_hash, ns=ns))
                except Exception as e:
                    self._on_tier_error(tier, e)
            return None

    def import_block(self, meta: BlockMeta, data: bytes, sessions: Sequence[str],
                     ns: Namespace) -> bool:
        """Add one verified block (``packs.read_pack`` checked its chain hash, digest and
        namespace): into RAM when it fits (handed to the write-through tiers like a
        stored block), else straight into every lower tier (with back-pressure). A
        block already in RAM only gains the sessions. True if the block was added."""
        with self._lock:
            self._now = self._clock()
            existing = self.pool.get(meta.block_hash)
            if existing is not None:
                for sid in sessions:
                    existing.add_session(sid)
                return False
            arrays, payload_meta = self._dec(data)
            if payload_meta.get("block_hash") != meta.block_hash.hex():
                raise ValueError("the payload belongs to another block")
            payload = self.adapter.from_numpy(arrays, payload_meta)
            nbytes = self.adapter.nbytes(payload)
            if self.pool.can_allocate(nbytes):
                flags = (TRUNCATABLE if meta.truncatable else 0) | (SNAPSHOT if meta.snapshot else 0)
                block = self.pool.allocate(
                    block_hash=meta.block_hash, parent_hash=meta.parent_hash,
                    tokens=np.asarray(meta.token_ids, dtype="<u4").tobytes(), start=meta.start,
                    extra_keys=tuple(meta.extra_keys), flags=flags, ns=ns, payload=payload,
                    nbytes=nbytes, now=self._now)
                for sid in sessions:
                    block.add_session(sid)
                self.levels.on_new_block(block)
                self.gone.forget(meta.block_hash)
                if self.lower:
                    self._writer.offer(block)
                self.pool.release_chain([block])
                return True
            stored = False
            for tier in self.lower:
                try:
                    stored = bool(tier.put(meta, data, tuple(sessions), timeout=None)) or stored
                except Exception as e:
                    self._on_tier_error(tier, e)
            if not stored:
                self._c.drops += 1
            return stored

    # ---- stats -----------------------------------------------------------------
    def stats(self) -> CacheStats:
        with self._lock:
            tiers: dict[str, dict[str, Any]] = {}
            for tier in self.lower:
                try:
                    tiers[tier.name] = dict(tier.stats())
                except Exception as e:  # stats must never fail the admin endpoint
                    tiers[tier.name] = {"error": str(e)}
            pool = self.pool
            return snapshot(
                self._c, ram_bytes=pool.used_bytes, ram_budget_bytes=pool.budget_bytes,
                ram_blocks=pool.num_blocks, ram_used_blocks=pool.num_used_blocks,
                ram_free_blocks=pool.num_free_blocks, unwritten_blocks=self._writer.num_unwritten(),
                tiers=tiers,
            )

    def check(self) -> None:
        """Verify the pool's invariants (tests, admin); raises InvariantError."""
        with self._lock:
            self.pool.check()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every block handed to the lower tiers is written: the blocks
        waiting for room in a tier's queue, then the tiers' own queues. False if
        that did not happen within ``timeout`` seconds (None: no limit)."""
        with self._lock:
            return self._writer.flush(timeout)

    def persist(self, timeout: float | None = -1.0) -> int:
        """Write every RAM block the lower tiers lack into them (a clean shutdown keeps
        the whole cache): with back-pressure, then a flush, within ``timeout`` seconds
        (default ``config.persist_timeout_s``; None: no limit). Logs progress, and
        counts and names the blocks that did not arrive (``stats().persist_failures``,
        ``last_persist``). Returns the number of blocks written."""
        if timeout is not None and timeout < 0:
            timeout = self.config.persist_timeout_s
        with self._lock:
            if not self.lower:
                return 0
            blocks = [b for b in self.pool.blocks() if b.block_hash is not None and not b.persisted]
            report = self._writer.persist(blocks, timeout)
            self._c.persisted_on_close += report.written
            self._c.persist_failures += report.failed
            return report.written

    @property
    def last_persist(self) -> PersistReport | None:
        return self._writer.last_persist

    def close(self, persist: bool = True, timeout: float | None = -1.0) -> None:
        """Stop the write-through feeder, persist the RAM blocks (``persist``; see
        ``persist`` for ``timeout``), then close the lower tiers (flushing them)."""
        self._writer.stop()
        if persist:
            self.persist(timeout)
        with self._lock:
            for tier in self.lower:
                try:
                    tier.close()
                except Exception as e:
                    logger.warning("closing tier %s failed: %s", getattr(tier, "name", tier), e)
