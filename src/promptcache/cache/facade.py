"""PromptCache: the one policy module, as one facade over its parts (listed in the package
docstring). It owns the one re-entrant lock and the clock: each public method checks its
arguments, locks, reads the clock once and hands ``now`` to the part doing the work.
Nothing a lower tier does fails a call (``policy``); bad input raises ``ValueError``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..blocks.pool import BlockPool
from ..config import CacheConfig
from ..hashing import BlockHash
from ..meta import BlockMeta, ExtraKeySpan, Namespace
from ..stats import CacheStats, Counters, snapshot
from ..tiers.base import Tier
from .branches import Branches
from .levels import Levels
from .lookup import Lookup
from .lower import DEMOTE_TIMEOUT_S, MAX_TIERS, LowerWriter
from .matcher import Matcher
from .miss import NOT_STORED, GoneMemory
from .ops import Ops, check_count
from .payloads import Payloads
from .persist import PersistReport
from .policy import Expiry, Faults, close_tiers, tier_stats
from .protect import Protect, check_protect, full_hashes
from .store import Store, check_store, first_unstored
from .types import ChainCursor, DecodeFn, EncodeFn, Hit, Match, PayloadAdapter, check_request


class PromptCache:
    """Multi-tier prompt cache: RAM block pool + lower tiers (see the module docstring)."""

    def __init__(self, config: CacheConfig, adapter: PayloadAdapter | None = None,
                 lower: Sequence[Tier] = (), *, write_through: bool = False,
                 encode: EncodeFn | None = None, decode: DecodeFn | None = None,
                 on_evict: Callable[[BlockMeta, Any], None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 demote_timeout_s: float = DEMOTE_TIMEOUT_S) -> None:
        if not isinstance(config, CacheConfig):
            raise ValueError(f"config must be a CacheConfig, got {type(config).__name__}")
        self.config = config
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
        self._clock = clock
        self._lock = threading.RLock()
        self._c = c = Counters()
        # ops hooks (``advisor.py``): ``evicted(meta)`` for every evicted block,
        # ``acquired(tokens, ns, spans, hit_tokens, miss)`` after every acquire; called
        # under the lock, must be cheap, and may not fail a call (errors are logged)
        self.observers: list[Any] = []
        self.gone = gone = GoneMemory(config.explain_history)
        # every evicted block passes ``Ops.evicted`` once (the demotion hook)
        self.pool = pool = BlockPool(config.resolved_ram_budget(),
                                     on_evict=lambda block: self._ops.evicted(block),
                                     max_blocks=config.max_arrays)
        faults = Faults(c)
        payloads = Payloads(adapter, encode, decode)
        self.adapter = payloads.adapter
        self._writer = writer = LowerWriter(
            self.lower, payloads.source,
            lambda b: b.block_hash is not None and pool.get(b.block_hash) is b,
            self._lock, c, faults.tier_error, write_through=wt_tiers,
            demote_timeout_s=demote_timeout_s)
        # protected blocks go to every lower tier at once, ahead of the write-through
        # backlog (``LowerWriter.offer_first``), not when they are evicted
        self.levels = levels = Levels(pool, share=config.protect_share,
                                      active_s=config.active_session_s,
                                      persist=writer.offer_first)
        expiry = Expiry(config.ttl_seconds, pool, gone, c)
        branches = Branches(pool, self.lower, gone, expired=expiry.expired,
                            on_tier_error=faults.tier_error)
        self._matcher = matcher = Matcher(pool, self.lower, branches, expired=expiry.expired,
                                          on_tier_error=faults.tier_error)
        self._lookup = Lookup(pool, self.lower, matcher, levels, expiry, payloads, gone,
                              faults, c, self.observers)
        self._store = Store(pool, self.lower, writer, levels, expiry, self.adapter, gone,
                            faults, c)
        self._protect = Protect(pool, self.lower, levels)
        self._ops = Ops(pool, self.lower, levels, writer, payloads, gone, faults, c,
                        self.observers, on_evict)
        self._faults = faults
        self._forget_hook: Callable[[str | None, str | None], int] | None = None

    def _tick(self) -> float:
        """The clock's time now, after ending the claims past their time (lock held)."""
        now = self._clock()
        self.levels.tick(now)
        return now

    def lookup(self, tokens: Any, ns: Namespace, extra_keys: Sequence[ExtraKeySpan] = (),
               explain: bool = False) -> Match:
        """The longest restorable cached prefix of ``tokens`` (a pure query: no LRU
        change, no stats). ``explain`` is accepted for symmetry: ``miss`` is always set
        on a short match."""
        req, spans = check_request(tokens, ns, extra_keys, self.config.block_size)
        with self._lock:
            raw = self._matcher.match(req, ns, spans, self._clock())
            return Match(raw.entries, raw.num_tokens, raw.matched_tokens, raw.miss)

    def stored_after(self, tokens: Any, ns: Namespace, position: int, limit: int = 32,
                     extra_keys: Sequence[ExtraKeySpan] = ()) -> list[int]:
        """The stored token ids that follow ``tokens[:position]`` in the stored block
        closest to ``tokens`` there (a pure query, for miss explanations: the cached
        side of a divergence); at most ``limit``, empty when nothing is stored."""
        req, spans = check_request(tokens, ns, extra_keys, self.config.block_size)
        with self._lock:
            return self._matcher.stored_after(req, ns, spans, position, limit, self._clock())

    def acquire(self, tokens: Any, ns: Namespace, extra_keys: Sequence[ExtraKeySpan] = (),
                session_id: str | None = None, plan: Callable[[Match], int] | None = None
                ) -> Hit:
        """Lookup + promote lower-tier blocks into RAM + reference the blocks; ``plan``:
        given the match (lower-tier blocks in it), the tokens to take (a block's end)."""
        req, spans = check_request(tokens, ns, extra_keys, self.config.block_size)
        with self._lock:
            return self._lookup.acquire(req, ns, spans, self._tick(), plan)

    def release(self, hit: Hit) -> None:
        """Unreference a hit's blocks (tail-first); they become evictable. Idempotent."""
        if not isinstance(hit, Hit):
            raise ValueError(f"release expects a Hit, got {type(hit).__name__}")
        with self._lock:
            if hit.released:
                return
            hit.released = True
            self.pool.release_chain(hit._held)

    def store(self, ns: Namespace, tokens: Any, num_tokens: int,
              payload_for: Callable[[int, int, bool], Any], *,
              extra_keys: Sequence[ExtraKeySpan] = (), session_id: str | None = None,
              agent_id: str | None = None, truncatable: bool = True,
              snapshot_at_end: bool = True, include_partial: bool = True,
              save_point: str = "mid_prefill", cursor: ChainCursor | None = None) -> int:
        """Store the blocks of ``tokens[:num_tokens]`` not stored yet (returns how many);
        ``payload_for(start, end, snapshot)`` is called only for blocks to create or
        upgrade with a snapshot. ``cursor`` resumes the walk at ``cursor.start`` and
        moves to the last full block, so a growing sequence's saves cost only its new
        blocks. ``session_id`` / ``agent_id`` (RAM only) are recorded on every block."""
        req, spans, offset = check_store(ns, tokens, num_tokens, payload_for, extra_keys,
                                         session_id, agent_id, save_point, cursor,
                                         self.config.block_size)
        with self._lock:
            created = self._store.store(ns, req, num_tokens - offset, payload_for, spans,
                                        session_id, truncatable, snapshot_at_end,
                                        include_partial, offset, cursor, agent_id,
                                        now=self._tick())
            self._c.saves[save_point] += 1
            self._c.blocks_saved[save_point] += created
            return created

    def note_not_stored(self, ns: Namespace, tokens: Any, num_tokens: int,
                        cursor: ChainCursor | None, cause: str, *,
                        extra_keys: Sequence[ExtraKeySpan] = ()) -> None:
        """A save of ``tokens[:num_tokens]`` failed (``cause``: the caller's short name
        for why: layout | tier | budget | invariant | other) after storing the blocks
        before ``cursor.start`` (default 0). The next lookup that stops there explains
        its miss as ``not_stored: <cause>`` instead of ``cold``: remembered for the
        first block not stored (when it is a full block) and for the children of the
        cursor's block (never the namespace root: every prompt starts there)."""
        keys = first_unstored(ns, tokens, num_tokens, cursor, cause, extra_keys,
                              self.config.block_size)
        if keys is not None:
            with self._lock:
                self.gone.record(keys[0], keys[1], NOT_STORED, cause)

    def protect(self, tokens: Any, ns: Namespace, num_tokens: int, ttl_s: float, *,
                key: str | None = None, persist: bool = True, pin_s: float | None = None,
                extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        """Keep the RAM blocks holding ``tokens[:num_tokens]`` from eviction for ``ttl_s``
        seconds, within ``protect_share`` of the RAM budget (oldest give way): a breakpoint
        (``key`` None; the block holding it too) or ``key``'s latest chain (replacing its
        previous one). ``persist``: put into the lower tiers at once; ``pin_s``: also pinned
        in the tiers that can pin, outside the lock. Returns the blocks protected."""
        req, spans = check_request(tokens, ns, extra_keys, self.config.block_size)
        check_protect(num_tokens, ttl_s, key, pin_s)
        end = min(num_tokens, req.n)
        full = full_hashes(req, ns, spans, end)
        with self._lock:
            n, chain = self._protect.protect(req, ns, spans, end, full, float(ttl_s), key,
                                             persist, self._tick())
        if chain and pin_s is not None:
            failed = self._protect.pin(chain, float(pin_s))  # outside the lock
            with self._lock:
                for tier, e in failed:
                    self._faults.tier_error(tier, e)
        return n

    def mark_active(self, tokens: Any, ns: Namespace, session: str, *,
                    extra_keys: Sequence[ExtraKeySpan] = ()) -> int:
        """The RAM chain holding ``tokens`` is the latest chain of ``session`` (any
        key the caller chooses: the server uses tenant, session and agent): evicted
        only after idle blocks until the session is quiet for ``active_session_s``.
        Returns the number of blocks in the chain."""
        req, spans = check_request(tokens, ns, extra_keys, self.config.block_size)
        if not isinstance(session, str) or not session:
            raise ValueError(f"session must be a non-empty string, got {session!r}")
        full = full_hashes(req, ns, spans, req.n)
        with self._lock:
            return self._protect.mark_active(req, ns, spans, full, session, self._tick())

    def levels_snapshot(self) -> dict[str, Any]:
        """Protection and session-level gauges and counters (``levels``)."""
        with self._lock:
            self._tick()
            return self.levels.snapshot()

    def evict(self, num_blocks: int | None = None) -> int:
        """Evict (demote) up to ``num_blocks`` LRU unreferenced blocks (None: all, and
        every state held outside the pool)."""
        check_count("num_blocks", num_blocks, allow_none=True)
        with self._lock:
            self._tick()
            if num_blocks is None:
                self._forget_outside(None, None)
            return self._ops.evict(num_blocks)

    def now(self) -> float:  # the cache's clock (what its TTL is counted in)
        return self._clock()

    def delete_session(self, session_id: str, tenant: str | None = None) -> int:
        """Remove the session from the blocks of ``tenant`` (None: of every tenant) in
        every tier; blocks left with no session are deleted. Returns the number of
        distinct blocks deleted (a block in RAM and on SSD counts once)."""
        with self._lock:
            self._forget_outside(tenant, session_id)
            return self._ops.delete_session(session_id, tenant)

    def delete(self, tenant: str | None = None) -> int:
        """Delete every block of ``tenant`` (None: every block) in every tier (and the
        state held outside the pool for it)."""
        with self._lock:
            self._forget_outside(tenant, None)
            return self._ops.delete(tenant)

    def token_history(self, ns: Namespace, max_tokens: int, overlap: int = 16
                      ) -> list[tuple[int, ...]]:
        """The token ids stored under ``ns`` (one model, format and tenant) in RAM and
        the lower tiers, as sequences: the chains from the namespace root, depth first;
        a block's first child continues its sequence, every other child starts a new
        one with the last ``overlap`` tokens before it (so n-grams reach across the
        branch point). Each block's tokens once, at most about ``max_tokens`` tokens in
        all (the walk stops there). Metadata only: no payload is read."""
        with self._lock:
            return self._ops.token_history(ns, max_tokens, overlap)

    def quarantine_chain(self, block_hash: BlockHash, ns: Namespace) -> int:
        """Remove the block and every block chained after it (its descendants) from
        RAM and every lower tier, so nothing restores from it again. Returns the
        number of distinct blocks removed."""
        with self._lock:
            return self._ops.quarantine_chain(block_hash, ns)

    def resize_ram(self, budget_bytes: int) -> int:
        """Set the RAM budget; shrinking evicts (demotes) idle blocks, then releases
        the live state held outside the pool, then evicts active blocks. Blocks in use are
        never evicted, so the budget set may stay above ``budget_bytes`` by what they
        hold. Returns the budget in force."""
        check_count("budget_bytes", budget_bytes)
        with self._lock:
            return self._ops.resize_ram(budget_bytes)

    def set_outside_holder(self, reclaim: Callable[[int], int] | None,
                           forget: Callable[[str | None, str | None], int] | None = None
                           ) -> None:
        """The hooks of the holder of bytes outside the pool within the RAM budget (the
        engine's live states), called under the cache lock, never calling back into the
        cache: ``reclaim(nbytes)`` releases at least ``nbytes`` (returns the bytes
        released); ``forget(tenant, session)`` releases what it holds of a tenant (None:
        every tenant) or of one session of it, when those are deleted (returns the bytes
        released)."""
        with self._lock:
            self.pool.reclaim_outside = reclaim
            self._forget_hook = forget

    def _forget_outside(self, tenant: str | None, session: str | None) -> None:
        if self._forget_hook is not None:  # lock held
            self.pool.drop_outside(self._forget_hook(tenant, session))

    def hold_outside(self, nbytes: int) -> bool:
        """Count ``nbytes`` held outside the pool in the RAM budget, evicting idle
        blocks (and releasing older outside bytes) to make room; False if they cannot
        fit (nothing counted)."""
        check_count("nbytes", nbytes)
        with self._lock:
            return self.pool.hold_outside(nbytes)

    def drop_outside(self, nbytes: int) -> None:
        """Bytes counted by ``hold_outside`` were given back by their holder."""
        check_count("nbytes", nbytes)
        with self._lock:
            self.pool.drop_outside(nbytes)

    def shrink_ram(self, nbytes: float) -> int:
        """Free about ``nbytes`` of the RAM tier (the memory governor): its budget is
        lowered to what its blocks hold less that; evicted blocks are demoted as on any
        eviction. Returns the bytes of blocks freed."""
        with self._lock:
            used = self.pool.used_bytes
            target = max(0, used - int(min(nbytes, used)))
            self._ops.resize_ram(target)
            return used - self.pool.used_bytes

    def sessions(self, tenant: str | None = None) -> list[dict[str, Any]]:
        """Every session with blocks, per tier: ``{"tenant", "session_id", "tiers":
        {"ram": {"blocks", "bytes"}, "<tier>": {"blocks", "bytes", "last_use"}}}`` (a
        lower tier that can list its sessions reports the wall-clock time its blocks
        were last used), sorted by tenant and session."""
        with self._lock:
            return self._ops.sessions(tenant)

    def ram_metas(self, ns: Namespace, session_id: str | None = None) -> list[BlockMeta]:
        """The metadata of the RAM blocks of ``ns`` (of one session's, if given)."""
        with self._lock:
            return self._ops.ram_metas(ns, session_id)

    def read_block(self, block_hash: BlockHash, ns: Namespace
                   ) -> tuple[BlockMeta, bytes, tuple[str, ...]] | None:
        """A stored block as ``(meta, payload bytes in the codec, sessions)``: from RAM
        (encoded here) or else the first lower tier that has it (bytes as stored,
        checksum-verified by the tier). None if no tier has it. The RAM LRU order
        does not change (a lower tier may count the read as a hit)."""
        with self._lock:
            ram = self._ops.ram_copy(block_hash, ns)
        if ram is not None:  # payloads are immutable: encode without holding the lock
            return ram[0], ram[1].encode(), ram[2]
        with self._lock:
            return self._ops.read_lower(block_hash, ns)

    def import_block(self, meta: BlockMeta, data: bytes, sessions: Sequence[str],
                     ns: Namespace) -> bool:
        """Add one verified block (``packfile.read_pack`` checked its chain hash, digest and
        namespace): into RAM when it fits (handed to the write-through tiers like a
        stored block), else straight into every lower tier (with back-pressure). A
        block already in RAM only gains the sessions. True if the block was added."""
        with self._lock:
            return self._ops.import_block(meta, data, sessions, ns, self._clock())

    def stats(self) -> CacheStats:
        with self._lock:
            pool = self.pool
            return snapshot(
                self._c, ram_bytes=pool.used_bytes, ram_budget_bytes=pool.budget_bytes,
                ram_blocks=pool.num_blocks, ram_used_blocks=pool.num_used_blocks,
                ram_free_blocks=pool.num_free_blocks, unwritten_blocks=self._writer.num_unwritten(),
                tiers=tier_stats(self.lower))

    def check(self) -> None:  # the pool's invariants (tests, admin): InvariantError
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
            return self._ops.persist(timeout)

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
            close_tiers(self.lower)
