"""Speculation in a decode batch, in process: E2-E5's streams (``promptcache bench``'s
plans) submitted together to one engine, off and on.

Each request's prompt is stored first (``prefill_only``), so the timed submit restores it
from the cache and what is measured is decode: aggregate decode tok/s = Σ tokens /
(last end − last first token), the decode steps, and the speculation counters; every
speculative reply is checked against the reply without speculation.

Usage: .venv/bin/python bench/bench_spec_batch.py [--scenario E5] [--streams 8]
       [--round 1] [--modes off,suffix]
(with OpenBLAS: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0)
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from harness.concurrent_plans import build
from promptcache.config import CacheConfig
from promptcache.engine.api import GenerationRequest, GenerationResult, SamplingParams
from promptcache.engine.engine import Engine
from promptcache.engine.models.gguf import ensure_default_model
from promptcache.serving_config import EngineConfig


def watch(handle: Any, i: int, first: list[float], end: list[float],
          tokens: list[list[int]]) -> None:
    """Stream ``i``'s first token and end times, and its tokens."""
    for ev in handle.events():
        if isinstance(ev, GenerationResult):
            end[i], tokens[i] = time.perf_counter(), ev.tokens
        elif not first[i]:
            first[i] = time.perf_counter()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="E5")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--round", type=int, default=1, help="E5: 0 turn 1, 1 turn 2")
    ap.add_argument("--modes", default="off,suffix")
    ap.add_argument("--max-tokens", type=int, default=160)
    a = ap.parse_args()
    plan = build(a.scenario, streams=[a.streams])
    jobs = plan.rounds[min(a.round, len(plan.rounds) - 1)]
    path = ensure_default_model()
    reference: list[list[int]] | None = None
    for mode in a.modes.split(","):
        eng = Engine.load(path, EngineConfig(speculation=mode), CacheConfig())
        try:
            prompts = [eng.render_chat(list(stream[0].messages)) for stream in jobs]
            for p in prompts:
                eng.submit(GenerationRequest(tuple(p), SamplingParams(max_tokens=1),
                                             prefill_only=True)).result()
            before = eng.counters.to_dict()
            handles = [eng.submit(GenerationRequest(tuple(p), SamplingParams(
                max_tokens=a.max_tokens, temperature=0.0))) for p in prompts]
            n = len(handles)
            first: list[float] = [0.0] * n
            end: list[float] = [0.0] * n
            tokens: list[list[int]] = [[] for _ in range(n)]
            threads = [threading.Thread(target=watch, args=(h, i, first, end, tokens))
                       for i, h in enumerate(handles)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            after = eng.counters.to_dict()
            d = {k: after[k] - before[k] for k in after
                 if k.startswith(("spec_", "decode_")) and after[k] != before[k]}
            total = sum(len(t) for t in tokens)
            same = "" if reference is None else f"  identical {reference == tokens}"
            reference = reference or tokens
            t0 = min(first)
            ends = ", ".join(f"{e - t0:.1f}" for e in sorted(end))
            print(f"{mode:6s} {a.scenario} {n} streams: {total} tokens, aggregate decode "
                  f"{total / (max(end) - max(first)):6.2f} tok/s{same}\n       {d}\n"
                  f"       rows end at (s after the first token): {ends}", flush=True)
        finally:
            eng.close()


if __name__ == "__main__":
    main()
