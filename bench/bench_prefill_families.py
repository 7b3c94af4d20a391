"""Prefill of 4 simultaneous requests per model family: batched vs one at a time.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python bench/bench_prefill_families.py [--size tiny|wide] [--families ...]

In process (the Engine, no HTTP, no cache: ``use_cache=False``, so only the model's
work is timed), one model per family of ``tiny_families`` (the architecture matrix's
structure: sliding windows, gated delta nets, Mamba2, MLA, ``CacheList``, MoE, 4-bit):

- batched: the 4 prompts are submitted together; the engine prefills them in one
  forward per chunk (``engine/requests/prefill.py``) when ``mlx_compat.can_batch_prefill``
  allows it (every family but nemotron_h), else one chunk per step each;
- one at a time: each prompt submitted after the previous one finished (the
  per-request path, what these families got before).

Each request asks for 1 token (``max_tokens=1``: the wall time until every first
token is out). The first tokens of both ways are compared (greedy: they must be
equal). ``--size tiny`` is the matrix model (hidden 64: per-forward overhead
dominates); ``--size wide`` the same structure with hidden 512, 8 heads of 64 (built
once into ``$PROMPTCACHE_TEST_MODELS`` or ``.models``).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from promptcache.config import CacheConfig
from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.engine import Engine
from promptcache.serving_config import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny test models
from models import models_root  # noqa: E402
from models.tiny_families import (  # noqa: E402
    FAMILIES,
    TINY_FAMILIES_VERSION,
    build_family_model,
    ensure_family_model,
)
from models.tiny_models import ensure_built  # noqa: E402

WIDE = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8,
        "head_dim": 64}
LENGTHS = (512, 384, 448, 320)  # 4 prompts of different lengths


def _model(family: str, size: str) -> Path:
    root = models_root()
    root.mkdir(parents=True, exist_ok=True)
    if size == "tiny":
        return ensure_family_model(family, root)
    return ensure_built(root / f"tiny-matrix-{family}-wide-v{TINY_FAMILIES_VERSION}",
                        lambda tmp: build_family_model(family, tmp, WIDE))


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, min(vocab, 1000), size=n)] for n in LENGTHS]


def _request(tokens: list[int], rid: str) -> GenerationRequest:
    return GenerationRequest(prompt_tokens=tuple(tokens), sampling=SamplingParams(max_tokens=1),
                             use_cache=False, request_id=rid)


def _together(eng: Engine, prompts: list[list[int]], tag: str) -> tuple[float, list[int]]:
    t = time.perf_counter()
    handles = [eng.submit(_request(p, f"{tag}-{i}")) for i, p in enumerate(prompts)]
    results = [h.result() for h in handles]
    return time.perf_counter() - t, [r.tokens[0] for r in results]


def _one_at_a_time(eng: Engine, prompts: list[list[int]], tag: str) -> tuple[float, list[int]]:
    t = time.perf_counter()
    toks = [eng.submit(_request(p, f"{tag}-{i}")).result().tokens[0]
            for i, p in enumerate(prompts)]
    return time.perf_counter() - t, toks


def bench_family(family: str, size: str, chunk: int, repeats: int) -> dict[str, Any]:
    path = _model(family, size)
    eng = Engine.load(path, EngineConfig(prefill_chunk_tokens=chunk),
                      CacheConfig(block_size=64, ram_budget_bytes=64 * 1024**2))
    try:
        prompts = _prompts(eng.vocab_size)
        _together(eng, prompts, "warm-b")
        _one_at_a_time(eng, prompts, "warm-a")
        before = eng.engine_stats()
        batched, alone = [], []
        tok_b: list[int] = []
        tok_a: list[int] = []
        for k in range(repeats):  # interleaved: load changes hit both ways alike
            s, tok_b = _together(eng, prompts, f"b{k}")
            batched.append(s)
            s, tok_a = _one_at_a_time(eng, prompts, f"a{k}")
            alone.append(s)
        after = eng.engine_stats()
    finally:
        eng.close()
    # the fastest of the repeats: on a shared machine the least disturbed run of each
    b, a = min(batched), min(alone)
    return {"family": family, "batched_s": b, "alone_s": a, "speedup": a / b,
            "batched_med": statistics.median(batched), "alone_med": statistics.median(alone),
            "rows": after["max_prefill_batch"],
            "forwards": (after["prefill_batches"] - before["prefill_batches"]) // repeats,
            "same_tokens": tok_b == tok_a}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=("tiny", "wide"), default="wide")
    ap.add_argument("--families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    preload = "openblas" in os.environ.get("LD_PRELOAD", "")
    print(f"### Batched prefill by cache kind ({args.size} models)\n")
    print(f"Command: `{'LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ' if preload else ''}"
          f".venv/bin/python bench/bench_prefill_families.py --size {args.size} "
          f"--chunk {args.chunk} --repeats {args.repeats}`  ")
    load = os.getloadavg()
    print(f"Machine: {platform.system()} {platform.machine()}, {os.cpu_count()} CPU cores shared "
          f"with other agents (load average at start {load[0]:.1f}), mlx {mx.__version__} CPU, "
          f"OpenBLAS preloaded: {'yes' if preload else 'no'}  ")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ")
    print(f"Prompts: {', '.join(map(str, LENGTHS))} tokens, chunks of {args.chunk}, "
          f"1 output token each, no cache; fastest of {args.repeats} interleaved repeats "
          f"(medians in brackets)\n")
    print("| Family | batched (s) | one at a time (s) | one at a time / batched "
          "| rows per forward | forwards per burst | same first tokens |")
    print("|---|---|---|---|---|---|---|")
    for family in args.families:
        r = bench_family(family, args.size, args.chunk, args.repeats)
        print(f"| `{r['family']}` | {r['batched_s']:.3f} ({r['batched_med']:.3f}) "
              f"| {r['alone_s']:.3f} ({r['alone_med']:.3f}) "
              f"| {r['speedup']:.2f}x | {r['rows'] or '- (alone)'} | {r['forwards']} "
              f"| {'yes' if r['same_tokens'] else 'NO'} |", flush=True)
    print(f"\nLoad average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
