"""/v1/cache/stats of a server storing 8-bit blocks: the kv section reports one array
per block, the arrays and bytes per cached token and the stored quantization."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from models.quant_models import ensure_tiny_llama_hd64

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.server import create_app
from promptcache.serving_config import EngineConfig, ServerConfig


def test_cache_stats_report_arrays_per_cached_token(tiny_llama_path: Path, models_root: Path) -> None:
    path = ensure_tiny_llama_hd64(tiny_llama_path, models_root)
    cc = CacheConfig(block_size=8, ram_budget_bytes=16 * 1024**2, kv_bits=8, kv_quant_min_tokens=16)
    with Engine.load(path, EngineConfig(prefill_chunk_tokens=16), cc, cache=build_cache(cc)) as eng, \
            TestClient(create_app(eng, ServerConfig())) as c:
        empty = c.get("/v1/cache/stats").json()["kv"]
        assert empty["ram_blocks"] == 0 and empty["arrays_per_cached_token"] == 0.0
        body = {"model": "default", "max_tokens": 4,
                "messages": [{"role": "user", "content": "count the blocks " * 6}]}
        assert c.post("/v1/chat/completions", json=body).status_code == 200
        # the next-turn pre-render of that reply stores blocks too: count them all
        assert c.app.state.pc_prerender.wait_idle(60)
        kv = c.get("/v1/cache/stats").json()["kv"]
        blocks = eng.cache.pool.blocks()
    quantized = sum(b.start >= 16 for b in blocks)
    # the rows of one slab (a chunk's blocks saved together) share one array
    arrays = len({id(b.payload.slab if b.payload.slab is not None else b.payload)
                  for b in blocks})
    assert arrays < len(blocks)
    assert kv == {
        "kv_quantization": "q8g64m16", "ram_blocks": len(blocks),
        "ram_tokens": sum(b.num_tokens for b in blocks), "ram_arrays": arrays,
        "ram_quantized_blocks": quantized,
        "arrays_per_cached_token": arrays / sum(b.num_tokens for b in blocks),
        "bytes_per_cached_token": sum(b.nbytes for b in blocks) / sum(b.num_tokens for b in blocks),
    }
    assert quantized >= 2 and len(blocks) - quantized == 2
