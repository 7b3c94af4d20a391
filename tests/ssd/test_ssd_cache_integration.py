"""PromptCache over a real SSD tier: demotion, restart, corruption (cache level only)."""

import numpy as np
from ssd_helpers import make_tier

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.meta import Namespace
from promptcache.tiers.ssd_files import block_rel_path

BS = 4
NS = Namespace("integration-model", block_size=BS, tenant="alice")
BLOCK_BYTES = 2 * 1 * 2 * BS * 8 * 4  # k and v, float32 [1, 2, 4, 8]


def arrays(start: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(start)
    k = rng.standard_normal((1, 2, BS, 8), dtype=np.float32)
    return {"0.k": k, "0.v": -k}


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return arrays(start + 1000 * (end - start))


def open_cache(path, **kw):
    ssd = make_tier(path)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=3 * BLOCK_BYTES), lower=[ssd], **kw)
    return cache, ssd


A = list(range(100, 112))  # 3 full blocks
B = list(range(200, 212))


def fill_and_demote(path):
    cache, ssd = open_cache(path)
    assert cache.store(NS, A, len(A), payload_for, session_id="conv-a") == 3
    assert cache.store(NS, B, len(B), payload_for, session_id="conv-b") == 3  # evicts A
    ssd.flush()
    assert cache.stats().demotions == 3
    s = ssd.stats()
    assert (s["spills"], s["blocks_on_disk"], s["bytes_on_disk"] > 3 * BLOCK_BYTES) == (3, 3, True)
    cache.close(persist=False)  # a shutdown that keeps only what was demoted


def test_demoted_blocks_hit_from_ssd_after_a_restart_with_exact_bytes(tmp_path):
    fill_and_demote(tmp_path)
    cache, ssd = open_cache(tmp_path)  # the restart: empty RAM, same folder
    m = cache.lookup(A + [7], NS)
    assert (m.num_tokens, m.tiers) == (12, ["ssd", "ssd", "ssd"])
    hit = cache.acquire(A + [7], NS)
    # (hit.tokens_by_tier names the tier the blocks are in *now*: RAM, after promotion)
    assert hit.num_tokens == 12
    for i, (meta, payload) in enumerate(hit.blocks):
        assert meta.start == i * BS and meta.token_ids == tuple(A[i * BS : (i + 1) * BS])
        want = payload_for(i * BS, (i + 1) * BS, False)
        assert sorted(payload) == ["0.k", "0.v"]
        for name in want:
            assert payload[name].dtype == np.float32
            assert np.array_equal(payload[name], want[name])
    cache.release(hit)
    st = cache.stats()
    assert (st.promotions, st.tier_errors) == (3, 0)
    assert ssd.stats()["hits"] == 3
    cache.close()


def test_corrupt_ssd_block_is_a_counted_miss(tmp_path):
    fill_and_demote(tmp_path)
    cache, ssd = open_cache(tmp_path)
    second = cache.lookup(A + [7], NS).blocks[1]
    p = tmp_path / block_rel_path(second.namespace_key, second.tenant, second.block_hash.hex())
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF
    p.write_bytes(bytes(data))
    hit = cache.acquire(A + [7], NS)  # no exception reaches the caller
    assert hit.num_tokens == 4
    assert cache.stats().promotions == 1
    cache.release(hit)
    assert cache.stats().tier_errors == 1
    s = ssd.stats()
    assert (s["corrupt"], s["quarantined"], s["blocks_on_disk"]) == (1, 1, 2)
    assert cache.lookup(A + [7], NS).num_tokens == 4  # block 1 is gone from the index too
    cache.close()


def test_write_through_persists_on_store(tmp_path):
    cache, ssd = open_cache(tmp_path, write_through=True)
    assert cache.store(NS, A, len(A), payload_for) == 3
    ssd.flush()
    assert ssd.stats()["spills"] == 3
    cache.close()
    cache, ssd = open_cache(tmp_path)
    assert cache.lookup(A + [7], NS).tokens_by_tier == {"ssd": 12}
    cache.close()


def test_delete_session_reaches_the_ssd_tier(tmp_path):
    fill_and_demote(tmp_path)
    cache, ssd = open_cache(tmp_path)
    assert cache.delete_session("conv-a") == 3
    assert cache.lookup(A + [7], NS).num_tokens == 0
    assert ssd.stats()["blocks_on_disk"] == 0
    assert list(tmp_path.rglob("*.safetensors")) == []
    cache.close()


def test_delete_tenant_reaches_the_ssd_tier(tmp_path):
    fill_and_demote(tmp_path)
    cache, ssd = open_cache(tmp_path)
    assert cache.delete("bob") == 0
    assert cache.delete("alice") == 3
    assert ssd.stats()["blocks_on_disk"] == 0
    cache.close()


def test_clean_close_persists_the_ram_blocks(tmp_path):
    cache, ssd = open_cache(tmp_path)
    cache.store(NS, A, len(A), payload_for, session_id="conv-a")
    cache.store(NS, B, len(B), payload_for, session_id="conv-b")  # evicts A to the SSD
    cache.close()  # B is only in RAM: persisted now
    assert cache.stats().persisted_on_close == 3
    cache, ssd = open_cache(tmp_path)
    assert ssd.stats()["blocks_on_disk"] == 6
    assert cache.lookup(A + [7], NS).tokens_by_tier == {"ssd": 12}
    assert cache.lookup(B + [7], NS).tokens_by_tier == {"ssd": 12}
    cache.close()


def test_a_superseded_partial_tail_leaves_the_ssd_too(tmp_path):
    ssd = make_tier(tmp_path)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=8 * BLOCK_BYTES), lower=[ssd],
                        write_through=True)
    cache.store(NS, A[:10], 10, payload_for)  # 2 full blocks + the partial [108, 109]
    ssd.flush()
    assert ssd.stats()["blocks_on_disk"] == 3
    cache.store(NS, A, 12, payload_for)  # [108..111] covers the partial
    ssd.flush()
    assert cache.stats().superseded == 1
    rows = sorted(r.meta.token_ids for r in ssd.rows())
    assert rows == [tuple(A[0:4]), tuple(A[4:8]), tuple(A[8:12])]
    assert ssd.check(fix=False).problems == 0
    cache.close()
