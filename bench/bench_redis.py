"""Restore throughput of a ~200 MB prefix: Redis tier vs SSD tier vs recompute (a
script, not a test).

The prefix: 68 blocks of 64 tokens of float32 KV shaped like SmolLM2-135M (30 layers
x 3 KV heads x head_dim 64, k and v: 46,080 B per token), 200.5 MB. A first
``PromptCache`` stores it (write-through to the tier under test, then ``flush``); a
second one, with empty RAM, restores it with ``acquire``: the lookup (one pipelined
round trip for Redis), then the promotion (RAM reserved first; Redis: one pipelined
read per 64 MB, size + xxh3-128 verified, decoded zero-copy; SSD: block by block with
its read-ahead). Times are the median of ``--repeat`` restores in one run.

* Redis: a local redis-server started by the script on a free loopback port (no
  persistence), standalone; the client is redis-py with hiredis.
* SSD: warm (page cache) and cold (each block file dropped from the page cache with
  ``posix_fadvise(DONTNEED)`` before the restore).
* Recompute: prefill of the same number of tokens with the real SmolLM2-135M in-process
  (``--prefill``; mlx-lm, chunks of 512), else skipped.

usage: python bench/bench_redis.py [--repeat 5] [--prefill]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from harness.redisproc import RedisServer
from promptcache.cache import PromptCache
from promptcache.config import CacheConfig, RedisConfig, SSDConfig
from promptcache.meta import Namespace
from promptcache.tiers.redis import RedisTier
from promptcache.tiers.ssd import SSDTier

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 64
BYTES_PER_TOKEN = LAYERS * 2 * KV_HEADS * HEAD_DIM * 4
NS = Namespace("bench-redis-smollm2-shape", BLOCK)


def make_payloads(n_blocks: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n_blocks):
        arrays = {}
        for layer in range(LAYERS):
            for kind in ("k", "v"):
                arrays[f"{layer}.{kind}"] = rng.standard_normal(
                    (1, KV_HEADS, BLOCK, HEAD_DIM), dtype=np.float32)
        out.append(arrays)
    return out


def cache_over(tier: object, budget: int) -> PromptCache:
    return PromptCache(CacheConfig(block_size=BLOCK, ram_budget_bytes=budget), lower=[tier],  # type: ignore[list-item]
                       write_through=True)


def fill(tier: object, tokens: list[int], payloads: list[dict[str, np.ndarray]]) -> float:
    cache = cache_over(tier, 2 * len(payloads) * BLOCK * BYTES_PER_TOKEN)
    t0 = time.perf_counter()
    cache.store(NS, tokens, len(tokens),
                lambda s, e, snap: payloads[s // BLOCK], include_partial=False)
    tier.flush()  # type: ignore[attr-defined]
    return time.perf_counter() - t0


def restore(tier: object, tokens: list[int], nbytes: int) -> float:
    cache = cache_over(tier, 2 * nbytes)
    t0 = time.perf_counter()
    hit = cache.acquire(tokens + [0], NS)
    dt = time.perf_counter() - t0
    if hit.num_tokens != len(tokens):
        raise RuntimeError(f"restored {hit.num_tokens} of {len(tokens)} tokens: {hit.miss}")
    cache.release(hit)
    return dt


def drop_files(root: Path) -> None:
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            if f.endswith(".safetensors"):
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def prefill_seconds(n_tokens: int) -> float | None:
    try:
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.models.cache import make_prompt_cache

        from promptcache.engine.models.gguf import ensure_default_model
    except ImportError as e:
        print(f"recompute skipped: {e}")
        return None
    model, _tok = load(str(ensure_default_model()))
    tokens = mx.array(np.arange(n_tokens) % 30000 + 100, dtype=mx.uint32)
    best = float("inf")
    for _ in range(2):
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        for s in range(0, n_tokens, 512):
            out = model(tokens[None, s:s + 512], cache=cache)
            mx.eval(out, [c.state for c in cache])
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=68)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--prefill", action="store_true", help="measure recompute with SmolLM2")
    ap.add_argument("--timeout-s", type=float, default=RedisConfig.timeout_s,
                    help="Redis socket timeout (raise it on a loaded machine)")
    args = ap.parse_args()
    n_tokens = args.blocks * BLOCK
    nbytes = n_tokens * BYTES_PER_TOKEN
    print(f"prefix: {args.blocks} blocks x {BLOCK} tokens, {nbytes / 1e6:.1f} MB; "
          f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    payloads = make_payloads(args.blocks)
    tokens = [int(t) for t in (np.arange(n_tokens) % 30000 + 100)]
    results: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        srv = RedisServer(Path(tmp) / "redis").start()
        try:
            rtier = RedisTier(RedisConfig(url=srv.url, queue_size=1024, timeout_s=args.timeout_s))
            print(f"redis write (put + flush): {fill(rtier, tokens, payloads):.3f} s")
            results["redis"] = [restore(rtier, tokens, nbytes) for _ in range(args.repeat)]
            st = rtier.stats()
            print(f"redis: round trips {st['round_trips']}, timeouts {st['timeouts']}")
            rtier.close()
        finally:
            srv.stop()
        stier = SSDTier(SSDConfig(path=Path(tmp) / "ssd", queue_size=1024))
        print(f"ssd write (put + flush, fsync): {fill(stier, tokens, payloads):.3f} s")
        results["ssd_warm"] = [restore(stier, tokens, nbytes) for _ in range(args.repeat)]
        cold = []
        for _ in range(args.repeat):
            drop_files(Path(tmp) / "ssd")
            cold.append(restore(stier, tokens, nbytes))
        results["ssd_cold"] = cold
        stier.close()
    if args.prefill:
        p = prefill_seconds(n_tokens)
        if p is not None:
            results["recompute"] = [p]
    print("\n| restore path | median | best | throughput (median) | runs |")
    print("| --- | --- | --- | --- | --- |")
    for name, runs in results.items():
        med = statistics.median(runs)
        print(f"| {name} | {med:.3f} s | {min(runs):.3f} s | {nbytes / med / 1e6:,.0f} MB/s | "
              f"{', '.join(f'{r:.3f}' for r in runs)} |")
    if "recompute" in results:
        rec = results["recompute"][0]
        for name in ("redis", "ssd_warm", "ssd_cold"):
            print(f"recompute / {name}: {rec / statistics.median(results[name]):.1f}x")
    print(f"redis / ssd_warm: {statistics.median(results['redis']) / statistics.median(results['ssd_warm']):.2f}")


if __name__ == "__main__":
    main()
