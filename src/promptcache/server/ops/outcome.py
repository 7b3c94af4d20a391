"""What the cache did for one request, in one word (``outcome_of``; docs/api.md):
``hit:<tiers>``, ``new`` (nothing cached to share), ``miss:<cause>`` (it repeats earlier
traffic and the cache did not deliver) or ``off``; read by the request log, the hit-rate
alert and its diagnosis. ``shared``: what a working cache reuses (0 for new / off)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ...engine.api import CacheMiss
from .diagnostics import Divergence

NEW = "new"
HIT = "hit"
MISS = "miss"
OFF = "off"

# the cache's causes (cache/miss.py) by which it lost, or never kept, what it was given
LOST = frozenset({"evicted", "expired", "not_restorable", "promotion_failed", "not_stored",
                  "cache_error", "restore_error"})
_TIER_ORDER = ("live", "ram", "ssd", "redis")


@dataclass(frozen=True)
class Outcome:
    word: str  # new | hit | miss | off
    cause: str | None = None  # a miss: why
    shared: int = 0  # tokens the request repeats of earlier traffic (what a cache reuses)
    reused: int = 0  # of those, served from the cache
    tiers: tuple[str, ...] = ()  # where the cached tokens came from

    @property
    def counted(self) -> bool:
        """Counted by the hit-rate alert: the request repeats earlier traffic."""
        return self.word in (HIT, MISS)

    @property
    def words(self) -> str:
        """The request log line's ``cache=`` value."""
        if self.word == HIT:
            return f"hit:{'+'.join(self.tiers) or '-'}"
        if self.word == MISS:
            return f"miss:{self.cause}"
        return self.word


def tiers_of(cached_by_tier: Mapping[str, int]) -> tuple[str, ...]:
    """The tiers that served tokens, nearest first."""
    names = [k for k, v in cached_by_tier.items() if v > 0]
    rank = {t: i for i, t in enumerate(_TIER_ORDER)}
    return tuple(sorted(names, key=lambda t: (rank.get(t, len(rank)), t)))


def outcome_of(prompt_tokens: int, cached_tokens: int, miss: CacheMiss | None, *,
               cached_by_tier: Mapping[str, int] | None = None, caching: bool = True,
               divergence: Divergence | None = None,
               last_message_start: int | None = None) -> Outcome:
    """The outcome of a request that read ``cached_tokens`` of ``prompt_tokens`` from the
    cache; ``divergence``: vs the session's previous turn; ``last_message_start``: where
    the last chat message starts (None: unknown, a ``diverged`` miss is then ``new``)."""
    if not caching:
        return Outcome(OFF)
    tiers = tiers_of(cached_by_tier or {})
    if divergence is not None and divergence.previous and divergence.reachable > 0:
        shared = divergence.reachable
        if cached_tokens >= shared:
            return Outcome(HIT, None, shared, shared, tiers)
        cause = divergence.changed or (miss.cause if miss is not None else "cold")
        return Outcome(MISS, cause, shared, cached_tokens, tiers)
    if miss is None or miss.kind == "cold":
        # a full hit, or everything the cache held of a prompt that goes on past it
        return Outcome(HIT, None, cached_tokens, cached_tokens, tiers) if cached_tokens > 0 \
            else Outcome(NEW)
    if miss.kind in LOST:
        shared = max(prompt_tokens, cached_tokens)
        return Outcome(MISS, miss.cause, shared, cached_tokens, tiers)
    if miss.kind == "diverged" and last_message_start is not None:
        if miss.position < last_message_start:  # the history changed
            return Outcome(MISS, miss.cause, last_message_start, cached_tokens, tiers)
        return Outcome(NEW, tiers=tiers)  # a new question after a shared preamble
    if miss.kind == "diverged" and cached_tokens > 0:
        # a raw prompt that goes on differently: the cache served all they share
        return Outcome(HIT, None, cached_tokens, cached_tokens, tiers)
    return Outcome(NEW, tiers=tiers)
