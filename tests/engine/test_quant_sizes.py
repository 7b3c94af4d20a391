"""Sizes come from metadata, never from evaluating arrays.

The payloads here are lazy views of an array of 2**48 bytes (beyond a process's
address space): evaluating any of them crashes the process. So the sizes, the
cache's accounting and the stats are computed in a child process, and the test
fails (the child dies) if anything on that path evaluates a payload.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent(
    """
    import json
    import mlx.core as mx
    from promptcache.cache import PromptCache
    from promptcache.config import CacheConfig
    from promptcache.engine.payload.blockbuf import BlockPayload
    from promptcache.engine.payload.blocklayout import parse_layout
    from promptcache.engine.payload.payload import MLXPayloadAdapter, ram_census
    from promptcache.engine.payload.quant import KVQuant
    from promptcache.meta import Namespace

    huge = mx.zeros((1 << 24, 1 << 24), dtype=mx.uint8)  # 2**48 bytes: never allocatable
    lay_fp = parse_layout("0-29=kv:float32:1x3x64x64")
    lay_q8 = parse_layout("0-29=q8g64:float32:1x3x64x64")
    ad = MLXPayloadAdapter()

    def payload(layout):
        return BlockPayload(huge[0, : layout.nbytes], layout)  # a lazy slice

    legacy = {"0.k": mx.zeros((1 << 20, 1 << 20, 64)), "0.v": huge[:, :8]}
    out = {"fp": ad.nbytes(payload(lay_fp)), "q8": ad.nbytes(payload(lay_q8)),
           "arrays": ad.num_arrays(payload(lay_q8)), "legacy": ad.nbytes(legacy),
           "legacy_arrays": ad.num_arrays(legacy)}
    cache = PromptCache(CacheConfig(block_size=64, ram_budget_bytes=1 << 30), adapter=ad)
    ns = Namespace("sizes", 64, kv_spec="float32;kv*30;q8g64m64")
    quant = KVQuant(8, 64, 64)
    made = cache.store(ns, list(range(257)), 256,
                       lambda s, e, snap: payload(lay_q8 if s >= 64 else lay_fp),
                       include_partial=False)
    out["blocks"] = sorted(b.nbytes for b in cache.pool.blocks())
    out["census"] = ram_census(cache, quant)
    out["cache_bytes"] = cache.stats().to_dict().get("ram_bytes")
    print(json.dumps(out))
    """
)


def test_sizes_and_stats_never_evaluate_a_payload():
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"the child died (a payload was evaluated?): {proc.stderr[-2000:]}"
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    fp, q8 = 30 * 2 * 3 * 64 * 64 * 4, 30 * 2 * 3 * 64 * (16 * 4 + 2 * 4)
    assert (out["fp"], out["q8"], out["arrays"]) == (fp, q8, 1) == (2949120, 829440, 1)
    assert out["legacy"] == 4 * (1 << 46) + 8 * (1 << 24) and out["legacy_arrays"] == 2
    assert out["blocks"] == [q8, q8, q8, fp]
    assert out["census"] == {
        "kv_quantization": "q8g64m64", "ram_blocks": 4, "ram_tokens": 256, "ram_arrays": 4,
        "ram_quantized_blocks": 3, "arrays_per_cached_token": 4 / 256,
        "bytes_per_cached_token": (3 * q8 + fp) / 256,
    }
    assert out["cache_bytes"] == 3 * q8 + fp
