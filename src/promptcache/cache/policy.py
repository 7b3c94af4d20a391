"""The policies every part of ``PromptCache`` applies: tier failures (``Faults``: any
tier exception or undecodable bytes is counted and is a miss, never a failed call; an
older block format too, recomputed and replaced), the TTL (``Expiry``), observers."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..blocks.pool import Block, BlockPool
from ..stats import Counters
from .miss import EXPIRED, GoneMemory

logger = logging.getLogger(__name__)


def notify(observers: Sequence[Any], event: str, *args: Any) -> None:
    """Call ``event`` on every observer (``advisor.py``): under the lock, must be cheap,
    and may not fail a call (an observer's error is logged)."""
    for obs in observers:
        try:
            getattr(obs, event)(*args)
        except Exception:
            logger.exception("cache observer %r failed on %s", obs, event)


def tier_stats(tiers: Sequence[Any]) -> dict[str, dict[str, Any]]:
    """Each lower tier's stats (an error as ``{"error": ...}``: stats never fail)."""
    out: dict[str, dict[str, Any]] = {}
    for tier in tiers:
        try:
            out[tier.name] = dict(tier.stats())
        except Exception as e:  # stats must never fail the admin endpoint
            out[tier.name] = {"error": str(e)}
    return out


def close_tiers(tiers: Sequence[Any]) -> None:
    """Close (flush) every lower tier; a failure is logged."""
    for tier in tiers:
        try:
            tier.close()
        except Exception as e:
            logger.warning("closing tier %s failed: %s", getattr(tier, "name", tier), e)


@dataclass(eq=False)
class Faults:
    """Counts and logs what the lower tiers do wrong (never raises)."""

    counters: Counters

    def tier_error(self, tier: Any, exc: BaseException) -> None:
        self.counters.tier_errors += 1
        logger.warning("cache tier %s failed: %s", getattr(tier, "name", tier), exc)

    def old_format(self, tier: Any, exc: BaseException) -> None:
        self.counters.old_format_blocks += 1
        if self.counters.old_format_blocks == 1:
            logger.warning("cache tier %s holds blocks of an older format (%s): they are "
                           "recomputed and rewritten (counted in old_format_blocks)",
                           getattr(tier, "name", tier), exc)


@dataclass(eq=False)
class Expiry:
    """The TTL: a RAM block unused for ``ttl_s`` s (None: never) is no hit; removed when met."""

    ttl_s: float | None
    pool: BlockPool
    gone: GoneMemory
    counters: Counters

    def expired(self, block: Block, now: float) -> bool:
        ttl = self.ttl_s
        return ttl is not None and now - block.last_access > ttl

    def remove(self, block: Block) -> None:
        if block.block_hash is not None:
            self.gone.record(block.block_hash, block.parent_hash, EXPIRED)
        if self.pool.remove(block):
            self.counters.expired += 1

    def sweep(self, now: float) -> None:
        """Remove expired unreferenced blocks from the LRU end of the free queue."""
        if self.ttl_s is None:
            return
        for block in self.pool.lru_order():
            if not self.expired(block, now):
                break
            self.remove(block)
