"""PromptCache: the one policy module (lookup, store, promote, demote, protect, delete,
TTL, stats), as one facade over its parts.

RAM is the block pool (``blocks.pool``); lower tiers (SSD, Redis) implement
``tiers.base.Tier`` and hold encoded payload bytes (``codec``). See
docs/INTERFACES.md for the contract, ``blocks.matcher`` for the matching rule and
``cache_lower`` for how blocks reach the lower tiers (per-tier write policy).

``PromptCache`` is put together from mixins over one shared state, each a module with
one job (imports go one way: ``cache`` -> the parts -> ``cache_base``):

- ``cache_base``: the state (pool, tiers, writer, levels, matcher, counters, the lock),
  the codec, the TTL check, the tier-error policy, observers, the eviction hook;
- ``cache_lookup``: ``lookup``, ``stored_after``, ``acquire`` (+ promotion from the
  lower tiers), ``release``;
- ``cache_store``: ``store`` (the save points);
- ``cache_protect``: ``protect``, ``mark_active``, ``levels_snapshot``;
- ``cache_ops``: ``evict``, ``delete_session``, ``delete``, ``quarantine_chain``,
  ``resize_ram``, ``sessions``, ``ram_metas``, ``read_block``, ``import_block``;
- here: ``stats``, ``check``, ``flush``, ``persist``, ``last_persist``, ``close``.

Failure policy: any exception from a lower tier (``TierError``, or a tier breaking
its contract) and undecodable bytes are counted and treated as a miss; nothing a
tier does fails a call here, and no reference stays pinned.
Bad input raises ``ValueError``. Every public method holds one re-entrant lock.
"""

from __future__ import annotations

import logging
from typing import Any

from ..stats import CacheStats, snapshot
from .lookup import CacheLookup
from .lower import PersistReport
from .ops import CacheOps
from .protect import CacheProtect
from .store import CacheStore

logger = logging.getLogger(__name__)



class PromptCache(CacheOps, CacheProtect, CacheStore, CacheLookup):
    """Multi-tier prompt cache: RAM block pool + lower tiers (see module docstring); its
    methods come from the parts it is built of, over ``cache_base.CacheBase``."""

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
