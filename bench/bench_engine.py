"""TTFT per turn of a 10-turn chat: with the cache, without it, and the floor.

The floor is the time to prefill only that turn's new tokens at its context
(plus sampling the first token), measured in this process: the history is
prefilled into a fresh cache first (untimed), then the new tokens are timed with
the same chunk boundaries the engine uses.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python bench/bench_engine.py [--model PATH] [--turns 10] [--markdown]

Targets: cached TTFT <= 1.10 x floor; lookup + restore <= 5% of TTFT.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from promptcache.cli.wiring import build_cache
from promptcache.config import CacheConfig
from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.engine import Engine
from promptcache.serving_config import EngineConfig

WORDS = (
    "cache block token prefix model layer window chunk state tier memory disk "
    "request answer question river mountain garden library window kitchen music "
    "planet ocean forest city bridge market winter summer story letter number"
).split()


def user_message(rng: random.Random, n_words: int) -> str:
    sentences = []
    while n_words > 0:
        k = min(n_words, rng.randint(6, 14))
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(k)).capitalize() + ".")
        n_words -= k
    return "Please read this note and reply briefly. " + " ".join(sentences)


class Floor:
    """Times the prefill of ``prompt[start:]`` on top of an (untimed) prefilled history.

    The history is prefilled once, in the engine's chunk boundaries; after each
    timed run the caches are trimmed back to ``start`` (KVCache.trim), so the
    runs can be interleaved with the cached requests they are compared with.
    """

    def __init__(self, model, prompt: list[int], start: int, chunk: int) -> None:
        self.model, self.prompt, self.start, self.chunk = model, prompt, start, chunk
        self.caches = make_prompt_cache(model)
        pos = 0
        while pos < start:
            end = min(start, (pos // chunk + 1) * chunk)
            model(mx.array(prompt[pos:end])[None], cache=self.caches)
            mx.eval([c.state for c in self.caches])
            pos = end
        if not can_trim_prompt_cache(self.caches):
            raise SystemExit("the floor needs a trimmable (KV) cache")

    def time_once(self) -> float:
        pos, prompt, chunk = self.start, self.prompt, self.chunk
        t0 = time.perf_counter()
        logits = None
        while pos < len(prompt):
            end = min(len(prompt), (pos // chunk + 1) * chunk)
            logits = self.model(mx.array(prompt[pos:end])[None], cache=self.caches)
            mx.eval(logits, [c.state for c in self.caches])
            pos = end
        int(mx.argmax(logits[0, -1]).item())
        elapsed = time.perf_counter() - t0
        trim_prompt_cache(self.caches, len(prompt) - self.start)
        return elapsed


def run_request(eng: Engine, tokens: list[int], use_cache: bool, max_tokens: int,
                tenant: str = "default"):
    req = GenerationRequest(prompt_tokens=tuple(tokens), sampling=SamplingParams(max_tokens=max_tokens),
                            use_cache=use_cache, session_id="bench", tenant=tenant)
    return eng.submit(req).result()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3, help="cached/floor repeats (median)")
    ap.add_argument("--markdown", action="store_true", help="print a BENCHMARKS.md section")
    args = ap.parse_args(argv)

    model_path = args.model
    if model_path is None:
        from promptcache.engine.models.gguf import ensure_default_model

        root = Path(__file__).resolve().parent.parent / ".models" / "default"
        model_path = str(ensure_default_model(root))
    ec = EngineConfig()
    cc = CacheConfig(ram_budget_bytes=2 * 1024**3)
    eng = Engine.load(model_path, ec, cc, cache=build_cache(cc))
    rng = random.Random(0)
    messages = [{"role": "system", "content": "You are a helpful assistant. Keep answers short."}]
    rows = []
    # warm up kernels
    run_request(eng, eng.render_chat([{"role": "user", "content": "hello"}]), False, 2)
    for turn in range(1, args.turns + 1):
        messages.append({"role": "user", "content": user_message(rng, rng.randint(70, 200))})
        tokens = eng.render_chat(messages)
        # the same conversation is cached under `repeats` tenants; each cached request is
        # paired with a floor measurement taken right after it (the machine is shared:
        # pairing in time keeps load changes out of the ratio)
        unc = run_request(eng, tokens, False, args.max_tokens)
        new_from = None
        runs, floors, ratios = [], [], []
        floor = None
        for i in range(args.repeats):
            r = run_request(eng, tokens, True, args.max_tokens, tenant=f"t{i}")
            if floor is None:
                new_from = r.usage.cached_tokens
                floor = Floor(eng.model, tokens, new_from, ec.prefill_chunk_tokens)
            if r.usage.cached_tokens != new_from or r.tokens != unc.tokens:
                raise SystemExit(f"turn {turn}: tenant t{i} disagrees (cached {r.usage.cached_tokens})")
            f = floor.time_once()
            runs.append(r)
            floors.append(f)
            ratios.append(r.ttft_s / f)
        cached = runs[0]
        messages.append({"role": "assistant", "content": cached.text})
        ttft = statistics.median(r.ttft_s for r in runs)
        lr = statistics.median(r.lookup_s + r.restore_s for r in runs)
        floor_s = statistics.median(floors)
        rows.append({
            "turn": turn, "prompt": len(tokens), "cached": new_from, "new": len(tokens) - new_from,
            "ttft_cached": ttft, "ttft_uncached": unc.ttft_s, "floor": floor_s,
            "ratio": statistics.median(ratios), "lookup_restore": lr,
            "lr_pct": statistics.median((r.lookup_s + r.restore_s) / r.ttft_s for r in runs),
        })
        r = rows[-1]
        print(f"turn {turn:2d}: prompt {r['prompt']:5d} cached {r['cached']:5d} new {r['new']:4d} | "
              f"TTFT cached {r['ttft_cached']*1e3:7.1f} ms, uncached {r['ttft_uncached']*1e3:7.1f} ms, "
              f"floor {r['floor']*1e3:7.1f} ms | cached/floor {r['ratio']:.2f} | "
              f"lookup+restore {r['lookup_restore']*1e3:5.1f} ms ({r['lr_pct']:.1%})", file=sys.stderr)
    eng.close()
    if args.markdown:
        preload = "openblas" in os.environ.get("LD_PRELOAD", "")
        print("## Engine: TTFT per turn\n")
        print(f"Command: `{'LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ' if preload else ''}"
              f".venv/bin/python bench/bench_engine.py --markdown`  ")
        print(f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores (shared), mlx {mx.__version__} CPU, "
              f"OpenBLAS preloaded: {'yes' if preload else 'no'}  ")
        print(f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  ")
        print(f"Model: SmolLM2-135M-Instruct (float32); block {cc.block_size}, prefill chunk "
              f"{ec.prefill_chunk_tokens}; max_tokens {args.max_tokens}; cached TTFT, lookup+restore and floor: "
              f"median of {args.repeats} (cached: the same chat under {args.repeats} tenants); uncached: one run\n")
        print("| turn | prompt | cached | new | TTFT cached (ms) | TTFT uncached (ms) | floor (ms) "
              "| cached / floor (median of paired ratios) | lookup+restore (ms) | % of TTFT |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['turn']} | {r['prompt']} | {r['cached']} | {r['new']} | {r['ttft_cached']*1e3:.1f} "
                  f"| {r['ttft_uncached']*1e3:.1f} | {r['floor']*1e3:.1f} | {r['ratio']:.2f} "
                  f"| {r['lookup_restore']*1e3:.1f} | {r['lr_pct']:.1%} |")
        later = rows[1:]
        print(f"\nTurns 2-{len(rows)}: mean cached/floor {statistics.mean(r['ratio'] for r in later):.2f}, "
              f"max {max(r['ratio'] for r in later):.2f}; mean lookup+restore "
              f"{statistics.mean(r['lr_pct'] for r in later):.1%} of TTFT; "
              f"uncached/cached at turn {rows[-1]['turn']}: "
              f"{rows[-1]['ttft_uncached'] / rows[-1]['ttft_cached']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
