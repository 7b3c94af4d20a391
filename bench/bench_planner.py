"""The restore-or-recompute planner against load-only and recompute-only (issue 41).

A cached prefix of each ``--sizes`` size sits on the SSD tier only (the RAM tier and the
live state dropped, the page cache of the SSD's files dropped with
``posix_fadvise(DONTNEED)``); its next turn (the prefix + ``--new`` new tokens, greedy,
``--max-tokens``) is timed to its first token with the plan forced to ``load``, forced
to ``recompute``, and ``auto``, alternating, ``--repeats`` rounds, the median of each.
The planner's rates are its own, measured online by the same engine from the requests
before (a warm-up request per size, then the forced ones of each round): nothing is
injected. Each request's greedy tokens are checked against a full prefill's (``use_cache=False``).

The model: mlx-lm's llama class with random float32 weights of a shape whose KV is
large per token and whose compute is small (``--shape``, see ``SHAPES``), so that
loading and recomputing a prefix of a few hundred tokens take comparable times on this
CPU (prefill grows with the square of the prefix, loading linearly: they meet at one
size, which depends on the tier's and the CPU's speeds, not much on the shape).

    PYTHONPATH=src:bench python bench/bench_planner.py [--sizes 256,512,768,1024] \\
        [--shape wide] [--repeats 5] [--out FILE.json]

Prints a Markdown table (seconds; "auto / best": of the medians; "per round": the
median of each round's auto / its better of load and recompute) and, with ``--out``, the numbers as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from page_cache import drop_files

MODES = ("load", "recompute", "auto")
SPLICE_KEYS = ("splices", "splices_late", "splices_given_up")
SHAPES: dict[str, dict[str, int]] = {
    # 16 layers x 8 KV heads x 256 x float32: 256 KB of KV per token over a residual
    # stream of 16 (no real model: the least compute per byte of KV llama allows)
    "wide": dict(hidden_size=16, num_hidden_layers=16, intermediate_size=16,
                 num_attention_heads=8, num_key_value_heads=8, head_dim=256),
    # the smoke test's: 2 layers, 2 KB per token
    "tiny": dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                 num_attention_heads=2, num_key_value_heads=2, head_dim=64),
}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def random_llama(shape: str, vocab: int, window: int) -> Any:
    """mlx-lm's llama class of ``shape``, random float32 weights (seed 0)."""
    from mlx_lm.models import llama

    from harness.long_run import randomize

    return randomize(llama.Model(llama.ModelArgs.from_dict(dict(
        model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5, rope_theta=1e6,
        max_position_embeddings=window, tie_word_embeddings=True, **SHAPES[shape]))))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="wide")
    ap.add_argument("--sizes", default="256,512,768,1024", help="prefix tokens")
    ap.add_argument("--new", type=int, default=16, help="new tokens of each next turn")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--block", type=int, default=64, help="--block-size")
    ap.add_argument("--chunk", type=int, default=128, help="--prefill-chunk-tokens")
    ap.add_argument("--repeats", type=int, default=5, help="rounds; the median of each")
    ap.add_argument("--gap", type=float, default=0.3, help="seconds before each request")
    ap.add_argument("--tokenizer", default=None,
                    help="a model folder's tokenizer (default: the embedded default's)")
    ap.add_argument("--tier", choices=("ssd", "redis"), default="ssd",
                    help="the lower tier: the SSD (page cache dropped) or a redis-server")
    ap.add_argument("--dir", default=None, help="folder for the tier (default: a temp)")
    ap.add_argument("--out", default=None)
    return ap


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of ``rows`` (one per size)."""
    out = ["| prefix tokens | load s | recompute s | recompute / load | auto s "
           "| auto / best | per round | auto's plans | identical |", "|" + "---|" * 9]
    for r in rows:
        best = min(r["load_s"], r["recompute_s"])
        plans = ", ".join(f"{k} x{n}" for k, n in sorted(r["auto_plans"].items()))
        out.append(f"| {r['size']} | {r['load_s']:.3f} | {r['recompute_s']:.3f} "
                   f"| {r['recompute_s'] / r['load_s']:.2f} | {r['auto_s']:.3f} "
                   f"| {r['auto_s'] / best:.2f} | {per_round(r):.2f} | {plans} "
                   f"| {r['identical']} |")
    return "\n".join(out)


def per_round(row: dict[str, Any]) -> float:
    """The median over rounds of auto / the better of load and recompute in that round
    (a round's three requests ran one after the other, under the same load)."""
    t = row["times"]
    return statistics.median(x / min(lo, re) for x, lo, re in
                             zip(t["auto"], t["load"], t["recompute"], strict=True))


def run(argv: list[str] | None = None) -> dict[str, Any]:
    a = parser().parse_args(argv)
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from promptcache.cli.wiring import build_cache
    from promptcache.config import CacheConfig, RedisConfig, SSDConfig
    from promptcache.engine.api import GenerationRequest, SamplingParams
    from promptcache.engine.engine import Engine
    from promptcache.serving_config import EngineConfig

    if a.tokenizer is None:
        from promptcache.engine.models.gguf import ensure_default_model
        a.tokenizer = str(ensure_default_model())
    tokenizer = load_tokenizer(Path(a.tokenizer))
    vocab = len(tokenizer._tokenizer)
    sizes = [int(s) for s in a.sizes.split(",")]
    window = max(sizes) + a.new + a.max_tokens + 64
    model = random_llama(a.shape, vocab, window)
    root = Path(a.dir or tempfile.mkdtemp(prefix="pc-planner-"))
    ssd_dir = root / "blocks"
    cc = CacheConfig(block_size=a.block, ram_budget_bytes=4 << 30)
    ssd, rc, server = None, None, None
    if a.tier == "ssd":
        ssd = SSDConfig(path=ssd_dir, policy="write_through", fsync=False,
                        budget_bytes=16 << 30)
    else:
        from harness.redisproc import RedisServer

        server = RedisServer(root / "redis").start()
        rc = RedisConfig(url=server.url, timeout_s=30.0, connect_timeout_s=1.0,
                         policy="write_through")
    eng = Engine(model, tokenizer, model_id="bench-planner", fingerprint=f"planner-{a.shape}",
                 context_length=window, vocab_size=vocab,
                 engine_config=EngineConfig(speculation="off", prefill_chunk_tokens=a.chunk),
                 cache_config=cc, cache=build_cache(cc, ssd, rc))
    cache = eng.cache
    if cache is None:
        raise RuntimeError("the engine has no cache")
    rng = random.Random(0)
    ids = range(3, vocab)

    def ask(tokens: list[int], mode: str) -> Any:
        eng.release_live()
        cache.flush(60)
        cache.evict()
        if a.tier == "ssd":
            drop_files([p for p in ssd_dir.rglob("*") if p.is_file()])
        eng.planner.policy = mode
        time.sleep(a.gap)
        r = eng.submit(GenerationRequest(prompt_tokens=tuple(tokens),
                                         sampling=SamplingParams(max_tokens=a.max_tokens))
                       ).result()
        if r.error:
            raise RuntimeError(r.error)
        return r

    rows: list[dict[str, Any]] = []
    try:
        for n in sizes:
            prefix = [rng.choice(ids) for _ in range(n)]
            first = ask(prefix + [rng.choice(ids) for _ in range(a.new)], "recompute")
            log(f"{n} tokens: first prefill {first.ttft_s:.3f} s")
            times: dict[str, list[float]] = {m: [] for m in MODES}
            # each request's lookup (the load's tier reads), restore, prefill seconds
            phases: dict[str, list[list[float]]] = {m: [] for m in MODES}
            plans: dict[str, int] = {}
            described: list[str] = []
            spliced: list[list[int]] = []
            identical = True
            for i in range(a.repeats):
                order = MODES[i % 3:] + MODES[:i % 3]  # alternating, each first in turn
                # each its own new tokens (a real next turn: none of them cached)
                prompts = {m: prefix + [rng.choice(ids) for _ in range(a.new)] for m in order}
                got, splices = {}, {}
                for m in order:
                    before = eng.engine_stats()
                    got[m] = ask(prompts[m], m)
                    after = eng.engine_stats()
                    splices[m] = [after[k] - before[k] for k in SPLICE_KEYS]
                for m, r in got.items():
                    ref = eng.generate(prompts[m], max_tokens=a.max_tokens, use_cache=False)
                    identical &= r.tokens == ref.tokens
                    times[m].append(r.ttft_s)
                    phases[m].append([r.lookup_s, r.restore_s, r.prefill_s])
                    want = {"load": n, "recompute": 0}.get(m)
                    if want is not None and r.usage.cached_tokens != want:
                        raise RuntimeError(f"{m}: {r.usage.cached_tokens} tokens cached, "
                                           f"not {want} ({r.usage.restore_plan})")
                auto = got["auto"].usage.restore_plan
                described.append(auto)
                spliced.append(splices["auto"])
                kind = auto.split("/")[0] + ("" if "/auto[" in auto else
                                             "/" + auto.split("/")[1].split("[")[0])
                plans[kind] = plans.get(kind, 0) + 1
                log(f"{n} tokens, round {i + 1}: " + ", ".join(
                    f"{m} {got[m].ttft_s:.3f} s" for m in order) + f"; auto: {auto}, (splices, late, given up) {splices['auto']}")
            row = {"size": n, "first_s": first.ttft_s, "times": times, "phases": phases,
                   **{f"{m}_s": statistics.median(times[m]) for m in MODES},
                   "auto_plans": plans, "auto_described": described,
                   "auto_splices": spliced,
                   "identical": identical}
            rows.append(row)
        stats = eng.engine_stats()
    finally:
        eng.close()
        if server is not None:
            server.stop()
    keys = ("restore_plans_by_kind", "restore_plans_by_why", "splices", "spliced_tokens",
            "splices_late", "splices_given_up", "restore_rates")
    result = {"shape": a.shape, "tier": a.tier, "kv_bytes_per_token": kv_per_token(a.shape),
              "block": a.block, "chunk": a.chunk, "new": a.new, "repeats": a.repeats,
              "rows": rows, "engine": {k: stats[k] for k in keys}}
    rates = stats["restore_rates"]
    log(f"the planner's fits: reads {rates['reads']}, split {rates.get('split')}")
    print(table(rows))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    return result


def kv_per_token(shape: str) -> int:
    s = SHAPES[shape]
    return 2 * 4 * s["num_hidden_layers"] * s["num_key_value_heads"] * s["head_dim"]


if __name__ == "__main__":
    run()
