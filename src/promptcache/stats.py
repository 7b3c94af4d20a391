"""Cache counters (mutable, owned by PromptCache) and the ``CacheStats`` snapshot."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

SAVE_POINTS = ("mid_prefill", "end_prefill", "end_generation")


@dataclass
class Counters:
    lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    hit_tokens_by_tier: Counter[str] = field(default_factory=Counter)
    misses_by_cause: Counter[str] = field(default_factory=Counter)
    evictions: int = 0
    evicted_dropped: int = 0  # evicted with no lower tier to take them
    demotions: int = 0
    demotion_failures: int = 0
    drops: int = 0  # blocks not stored (no room, larger than the budget)
    dedup_blocks: int = 0  # store() found the block already stored
    upgrades: int = 0  # an existing block got a snapshot payload
    superseded: int = 0  # partial tails removed because a longer sibling covers them
    collisions: int = 0
    promotions: int = 0
    promotion_failures: int = 0
    tier_errors: int = 0
    old_format_blocks: int = 0  # stored blocks of an older block format: counted misses
    expired: int = 0
    write_through: int = 0  # blocks every write-through tier accepted on store
    write_through_deferred: int = 0  # ... that first found a tier's write queue full
    persisted_on_close: int = 0
    persist_failures: int = 0  # blocks persist() could not get into every lower tier
    saves: Counter[str] = field(default_factory=Counter)
    blocks_saved: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of the cache's counters and gauges."""

    lookups: int
    hit_tokens: int
    miss_tokens: int
    hit_tokens_by_tier: dict[str, int]
    misses_by_cause: dict[str, int]
    evictions: int
    evicted_dropped: int
    demotions: int
    demotion_failures: int
    drops: int
    dedup_blocks: int
    upgrades: int
    superseded: int
    collisions: int
    promotions: int
    promotion_failures: int
    tier_errors: int
    old_format_blocks: int
    expired: int
    write_through: int
    write_through_deferred: int
    persisted_on_close: int
    persist_failures: int
    saves: dict[str, int]
    blocks_saved: dict[str, int]
    ram_bytes: int
    ram_budget_bytes: int
    ram_blocks: int
    ram_used_blocks: int
    ram_free_blocks: int
    unwritten_blocks: int  # RAM blocks waiting for room in a lower tier's write queue
    tiers: dict[str, dict[str, Any]]

    @property
    def token_hit_rate(self) -> float:
        total = self.hit_tokens + self.miss_tokens
        return self.hit_tokens / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["token_hit_rate"] = self.token_hit_rate
        return out


def snapshot(
    c: Counters,
    *,
    ram_bytes: int,
    ram_budget_bytes: int,
    ram_blocks: int,
    ram_used_blocks: int,
    ram_free_blocks: int,
    unwritten_blocks: int = 0,
    tiers: dict[str, dict[str, Any]],
) -> CacheStats:
    return CacheStats(
        lookups=c.lookups,
        hit_tokens=c.hit_tokens,
        miss_tokens=c.miss_tokens,
        hit_tokens_by_tier=dict(c.hit_tokens_by_tier),
        misses_by_cause=dict(c.misses_by_cause),
        evictions=c.evictions,
        evicted_dropped=c.evicted_dropped,
        demotions=c.demotions,
        demotion_failures=c.demotion_failures,
        drops=c.drops,
        dedup_blocks=c.dedup_blocks,
        upgrades=c.upgrades,
        superseded=c.superseded,
        collisions=c.collisions,
        promotions=c.promotions,
        promotion_failures=c.promotion_failures,
        tier_errors=c.tier_errors,
        old_format_blocks=c.old_format_blocks,
        expired=c.expired,
        write_through=c.write_through,
        write_through_deferred=c.write_through_deferred,
        persisted_on_close=c.persisted_on_close,
        persist_failures=c.persist_failures,
        saves={k: c.saves[k] for k in SAVE_POINTS},
        blocks_saved={k: c.blocks_saved[k] for k in SAVE_POINTS},
        ram_bytes=ram_bytes,
        ram_budget_bytes=ram_budget_bytes,
        ram_blocks=ram_blocks,
        ram_used_blocks=ram_used_blocks,
        ram_free_blocks=ram_free_blocks,
        unwritten_blocks=unwritten_blocks,
        tiers=tiers,
    )
