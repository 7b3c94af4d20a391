"""Acquire: reference the RAM blocks of a request's longest restorable prefix and
promote the lower-tier ones into RAM (a remote tier's run of blocks read in one
``get_many`` after reserving RAM for all of them), cutting the hit at the last
restorable position before a failed promotion. Nothing stays pinned on an error.
A ``plan`` (the engine's restore-or-recompute planner) may cut the match first: the
blocks past its cut are neither promoted nor referenced (they are prefilled again).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..blocks.pool import Block, BlockPool
from ..blocks.tokens import RequestTokens
from ..errors import TierError, UnsupportedFormatError
from ..hashing import BlockHash
from ..meta import ExtraKeySpan, Namespace
from ..stats import Counters
from ..tiers.base import Tier
from .entries import Entry, LowerEntry, RawMatch, entry_tier
from .levels import Levels
from .lower import mark_in_tier
from .matcher import Matcher
from .miss import PROMOTION_FAILED, CacheMiss, GoneMemory
from .payloads import Payloads, allocate_stored
from .policy import Expiry, Faults, notify
from .types import Hit, Match, TierRead

# A chain's blocks in one remote tier are read in batches of at most this many bytes
# (RAM is reserved for a whole batch before it is read).
PROMOTE_BATCH_BYTES = 64 * 1024 * 1024
_UNFETCHED = object()
_FAILED = object()


class _Loaded(NamedTuple):
    """A block of a fetched run, already made into a payload (``Payloads.load_many``):
    ``(payload, nbytes)``, None (another block's bytes) or the exception it raised."""

    result: tuple[Any, int] | Exception | None
    sessions: Any


@dataclass(eq=False)
class Lookup:
    """``acquire``: match, reference, promote (see the module docstring)."""

    pool: BlockPool
    lower: Sequence[Tier]
    matcher: Matcher
    levels: Levels
    expiry: Expiry
    payloads: Payloads
    gone: GoneMemory
    faults: Faults
    counters: Counters
    observers: list[Any]

    def acquire(self, req: RequestTokens, ns: Namespace, spans: tuple[ExtraKeySpan, ...],
                now: float, plan: Callable[[Match], int] | None = None) -> Hit:
        self.expiry.sweep(now)
        raw = self.matcher.match(req, ns, spans, now)
        if plan is not None and any(isinstance(e, LowerEntry) for e in raw.entries):
            raw = _cut(raw, plan(Match(raw.entries, raw.num_tokens, raw.matched_tokens,
                                       raw.miss)))
        sources = [entry_tier(e) for e in raw.entries]
        reads: list[TierRead] = []
        held, num = self._take(raw.entries, raw.num_tokens, ns, req.n, now, reads)
        sources = sources[: len(held)]
        miss = raw.miss
        if num < raw.num_tokens:
            miss = CacheMiss(PROMOTION_FAILED, position=raw.matched_tokens,
                             restorable=num, num_tokens=req.n)
        by_tier: Counter[str] = Counter()
        for b, tier in zip(held, sources, strict=True):
            by_tier[tier] += min(b.end, num) - b.start
        c = self.counters
        c.lookups += 1
        c.hit_tokens += num
        c.miss_tokens += req.n - num
        c.hit_tokens_by_tier.update(by_tier)
        if miss is not None:
            c.misses_by_cause[miss.cause] += 1
        if self.observers:
            notify(self.observers, "acquired", req, ns, spans, num, miss)
        return Hit(held, num, req.n, dict(by_tier), sources, miss, reads)

    def _take(self, entries: list[Entry], num_tokens: int, ns: Namespace, n: int, now: float,
              reads: list[TierRead]) -> tuple[list[Block], int]:
        """Reference RAM entries, then promote lower ones in order; on a failed
        promotion cut the hit at the last restorable position before it. On any
        exception every reference taken here is given back before it propagates
        (nothing stays pinned)."""
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
                    fetched = self._fetch_run(entries, i, ns, reads)
                block = self._promote(e, ns, fetched.pop(i, _UNFETCHED), now)
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

    def _fetch_run(self, entries: list[Entry], i: int, ns: Namespace,
                   reads: list[TierRead]) -> dict[int, Any]:
        """Read the run of entries from ``i`` on that live in the same remote tier with
        one ``get_many`` (one round trip), after reserving RAM for all of them; the run
        ends at another tier, at ``PROMOTE_BATCH_BYTES`` or where RAM cannot hold more.
        Returns ``{index: _Loaded | None | _FAILED}`` (``get_many`` may return a
        block's own exception in its place: that block fails as its ``get`` would).
        A successful read is timed into ``reads`` (bytes in, payloads made)."""
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
                    total + e.meta.nbytes, len(run) + 1):
                break
            run.append(j)
            hashes.append(e.meta.block_hash)
            total += e.meta.nbytes
        if get_many is None or not run or not self.pool.make_room(total, len(run)):  # RAM first
            return {}
        t = time.perf_counter()
        try:
            got = get_many(hashes, ns=ns)
        except Exception as e:  # a tier breaking its contract is a tier failure too
            self.faults.tier_error(src, e)
            return dict.fromkeys(run, _FAILED)
        if not isinstance(got, list) or len(got) != len(run):
            self.faults.tier_error(src, TierError("get_many returned a wrong number of blocks"))
            return dict.fromkeys(run, _FAILED)
        # the run's payloads made at once (the adapter may build one array for a run)
        present = [k for k, g in enumerate(got) if isinstance(g, tuple) and len(g) == 2
                   and isinstance(g[0], (bytes, bytearray, memoryview))]
        # a view of a mapped segment is decoded in place where the adapter copies it
        view_ok = getattr(self.payloads.adapter, "copies_buffers", False)
        loaded = self.payloads.load_many(
            [(got[k][0] if view_ok else bytes(got[k][0]), hashes[k]) for k in present])
        reads.append(TierRead(src.name, len(run), total, time.perf_counter() - t))
        out: dict[int, Any] = dict(zip(run, got, strict=True))
        for k, res in zip(present, loaded, strict=True):
            out[run[k]] = _Loaded(res, got[k][1])
        for k, g in enumerate(got):  # a block's own error (a local tier's run): its miss
            if isinstance(g, Exception):
                out[run[k]] = _Loaded(g, [])
        return out

    def _promote(self, entry: LowerEntry, ns: Namespace, fetched: Any, now: float
                 ) -> Block | None:
        """Promote one lower-tier block into RAM. ``fetched``: what ``_fetch_run`` read
        for it (``(payload, sessions)``, None: absent, ``_FAILED``), or ``_UNFETCHED``."""
        meta = entry.meta
        c = self.counters
        if fetched is _FAILED:
            return None
        existing = self.pool.get(meta.block_hash)
        if existing is not None:
            if existing.ref_cnt:
                c.promotion_failures += 1
                return None
            self.expiry.remove(existing)
        if not self.pool.make_room(meta.nbytes):  # reserve RAM before reading
            c.promotion_failures += 1
            return None
        source: Tier = entry.source  # type: ignore[assignment]
        # the sessions that wrote it, so delete_session also reaches this copy: a block
        # whose sessions cannot be read is not promoted (it would escape them)
        pre: _Loaded | None = fetched if isinstance(fetched, _Loaded) else None
        data: bytes | None
        try:
            if pre is not None:
                data, sessions = b"", pre.sessions
            elif fetched is _UNFETCHED:
                data = source.get(meta.block_hash, ns=ns)
                sessions = source.sessions_of(meta.block_hash, ns=ns) if data is not None else []
            elif fetched is None:
                data, sessions = None, []
            else:
                data, sessions = fetched
        except Exception as e:
            self.faults.tier_error(source, e)
            return None
        if data is None:
            c.promotion_failures += 1
            return None
        try:
            if pre is None:
                loaded = self.payloads.load(data, meta.block_hash)
            elif isinstance(pre.result, Exception):
                raise pre.result
            else:
                loaded = pre.result
            if loaded is None:
                raise TierError("the stored payload belongs to another block")
        except UnsupportedFormatError as e:  # an older cache's block: a counted miss
            self.faults.old_format(source, e)
            return None
        except Exception as e:  # corrupt or foreign bytes: a counted miss
            self.faults.tier_error(source, e)
            return None
        payload, nbytes = loaded
        if not self.pool.can_allocate(nbytes):
            c.promotion_failures += 1
            return None
        block = allocate_stored(self.pool, meta, ns, payload, nbytes, now)
        block.hits = 1
        self.levels.on_new_block(block)
        mark_in_tier(block, self.lower.index(source), len(self.lower))
        for sid in sessions:
            block.add_session(str(sid))
        self.gone.forget(meta.block_hash)
        c.promotions += 1
        return block


def _cut(raw: RawMatch, keep: int) -> RawMatch:
    """The match up to ``keep`` tokens (an entry's end, or 0)."""
    if keep >= raw.num_tokens:
        return raw
    k = sum(1 for e in raw.entries if e.end <= keep)
    if keep < 0 or (k == 0 and keep != 0) or (k and raw.entries[k - 1].end != keep):
        raise ValueError(f"a plan may cut a match only at a block's end, not at {keep}")
    return RawMatch(raw.entries[:k], keep, raw.matched_tokens, raw.miss)
