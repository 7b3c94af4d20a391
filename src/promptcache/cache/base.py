"""The state every part of ``PromptCache`` shares, and the hooks it runs on.

``CacheBase`` holds the configuration, the RAM block pool, the lower tiers and their
writer (``cache_lower``), the protection levels (``cache_levels``), the matcher, the
counters and the one re-entrant lock; it owns the codec, the TTL check, the tier-error
policy, the observers and the eviction hook (every evicted block passes
``_on_block_evicted`` once: it is demoted to the lower tiers). The parts of
``PromptCache`` (``cache_lookup``, ``cache_store``, ``cache_protect``, ``cache_ops``)
are mixins over this class; ``cache.py`` puts them together.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import codec
from ..blocks.pool import Block, BlockPool
from ..codec import Decoded
from ..config import CacheConfig
from ..hashing import BlockHash
from ..meta import BlockMeta
from ..stats import Counters
from ..tiers.base import LazyPayload, Tier
from .levels import Levels
from .lower import DEMOTE_TIMEOUT_S, MAX_TIERS, LowerWriter
from .matcher import Matcher
from .miss import EVICTED, EXPIRED, GoneMemory
from .types import DecodeFn, EncodeFn, NumpyAdapter, PayloadAdapter

logger = logging.getLogger(__name__)


class CacheBase:
    """The shared state of ``PromptCache`` (see the module docstring)."""

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

    # ---- codec ----------------------------------------------------------------
    def _enc(self, meta: BlockMeta, sessions: Sequence[str], layout: str,
             buffer: np.ndarray) -> bytes:
        return (self._encode or codec.encode)(meta, sessions, layout, buffer)

    def _dec(self, data: bytes) -> Decoded:
        return (self._decode or codec.decode)(data)

    def _decode_block(self, data: bytes) -> tuple[BlockHash, np.ndarray, str]:
        """(block hash, buffer, layout) of stored bytes. Raises CorruptBlockError
        (``UnsupportedFormatError`` for an older block format)."""
        dec = self._dec(data)
        return dec.desc.meta.block_hash, dec.buffer, dec.desc.layout

    def _on_old_format(self, tier: Any, exc: BaseException) -> None:
        """A block of an older block format: a miss (``old_format_blocks``), not an
        error; the block is recomputed and its new copy replaces the old one."""
        self._c.old_format_blocks += 1
        if self._c.old_format_blocks == 1:
            logger.warning("cache tier %s holds blocks of an older format (%s): they are "
                           "recomputed and rewritten (counted in old_format_blocks)",
                           getattr(tier, "name", tier), exc)

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
        """The block's payload as a ``PayloadSource``: encoded (the adapter's buffer and
        layout behind a self-describing header, block format 3: ``codec``) by the first
        tier writer that needs the bytes, off the request path, once for every tier.
        The header carries what an index row holds, so a lost index can be rebuilt from
        the files; the sessions are those the block has now (taken here, under the
        cache's lock)."""
        adapter, payload, bm = self.adapter, block.payload, block.meta()
        sessions = tuple(sorted(block.sessions))

        def make() -> bytes:
            buffer, layout = adapter.to_buffer(payload)
            return self._enc(bm, sessions, layout, buffer)

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

    def _persist_first(self, blocks: list[Block]) -> None:
        """Protected blocks go to every lower tier at once, ahead of the write-through
        backlog (``LowerWriter.offer_first``), not when they are evicted."""
        self._writer.offer_first(blocks)
