"""Building the prompt cache for an Engine: the caller's job (the engine never builds tiers).

``build_cache`` returns the PromptCache over RAM plus the lower tiers the configs ask
for (SSD, the shared Redis tier), with the engine's MLX payload adapter, or None when
caching is off. Add a tier here (and only here) to make ``promptcache serve`` use it.
"""

from __future__ import annotations

from ..cache import PromptCache
from ..config import CacheConfig, RedisConfig, SSDConfig
from ..tiers.base import Tier


def build_cache(cache_config: CacheConfig, ssd_config: SSDConfig | None = None,
                redis_config: RedisConfig | None = None) -> PromptCache | None:
    """PromptCache over RAM (+ SSD, + Redis when their configs are given); None if
    disabled."""
    if not cache_config.enabled:
        return None
    from ..engine.payload import MLXPayloadAdapter

    lower: list[Tier] = []
    if ssd_config is not None:
        from ..tiers.ssd import SSDTier

        lower.append(SSDTier(ssd_config))
    if redis_config is not None:
        from ..tiers.redis import RedisTier

        lower.append(RedisTier(redis_config))
    # each tier's own ``policy`` decides too: the Redis tier is write-through by default
    write_through = ssd_config is not None and ssd_config.policy == "write_through"
    return PromptCache(cache_config, adapter=MLXPayloadAdapter(), lower=lower,
                       write_through=write_through)
