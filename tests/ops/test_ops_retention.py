"""``PromptCache.protect(..., pin_s=...)`` (``prompt_cache_retention: 24h``) under one
clock the test controls: the chain reaches the SSD at once (not write-through) and is
pinned there, so a ``--ttl`` shorter than the pin does not expire it before the pin
ends; an unpinned chain (``in_memory``) expires with the TTL."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.meta import Namespace
from promptcache.tiers.ssd import SSDTier

BS = 4
NS = Namespace("model-a", BS, tenant="alice")
TTL = 100.0
DAY = 86400.0
PINNED = list(range(10, 22))  # 3 full blocks
PLAIN = list(range(40, 48))  # 2 full blocks


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return {"0.k": np.arange(start, end, dtype=np.float32).reshape(1, 1, -1, 1)}


def make(tmp: Path, clock: Clock) -> tuple[PromptCache, SSDTier]:
    tier = SSDTier(SSDConfig(path=tmp / "ssd", fsync=False, ttl_seconds=TTL), clock=clock,
                   sweep_interval_s=1e9)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20, ttl_seconds=TTL),
                        lower=[tier], clock=clock)  # write-back: the SSD gets blocks on eviction
    return cache, tier


def hit(cache: PromptCache, tokens: list[int]) -> tuple[int, dict[str, int]]:
    h = cache.acquire(tokens, NS)
    cache.release(h)
    return h.num_tokens, dict(h.tokens_by_tier)


def test_a_pinned_chain_outlives_the_ttl_on_the_ssd(tmp_path: Path) -> None:
    clock = Clock()
    cache, ssd = make(tmp_path, clock)
    cache.store(NS, PINNED, 12, payload_for)
    cache.store(NS, PLAIN, 8, payload_for)
    t0 = clock.t
    assert cache.protect(PINNED, NS, 12, 600.0, key="k", persist=True, pin_s=DAY) == 3
    assert cache.flush(30)
    hashes = [b.block_hash for b in cache.lookup(PINNED, NS).blocks]
    plain = [b.block_hash for b in cache.lookup(PLAIN, NS).blocks]
    rows = [ssd.catalog.index.get(bytes(h)) for h in hashes]
    assert [r.pinned_until if r else "missing" for r in rows] == [t0 + DAY] * 3
    assert [ssd.catalog.index.get(bytes(h)) for h in plain] == [None, None]  # not written yet
    cache.evict()  # the plain chain (not protected) is demoted, unpinned
    assert cache.flush(30)
    assert all(ssd.catalog.index.get(bytes(h)).pinned_until is None for h in plain)  # type: ignore[union-attr]
    clock.t = t0 + 10 * TTL
    assert ssd.sweep() == 2  # the plain chain expired; the pinned one did not
    assert hit(cache, PINNED + [1]) == (12, {"ssd": 12})
    assert hit(cache, PLAIN + [1])[0] == 0
    cache.evict()
    clock.t = t0 + DAY
    ssd.sweep()
    assert ssd.stats()["blocks_on_disk"] == 0
    cache.close(persist=False)


def test_pin_s_must_be_positive(tmp_path: Path) -> None:
    clock = Clock()
    cache, _ = make(tmp_path, clock)
    cache.store(NS, PINNED, 12, payload_for)
    for bad in (0, -1.0, True, "1d"):
        with pytest.raises(ValueError, match="pin_s"):
            cache.protect(PINNED, NS, 12, 600.0, key="k", pin_s=bad)  # type: ignore[arg-type]
    cache.close(persist=False)
