"""Nothing acknowledged is lost, over a real SSD tier: a clean close with 1000 RAM
blocks keeps all 1000 under both policies (the write queue holds 64), a write-through
burst through a queue of 4 reaches the SSD completely, and a write_back eviction
burst is demoted with back-pressure instead of dropped."""

from __future__ import annotations

import numpy as np
import pytest
from ssd_helpers import make_tier

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.meta import Namespace

BS = 4
NS = Namespace("durability-model", block_size=BS, tenant="alice")
N_BLOCKS = 1000


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    k = np.full((1, 1, end - start, 4), float(start), dtype=np.float32)
    return {"0.k": k, "0.v": -k}


def prompt(first: int = 10_000) -> list[int]:
    return list(range(first, first + N_BLOCKS * BS))


def open_cache(path, *, write_through: bool, ram_blocks: int = 2 * N_BLOCKS, **ssd_kw):  # type: ignore[no-untyped-def]
    ssd = make_tier(path, **ssd_kw)
    block_bytes = 2 * BS * 4 * 4 + 8  # k + v (+ a snapshot entry on the last block)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=ram_blocks * block_bytes),
                        lower=[ssd], write_through=write_through)
    return cache, ssd


@pytest.mark.parametrize("write_through", [False, True], ids=["write_back", "write_through"])
def test_clean_close_keeps_all_1000_ram_blocks(tmp_path, write_through):
    cache, ssd = open_cache(tmp_path, write_through=write_through)  # queue_size 64
    assert cache.store(NS, prompt(), N_BLOCKS * BS, payload_for, session_id="conv") == N_BLOCKS
    assert cache.stats().ram_blocks == N_BLOCKS
    cache.close()
    s = cache.stats()
    assert s.persist_failures == 0 and s.demotion_failures == 0
    assert ssd.stats()["dropped_spills_total"] == 0
    cache, ssd = open_cache(tmp_path, write_through=write_through)  # the restart
    assert ssd.stats()["blocks_on_disk"] == N_BLOCKS
    assert ssd.check(fix=False).problems == 0
    m = cache.lookup(prompt() + [1], NS)
    assert (m.num_tokens, m.tokens_by_tier) == (N_BLOCKS * BS, {"ssd": N_BLOCKS * BS})
    hit = cache.acquire(prompt() + [1], NS)
    assert hit.num_tokens == N_BLOCKS * BS
    for i, (meta, payload) in enumerate(hit.blocks):
        assert meta.start == i * BS
        np.testing.assert_array_equal(payload["0.k"], payload_for(i * BS, (i + 1) * BS, False)["0.k"])
    cache.release(hit)
    cache.close()


def test_write_through_burst_through_a_queue_of_4_reaches_the_ssd(tmp_path):
    cache, ssd = open_cache(tmp_path, write_through=True, queue_size=4)
    assert cache.store(NS, prompt(), N_BLOCKS * BS, payload_for) == N_BLOCKS
    assert cache.flush(timeout=None) is True  # no close: as a server keeps running
    s, t = cache.stats(), ssd.stats()
    assert (s.unwritten_blocks, s.demotion_failures, s.write_through) == (0, 0, N_BLOCKS)
    assert s.write_through_deferred > 0  # the queue really was full
    assert (t["blocks_on_disk"], t["dropped_spills_total"]) == (N_BLOCKS, 0)
    # a crash now (no close, no persist) keeps every block: reopen the folder beside it
    other = make_tier(tmp_path)
    assert other.startup_report is not None and other.startup_report.problems == 0
    assert other.stats()["blocks_on_disk"] == N_BLOCKS
    other.close()
    cache.close(persist=False)


def test_write_back_eviction_burst_is_demoted_not_dropped(tmp_path):
    cache, ssd = open_cache(tmp_path, write_through=False, ram_blocks=100, queue_size=4)
    seqs = [prompt(first=10_000 * (i + 1))[: 50 * BS] for i in range(20)]  # 20 x 50 blocks
    for toks in seqs:  # each store evicts the older sequences' blocks
        assert cache.store(NS, toks, len(toks), payload_for) == 50
    s = cache.stats()
    assert s.evictions == N_BLOCKS - s.ram_blocks > 800
    assert (s.demotions, s.demotion_failures, s.evicted_dropped) == (s.evictions, 0, 0)
    cache.close()
    assert ssd.stats()["dropped_spills_total"] == 0
    cache, ssd = open_cache(tmp_path, write_through=False)
    assert ssd.stats()["blocks_on_disk"] == N_BLOCKS
    assert all(cache.lookup(toks + [1], NS).num_tokens == len(toks) for toks in seqs)
    cache.close()
