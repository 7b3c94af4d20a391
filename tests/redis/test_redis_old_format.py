"""A Redis entry an older version wrote (block format 2 payload, a sha256 in its record)
is never misread and never crashes: a miss counted in ``old_format_blocks`` (not a tier
error, not deleted as damage); the recomputed block's rewrite replaces it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
from redis_servers import RedisServer
from safetensors.numpy import save as st_save

from promptcache.cache import PromptCache
from promptcache.codec import decode
from promptcache.config import CacheConfig
from promptcache.meta import Namespace
from promptcache.tiers.redis import RedisTier
from promptcache.tiers.redis_keys import decode_record, encode_record

Make = Callable[..., RedisTier]
BS = 4
NS = Namespace("test-model", BS)
SEQ = list(range(1, 13))  # 3 full blocks


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return {"0.k": np.arange(start, end, dtype=np.float32).reshape(-1, 1).repeat(2, axis=1)}


def cache_on(tier: RedisTier) -> PromptCache:
    return PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=1 << 20), lower=[tier],
                       write_through=True)


def test_an_old_redis_entry_is_a_counted_miss_then_rewritten(make_tier: Make, redis_url: str,
                                                            redis_server: RedisServer) -> None:
    ta = make_tier(redis_url)
    cache_on(ta).store(NS, SEQ, 12, payload_for)
    ta.flush()
    client = redis_server.client()
    key = next(k for k in client.scan_iter(match="*:b:*")
               if client.hget(k, "m") and b'"s":4,' in client.hget(k, "m"))
    rec = decode_record(client.hget(key, "m"), block_hash=bytes.fromhex(key.decode()[-64:]),
                        ns_key=NS.key, tenant=NS.tenant)
    old = st_save(payload_for(4, 8, False), metadata={"block_hash": rec.meta.block_hash.hex(),
                                                       "pc.v": "2"})
    old_record = encode_record(rec.meta, len(old), hashlib.sha256(old).hexdigest())
    client.hset(key, mapping={"m": old_record, "p": old})
    kids = next(k for k in client.scan_iter(match="*:k:*")
                if client.hexists(k, rec.meta.block_hash.hex()))
    client.hset(kids, rec.meta.block_hash.hex(), old_record)

    tb = make_tier(redis_url)
    b = cache_on(tb)
    hit = b.acquire(SEQ + [0], NS)
    assert hit.num_tokens == 4  # block 0; block 1 is of the old format
    b.release(hit)
    s = b.stats()
    assert (s.old_format_blocks, s.tier_errors) == (1, 0)
    assert tb.stats()["corrupt"] == 0 and client.exists(key) == 1  # not taken for damage
    assert b.store(NS, SEQ, 12, payload_for) == 2  # blocks 1 and 2 recomputed, stored again
    tb.flush()
    data = client.hget(key, "p")
    assert decode(data, verify=True).desc.meta == rec.meta
    tc = make_tier(redis_url)
    c = cache_on(tc)
    hit = c.acquire(SEQ + [0], NS)
    assert hit.num_tokens == 12 and c.stats().old_format_blocks == 0
    assert np.array_equal(hit.blocks[1][1]["0.k"], payload_for(4, 8, False)["0.k"])
    c.release(hit)
