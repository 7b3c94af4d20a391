"""The ``ssd`` part of ``bench/bench_kvquant.py``: the ~200 MB SmolLM2-shaped float32 prefix of
``bench/bench_ssd.py`` (4,352 tokens, random KV) stored through PromptCache + SSDTier, then
restored into a fresh cache: full precision vs ``--kv-bits 8`` vs ``4`` (min tokens 256)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from page_cache import drop_cache

from harness.systems import dir_bytes
from promptcache.cache import PromptCache
from promptcache.config import CacheConfig, SSDConfig
from promptcache.engine.payload.adapters import extract_block, restore
from promptcache.engine.payload.payload import MLXPayloadAdapter, ram_census
from promptcache.engine.payload.quant import KVQuant
from promptcache.meta import Namespace
from promptcache.tiers.ssd import SSDTier

BLOCK = 64


def say(msg: str) -> None:
    print(msg, flush=True)


def load_avg() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


def _restore_all(cache: PromptCache, ns: Namespace, tokens: list[int], layers: int) -> float:
    t = time.perf_counter()
    hit = cache.acquire(tokens, ns)
    restored = restore([KVCache() for _ in range(layers)], hit.blocks, hit.num_tokens, reserve=1)
    mx.eval([c.keys for c in restored])
    elapsed = time.perf_counter() - t
    if hit.num_tokens != len(tokens) - 1:
        raise RuntimeError(f"restored {hit.num_tokens} of {len(tokens) - 1} tokens: {hit}")
    cache.release(hit)
    return elapsed


def part_ssd(args: argparse.Namespace) -> dict[str, Any]:
    """Store the prefix once per variant, then per repeat and variant (interleaved, so
    the machine's load swings hit every variant alike): a cold restore from the SSD
    (page cache dropped, fresh RAM tier), a warm one (page-cached files, fresh RAM
    tier), and one from RAM (the blocks the warm restore promoted)."""
    layers, heads, dim = 30, 3, 64
    n_tokens = 68 * BLOCK
    mx.random.seed(0)
    live = []
    for _ in range(layers):
        c = KVCache()
        x = mx.random.normal((1, heads, n_tokens, dim))
        c.update_and_fetch(x, -x)
        live.append(c)
    mx.eval([c.keys for c in live])
    tokens = list(range(n_tokens + 1))
    work = Path(tempfile.mkdtemp(prefix="bench-kvq-", dir=args.dir))
    cfg = CacheConfig(block_size=BLOCK, ram_budget_bytes=2 * 1024**3)
    variants = {"fp": None, "q8 m256": KVQuant(8), "q4 m256": KVQuant(4)}
    out: dict[str, Any] = {"tokens": n_tokens, "variants": {}}

    def open_cache(ssd_dir: Path) -> PromptCache:
        tier = SSDTier(SSDConfig(path=ssd_dir, queue_size=256, fsync=True))
        return PromptCache(cfg, adapter=MLXPayloadAdapter(), lower=[tier])

    try:
        setup = {}
        for v, quant in variants.items():
            ssd_dir = work / v.replace(" ", "_")
            ns = Namespace("bench-kvquant", BLOCK,
                           kv_spec=f"float32;kv*{layers}" + (f";{quant.spec}" if quant else ""))
            tier = SSDTier(SSDConfig(path=ssd_dir, queue_size=256, fsync=True, policy="write_through"))
            cache = PromptCache(cfg, adapter=MLXPayloadAdapter(), lower=[tier], write_through=True)
            t = time.perf_counter()
            cache.store(ns, tokens, n_tokens,
                        lambda s, e, snap, q=quant: extract_block(live, s, e, snap, quant=q),
                        include_partial=False)
            tier.flush()
            store_s = time.perf_counter() - t
            census = ram_census(cache, quant)
            cache.close(persist=False)
            files = [p for p in ssd_dir.rglob("*.safetensors") if "quarantine" not in p.parts]
            setup[v] = (ssd_dir, ns, files)
            out["variants"][v] = {
                "disk_bytes": dir_bytes(ssd_dir), "block_files_bytes": sum(f.stat().st_size for f in files),
                "payload_bytes_per_token": census["bytes_per_cached_token"],
                "arrays_per_cached_token": census["arrays_per_cached_token"], "store_s": store_s,
                "runs": {"cold": [], "warm": [], "ram": []},
            }
        live.clear()  # free the source KV before the restores
        method = ""
        for _ in range(args.repeat):
            for v, (ssd_dir, ns, files) in setup.items():
                runs = out["variants"][v]["runs"]
                method = drop_cache(files)
                cache = open_cache(ssd_dir)
                runs["cold"].append(_restore_all(cache, ns, tokens, layers))
                cache.close(persist=False)
                cache = open_cache(ssd_dir)
                runs["warm"].append(_restore_all(cache, ns, tokens, layers))
                runs["ram"].append(_restore_all(cache, ns, tokens, layers))
                cache.close(persist=False)
        for v, r in out["variants"].items():
            runs = r["runs"]
            r.update({f"{k}_restore_s": statistics.median(x) for k, x in runs.items()})
            r.update({f"{k}_best_s": min(x) for k, x in runs.items()})
            r["drop_method"] = method
            say(f"ssd {v}: {r['block_files_bytes'] / 1e6:.1f} MB in block files; restore median (best) "
                f"cold {r['cold_restore_s']:.3f} ({r['cold_best_s']:.3f}) s, warm {r['warm_restore_s']:.3f} "
                f"({r['warm_best_s']:.3f}) s, from RAM {r['ram_restore_s']:.3f} ({r['ram_best_s']:.3f}) s")
        say(f"ssd: load {load_avg()}, page cache dropped with {method}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out
