"""KV-quantized blocks in the shared Redis tier: Redis stores the same one-buffer
payload as RAM and the SSD, a second server restores it quantized, and the
quantization spec in the namespace keeps full-precision servers away from it."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from models.quant_models import ensure_tiny_llama_hd64

from promptcache import codec
from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig, RedisConfig
from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.engine import Engine
from promptcache.engine.payload.blockbuf import BlockPayload
from promptcache.serving_config import EngineConfig

BLOCK, CHUNK = 8, 16
_ids = itertools.count()


@pytest.fixture(scope="module")
def hd64_path(tiny_llama_path: Path, models_root: Path) -> Path:
    return ensure_tiny_llama_hd64(tiny_llama_path, models_root)


def _engine(path: Path, url: str, kv_bits: int | None) -> Engine:
    cc = CacheConfig(block_size=BLOCK, ram_budget_bytes=64 * 1024**2, kv_bits=kv_bits,
                     kv_quant_min_tokens=0)
    cache = build_cache(cc, None, RedisConfig(url=url, timeout_s=2.0, connect_timeout_s=2.0))
    return Engine.load(path, EngineConfig(restore_plan="load", prefill_chunk_tokens=CHUNK), cc, cache=cache)


def _run(eng: Engine, tokens: list[int], use_cache: bool = True):  # type: ignore[no-untyped-def]
    req = GenerationRequest(prompt_tokens=tuple(tokens), sampling=SamplingParams(max_tokens=4),
                            use_cache=use_cache, request_id=f"rq-{next(_ids)}")
    res = eng.submit(req).result(timeout=120)
    assert res.finish_reason == "length", res.error
    return res


def test_redis_holds_quantized_blocks_as_one_buffer(hd64_path: Path, redis_url: str) -> None:
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 1000, size=30)]
    with _engine(hd64_path, redis_url, 8) as a:
        first = _run(a, prompt)
        tier = a.cache.lower[0]
        tier.flush()
        ns = a.namespace()
        blocks = list(a.cache.pool.blocks())
        assert ns.kv_spec == "float32;kv*2;q8g64m0"
        for b in blocks:
            data = tier.get(b.block_hash, ns=ns)
            assert data is not None
            dec = codec.decode(data, verify=True)
            assert dec.buffer.dtype == np.uint8 and dec.buffer.ndim == 1
            assert dec.buffer.size == b.nbytes == b.payload.nbytes
            assert dec.desc.layout == b.payload.layout.text
            assert dec.desc.layout.startswith("0-1=q8g64:float32:1x2x")
    # another server with the same spec restores the quantized blocks from Redis
    with _engine(hd64_path, redis_url, 8) as b2:
        hit = _run(b2, prompt)
        plain = _run(b2, prompt, use_cache=False)
        promoted = [b for b in b2.cache.pool.blocks() if b.start < 29]
        assert b2.namespace().root == ns.root
    assert hit.usage.cached_by_tier == {"redis": 29}
    assert hit.tokens == first.tokens == plain.tokens
    assert promoted and all(isinstance(b.payload, BlockPayload) and b.payload.layout.quantized
                            for b in promoted)
    # a full-precision server and a 4-bit one never see them
    for bits in (None, 4):
        with _engine(hd64_path, redis_url, bits) as other:
            assert other.namespace().root != ns.root
            assert _run(other, prompt).usage.cached_tokens == 0
