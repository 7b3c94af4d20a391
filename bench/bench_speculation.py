"""Speculative decoding from history, on vs off, in process (one greedy stream).

Scenarios: "edit" (the model is asked to return a Python module from its prompt with one
class renamed: most of the reply copies the prompt) and "chat" (a short poem: nothing to
copy). Each mode runs twice, interleaved (off, suffix, off, suffix), so machine load hits
both alike. Reports decode tok/s, the forwards per reply (decode steps: the quantity
speculation reduces, independent of the machine's load), drafted / accepted tokens, and
whether the tokens equal those of the run without speculation.

``--verify-cost``: instead, the cost of one verify forward of k = 1..16 draft tokens
(a forward of k + 1 positions, one stream, over the edit prompt's KV) in decode steps
(a forward of 1 position): the fastest of ``--repeats`` each, the cache trimmed back
after each; and the engine's fitted model (engine/speculation/cost.py) beside it.

``--verify-cost --rows 1,2,4,8``: the same for a batch: a verify forward of ``rows`` rows
at k = 1, 2, 4, 8, 16 over a 1,000-token context per row, in decode steps of the same rows
(and a decode step's own time), the fastest of ``--repeats``.

After each run with speculation: the gate's verify cost in decode steps at k = 1, 2, 4, 8,
16 (the startup fit corrected by the forwards timed during the runs so far).

Usage: .venv/bin/python bench/bench_speculation.py [--max-tokens 160] [--model PATH]
       [--spec-verify-cost auto|X|C1,C2,...] [--verify-cost [--repeats 5] [--rows 1,2,4,8]]
(with OpenBLAS: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0)
"""

from __future__ import annotations

import argparse
import inspect
from typing import Any

from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.engine.models.gguf import ensure_default_model
from promptcache.engine.speculation import drafts as drafts_module
from promptcache.serving_config import EngineConfig


def scenarios() -> dict[str, list[dict[str, Any]]]:
    source = inspect.getsource(drafts_module)[:3000]
    return {
        "edit": [{"role": "user", "content": "Here is a Python module:\n\n```python\n" + source
                  + "\n```\n\nRewrite the module exactly, but rename the class SequenceDrafts "
                  "to HistoryDrafts. Output only the code."}],
        "chat": [{"role": "user", "content": "Write a short poem about the sea and the wind."}],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-draft", type=int, default=8)
    ap.add_argument("--min-match", type=int, default=3)
    ap.add_argument("--verify-cost", action="store_true")
    ap.add_argument("--spec-verify-cost", default="auto",
                    help="the gate's verify cost (as promptcache serve --spec-verify-cost)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rows", default=None, help="with --verify-cost: batch sizes, e.g. 1,2,4,8")
    args = ap.parse_args()
    path = args.model or ensure_default_model()
    if args.verify_cost and args.rows:
        verify_cost_rows(path, [int(n) for n in args.rows.split(",")], args.repeats)
        return
    if args.verify_cost:
        verify_cost(path, args.repeats)
        return
    reference: dict[str, list[int]] = {}
    for mode in ("off", "suffix", "off", "suffix"):
        cfg = EngineConfig(speculation=mode, spec_max_draft=args.max_draft,
                           spec_min_match=args.min_match,
                           spec_verify_cost=args.spec_verify_cost)
        eng = Engine.load(path, cfg, CacheConfig(), cache=None)
        try:
            for name, messages in scenarios().items():
                tokens = eng.render_chat(messages)
                eng.generate(tokens, max_tokens=4)  # warm-up
                before = eng.counters.to_dict()
                r = eng.generate(tokens, max_tokens=args.max_tokens)
                after = eng.counters.to_dict()
                d = {k: after[k] - before[k] for k in
                     ("decode_steps", "spec_drafted", "spec_accepted", "spec_gated",
                      "spec_paused")}
                same = reference.setdefault(name, r.tokens) == r.tokens
                print(f"{mode:6s} {name:4s} prompt {len(tokens):4d}  tokens {len(r.tokens)}  "
                      f"decode {len(r.tokens) / r.decode_s:6.2f} tok/s  "
                      f"forwards {d['decode_steps']:3d}  drafted {d['spec_drafted']:3d}  "
                      f"accepted {d['spec_accepted']:3d}  gated {d['spec_gated']:3d}  "
                      f"paused {d['spec_paused']}  identical {same}", flush=True)
                if mode == "suffix":  # the gate's cost after the online correction
                    print(f"       verify cost (decode steps): "
                          f"{eng.engine_stats()['spec_verify_cost']}", flush=True)
        finally:
            eng.close()


def timed_forward(model: Any, x: Any, cache: Any, width: int) -> float:
    """Seconds of one forward of ``x``'s first ``width`` positions over ``cache``, which is
    trimmed back after it."""
    import time

    import mlx.core as mx

    t0 = time.perf_counter()
    mx.eval(model(x[:, :width], cache=cache))
    dt = time.perf_counter() - t0
    for c in cache:
        c.trim(width)
    return dt


def verify_cost(path: Any, repeats: int) -> None:

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from promptcache.engine.speculation.cost import measure_verify_cost

    eng = Engine.load(path, EngineConfig(), CacheConfig(), cache=None)
    try:
        model = eng._ctx.model
        tokens = eng.render_chat(scenarios()["edit"])
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([tokens], dtype=mx.uint32), cache=cache))
        x = mx.array([tokens[:17]], dtype=mx.uint32)

        def once(width: int) -> float:
            return timed_forward(model, x, cache, width)

        once(1)
        base = min(once(1) for _ in range(repeats))
        fitted = measure_verify_cost(model, eng._ctx.vocab_size)
        print(f"prompt {len(tokens)} tokens; one position: {base * 1000:.1f} ms")
        print("| k | forward ms | in decode steps | fitted (spec_cost) |")
        print("| --- | --- | --- | --- |")
        for k in range(1, 17):
            t = min(once(k + 1) for _ in range(repeats))
            print(f"| {k} | {t * 1000:.1f} | {t / base:.2f} | {fitted.relative(1, k + 1):.2f} |",
                  flush=True)
    finally:
        eng.close()


def verify_cost_rows(path: Any, rows_list: list[int], repeats: int, context: int = 1000) -> None:

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    eng = Engine.load(path, EngineConfig(), CacheConfig(), cache=None)
    try:
        model, vocab = eng._ctx.model, eng._ctx.vocab_size
        ks = (1, 2, 4, 8, 16)
        print(f"context {context} tokens per row; fastest of {repeats}")
        print("| rows | decode step ms | " + " | ".join(f"k={k}" for k in ks) + " |")
        print("| --- | --- | " + " | ".join("---" for _ in ks) + " |")
        for rows in rows_list:
            cache = make_prompt_cache(model)
            x = mx.array([[(i * 7 + r) % (vocab - 20) + 10 for i in range(context)]
                          for r in range(rows)], dtype=mx.uint32)
            mx.eval(model(x, cache=cache))

            def once(width: int, x: Any = x, cache: Any = cache) -> float:
                return timed_forward(model, x, cache, width)

            once(1)
            once(3)
            base = min(once(1) for _ in range(repeats))
            cells = [f"{min(once(k + 1) for _ in range(repeats)) / base:.2f}" for k in ks]
            print(f"| {rows} | {base * 1000:.0f} | " + " | ".join(cells) + " |", flush=True)
    finally:
        eng.close()


if __name__ == "__main__":
    main()
