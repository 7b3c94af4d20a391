"""Core lookup micro-benchmark (a script, not a test).

1. Index overhead: tracemalloc over a pool of ``--mem-blocks`` blocks whose payloads
   are one shared tiny array, so what is measured is the index itself (block
   objects, hash map, children index, hashes, packed token ids).
2. Lookup time: a 128K-token prompt (2,000 blocks of 64) that matches a stored
   sequence in full, against a pool indexing ``--blocks`` blocks (1M by default).

Usage: .venv/bin/python bench/bench_lookup.py [--blocks 1000000] [--mem-blocks 200000]
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
import tracemalloc

import numpy as np

from promptcache.cache import PromptCache, matcher
from promptcache.config import CacheConfig
from promptcache.meta import Namespace

BS = 64
PROMPT_BLOCKS = 2000
SEQ_TOKENS = BS * PROMPT_BLOCKS  # 128,000 tokens
PAYLOAD = {"x": np.zeros(1, dtype=np.float32)}  # shared: payload bytes are not index overhead


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return PAYLOAD


def populate(cache: PromptCache, ns: Namespace, num_blocks: int, rng: np.random.Generator) -> list[np.ndarray]:
    seqs = []
    done = 0
    t0 = time.perf_counter()
    while done < num_blocks:
        n = min(PROMPT_BLOCKS, num_blocks - done) * BS
        seq = rng.integers(0, 150_000, size=n, dtype=np.uint32)
        cache.store(ns, seq, n, payload_for, include_partial=False)
        seqs.append(seq)
        done += n // BS
        if len(seqs) % 50 == 0:
            print(f"  stored {done:,} blocks ({time.perf_counter() - t0:.1f} s)", flush=True)
    return seqs


def measure_memory(num_blocks: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 150_000, size=SEQ_TOKENS, dtype=np.uint32)
            for _ in range(-(-num_blocks // PROMPT_BLOCKS))]
    ns = Namespace("bench-model", BS)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=10**12))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    done = 0
    for seq in seqs:
        n = min(PROMPT_BLOCKS, num_blocks - done) * BS
        cache.store(ns, seq, n, payload_for, include_partial=False)
        done += n // BS
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    blocks = cache.pool.num_blocks
    per_block = (after - before) / blocks
    token_bytes = 33 + 4 * BS  # bytes object of the packed token ids (header + data)
    return {"blocks": blocks, "per_block": per_block, "token_ids": token_bytes,
            "index_overhead": per_block - token_bytes}


def time_it(fn, repeat: int) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--mem-blocks", type=int, default=200_000)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]} on {platform.machine()} ({platform.processor() or '?'})")

    print(f"[1/2] index memory over {args.mem_blocks:,} blocks (tracemalloc)...", flush=True)
    mem = measure_memory(args.mem_blocks)
    print(f"  {mem['per_block']:.0f} B per block = {mem['token_ids']:.0f} B packed token ids "
          f"+ {mem['index_overhead']:.0f} B index overhead (target < 300 B)")

    print(f"[2/2] populating a pool with {args.blocks:,} blocks...", flush=True)
    rng = np.random.default_rng(0)
    ns = Namespace("bench-model", BS)
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=10**12))
    t0 = time.perf_counter()
    seqs = populate(cache, ns, args.blocks, rng)
    print(f"  {cache.pool.num_blocks:,} blocks in {time.perf_counter() - t0:.1f} s")
    prompt_np = np.concatenate([seqs[len(seqs) // 2], np.array([7, 8, 9], dtype=np.uint32)])
    prompt_list = prompt_np.tolist()
    m = cache.lookup(prompt_np, ns)
    assert m.num_tokens == SEQ_TOKENS, m
    gc.collect()
    results = {
        "lookup (numpy uint32 prompt)": time_it(lambda: cache.lookup(prompt_np, ns), args.repeat),
        "lookup (list[int] prompt)": time_it(lambda: cache.lookup(prompt_list, ns), args.repeat),
        "hashing 2,000 blocks (reference)": time_it(
            lambda: [matcher.hash_block(ns.root, prompt_np[i : i + BS], ()) for i in range(0, SEQ_TOKENS, BS)],
            args.repeat),
        "acquire + release (numpy prompt)": time_it(
            lambda: cache.release(cache.acquire(prompt_np, ns)), args.repeat),
    }
    print(f"{len(prompt_np):,}-token prompt ({PROMPT_BLOCKS:,} blocks) against {cache.pool.num_blocks:,} "
          "indexed blocks (median / min of %d runs):" % args.repeat)
    for name, (med, best) in results.items():
        print(f"  {name:36s} {med:7.2f} ms / {best:7.2f} ms")


if __name__ == "__main__":
    main()
