"""End to end through the SSD tier: a restarted engine hits blocks written by the first."""

from __future__ import annotations

import numpy as np

from promptcache.config import CacheConfig, EngineConfig, SSDConfig
from promptcache.engine.engine import Engine


def test_restarted_engine_hits_ssd_blocks(tiny_llama_path, tmp_path):
    ssd = SSDConfig(path=tmp_path / "blocks", policy="write_through", fsync=False)
    ec, cc = EngineConfig(prefill_chunk_tokens=16), CacheConfig(block_size=8, ram_budget_bytes=64 * 1024**2)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 1000, size=30)]
    with Engine.load(tiny_llama_path, ec, cc, ssd_config=ssd) as first:
        r1 = first.generate(prompt, max_tokens=4)
        assert r1.usage.saved_mid_prefill == 2 and r1.usage.saved_end_prefill == 2
    with Engine.load(tiny_llama_path, ec, cc, ssd_config=ssd) as second:
        r2 = second.generate(prompt, max_tokens=4)
        ref = second.generate(prompt, max_tokens=4, use_cache=False)
        stats = second.stats()
    assert r2.usage.cached_tokens == 29
    assert r2.usage.cached_by_tier == {"ssd": 29}
    assert r2.tokens == r1.tokens == ref.tokens
    assert stats["cache"]["promotions"] == 4
