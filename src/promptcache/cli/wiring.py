"""``build_cache``: the PromptCache over RAM plus the tiers the configs ask for (None when
off); a tier that cannot work stays listed as ``off`` / ``read_only``, never stops serve."""

from __future__ import annotations

import logging

from ..cache import PromptCache
from ..config import CacheConfig, RedisConfig, SSDConfig
from ..tiers.base import Tier

log = logging.getLogger(__name__)


def build_cache(cache_config: CacheConfig, ssd_config: SSDConfig | None = None,
                redis_config: RedisConfig | None = None) -> PromptCache | None:
    """PromptCache over RAM (+ SSD, + Redis when configured); None if disabled."""
    if not cache_config.enabled:
        return None
    from ..engine.payload.payload import MLXPayloadAdapter

    lower: list[Tier] = []
    if ssd_config is not None:
        from ..tiers.ssd import SSDTier

        ssd = SSDTier(ssd_config)
        if ssd.mode != "read_write":
            log.error("serving without the SSD tier's writes: it is %s (%s)", ssd.mode,
                      ssd.health()["reason"])
        lower.append(ssd)
    if redis_config is not None:
        from ..tiers.redis import RedisTier

        redis = RedisTier(redis_config)
        if not redis.check_reachable():
            log.error("the shared Redis tier is unreachable at startup (%s): serving "
                      "without it until it answers", redis.health()["reason"])
        lower.append(redis)
    # each tier's own ``policy`` decides too: the Redis tier is write-through by default
    write_through = ssd_config is not None and ssd_config.policy == "write_through"
    return PromptCache(cache_config, adapter=MLXPayloadAdapter(), lower=lower,
                       write_through=write_through)
