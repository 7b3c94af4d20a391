"""Long sessions: one conversation grown to 8K, 16K, 32K, ... tokens; at each size the
next turn (``--new`` new tokens, first token only) is timed

- from the **live state** (``engine/live.py``: the previous turn's caches, nothing
  restored),
- from the **RAM tier** (the live state released first, as under memory pressure),
- from the **SSD** after a clean shutdown and a restart (the page cache dropped),
- from **Redis** (``--redis``: a new engine whose RAM and SSD are empty, a redis-server
  holding the blocks),

beside the **floor** (mlx-lm alone: the prefill of only the new tokens on a cache that
already holds the conversation), **one contiguous copy** of the bytes a restore writes,
and **one sequential read** (``dd``, page cache dropped) of as many bytes from the SSD
folder's file system. The targets of issue 41: live <= 1.05x the floor; RAM <= the
floor + 1.2x the copy; SSD <= 1.2x (the read + the floor).

The model: mlx-lm's own class with random float32 weights (a CPU has no fast bfloat16
matmul), the embedded default's structure (``--shape smollm2``: 30 layers, 9 query /
3 KV heads of 64) or a smaller one (``--shape small``: 8 layers, 4 / 2 heads of 64),
both with a 128K window; the vocabulary is the embedded default's tokenizer's.

    PYTHONPATH=src:bench python bench/bench_long_session.py [--shape small] \\
        [--sizes 8192,16384,32768] [--new 256] [--redis] [--gap 1] [--out FILE.json]

Each turn is sent ``--gap`` seconds after the previous one ended (an agent's tool call, a
user's reading: what the previous request left running, its state's copy into a live
state and its saves, is done by then).

Prints a markdown table (times in seconds) and, with ``--out``, the numbers as JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from page_cache import drop_cache

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "small": dict(hidden_size=256, num_hidden_layers=8, intermediate_size=768,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def build_model(shape: str, vocab: int, max_positions: int) -> Any:
    module = importlib.import_module("mlx_lm.models.llama")
    args = module.ModelArgs(model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5,
                            max_position_embeddings=max_positions, rope_theta=1e6,
                            tie_word_embeddings=True, **SHAPES[shape])
    model = module.Model(args)
    mx.random.seed(0)
    for _, m in model.named_modules():
        for key, value in list(m.items()):
            if isinstance(value, mx.array):
                m[key] = (mx.ones(value.shape) if isinstance(m, nn.RMSNorm)
                          else 0.02 * mx.random.normal(value.shape))
    mx.eval(model.parameters())
    return model


def timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def copy_time(nbytes: int) -> float:
    """One contiguous copy of ``nbytes`` (read + write once), the fastest of 3."""
    a = mx.zeros((max(1, nbytes // 4),), dtype=mx.float32)
    mx.eval(a)
    best = float("inf")
    for _ in range(3):
        def run() -> None:
            mx.eval(a + 0)
        best = min(best, timed(run))
    return best


def read_time(folder: Path, nbytes: int) -> float:
    """One sequential read (dd, 8 MB blocks) of a file of ``nbytes`` in ``folder``,
    dropped from the page cache first."""
    path = folder / "dd.bin"
    with open(path, "wb") as f:
        chunk = os.urandom(1 << 20)
        for _ in range(max(1, nbytes >> 20)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    drop_cache([path])
    t = time.perf_counter()
    subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M"], check=True,
                   capture_output=True)
    took = time.perf_counter() - t
    path.unlink()
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="small")
    ap.add_argument("--sizes", default="8192,16384,32768")
    ap.add_argument("--new", type=int, default=256, help="new tokens of each next turn")
    ap.add_argument("--chunk", type=int, default=512, help="--prefill-chunk-tokens")
    ap.add_argument("--redis", action="store_true", help="also from a redis-server")
    ap.add_argument("--repeats", type=int, default=3, help="the fastest of this many")
    ap.add_argument("--gap", type=float, default=1.0,
                    help="seconds before each turn (think time; the floor has none)")
    ap.add_argument("--dir", default=None, help="folder for the SSD tier (default: a temp)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from promptcache.cli.wiring import build_cache
    from promptcache.config import CacheConfig, RedisConfig, SSDConfig
    from promptcache.engine import adapters
    from promptcache.engine.api import GenerationRequest, SamplingParams
    from promptcache.engine.engine import Engine
    from promptcache.engine.models.gguf import ensure_default_model
    from promptcache.serving_config import EngineConfig

    sizes = [int(s) for s in a.sizes.split(",")]
    longest = max(sizes) + 4 * a.new + 64
    tokenizer = load_tokenizer(ensure_default_model())
    vocab = len(tokenizer._tokenizer)
    model = build_model(a.shape, vocab, 131072)
    probe = make_prompt_cache(model)
    mx.eval(model(mx.array([[1]]), cache=probe))
    per_token = sum(int(x.nbytes) // int(x.shape[2]) for _, x in adapters.state_arrays(probe))
    kv_max = per_token * longest
    log(f"shape {a.shape}: {per_token} B of KV per token, {kv_max / 1e9:.2f} GB at "
        f"{longest} tokens; mlx {mx.__version__} on {mx.default_device()}; "
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}")
    root = Path(a.dir or tempfile.mkdtemp(prefix="pc-long-"))
    ec = EngineConfig(speculation="off", prefill_chunk_tokens=a.chunk)
    cc = CacheConfig(ram_budget_bytes=max(1 << 30, 4 * kv_max))
    redis_srv = None
    rc = None
    if a.redis:
        from harness.redisproc import RedisServer

        redis_srv = RedisServer(root / "redis").start()
        rc = RedisConfig(url=redis_srv.url, timeout_s=5.0, connect_timeout_s=1.0,
                         policy="write_through")

    def engine(ssd_dir: Path | None, with_redis: bool) -> Engine:
        ssd = (SSDConfig(path=ssd_dir, policy="write_back", fsync=False,
                         budget_bytes=max(1 << 30, 4 * kv_max))
               if ssd_dir is not None else None)
        return Engine(model, tokenizer, model_id="random", fingerprint=f"long-{a.shape}",
                      context_length=longest, vocab_size=vocab, engine_config=ec,
                      cache_config=cc,
                      cache=build_cache(cc, ssd, rc if with_redis else None))

    def ask(eng: Engine, tokens: list[int]) -> Any:
        # a user's or an agent's think time before each turn: what the previous request
        # left running (its state's copy into a live state, its saves) is done
        time.sleep(a.gap)
        r = eng.submit(GenerationRequest(prompt_tokens=tuple(tokens),
                                         sampling=SamplingParams(max_tokens=1),
                                         session_id="long")).result()
        if r.error:
            raise RuntimeError(r.error)
        return r

    rng = random.Random(0)

    def words(n: int) -> list[int]:
        return [rng.randrange(10, vocab - 10) for _ in range(n)]

    eng = None
    try:
        ssd_dir = root / "blocks"
        eng = engine(ssd_dir, a.redis)
        ns = eng.namespace()
        history = words(sizes[0])
        cold = ask(eng, history)
        log(f"cold prefill of {sizes[0]}: {cold.ttft_s:.2f} s")
        history += list(cold.tokens)
        rows: list[dict[str, Any]] = []
        for n in sizes:
            if len(history) < n:  # a turn that grows the conversation (from the live state)
                add = words(n - len(history))
                grown = ask(eng, history + add)
                history += add + list(grown.tokens)
            row: dict[str, Any] = {"size": len(history), "cold_s": cold.ttft_s,
                                   "cold_size": sizes[0]}
            # each next turn a.repeats times, the fastest (a turn after the first trims the
            # previous one's state back to the conversation: a retry with other new tokens)
            lives = [ask(eng, history + words(a.new)) for _ in range(a.repeats)]
            live = min(lives, key=lambda r: r.ttft_s)
            row.update(live_s=live.ttft_s, live_by_tier=dict(live.usage.cached_by_tier))
            rams = []
            for _ in range(a.repeats):
                eng.release_live()
                before = eng.engine_stats()
                rams.append(ask(eng, history + words(a.new)))
                after = eng.engine_stats()
            ram = min(rams, key=lambda r: r.ttft_s)
            copied = after["restore_copy_bytes"] - before["restore_copy_bytes"]
            row.update(ram_s=ram.ttft_s, ram_restore_s=ram.restore_s,
                       ram_by_tier=dict(ram.usage.cached_by_tier), copy_bytes=copied,
                       copies=after["restore_copies"] - before["restore_copies"],
                       copy_s=copy_time(copied))
            # the floor: mlx-lm alone, the new tokens on a cache holding the conversation
            hit = eng.cache.acquire(history, ns)
            m = min(int(hit.num_tokens), len(history) - 1)
            state = adapters.restore(model, hit.blocks, m, reserve=len(history) - m + a.new + 1)
            eng.cache.release(hit)
            rest = mx.array(history[m:] + words(a.new))[None]

            def floor(state: Any = state, rest: Any = rest) -> None:
                # as the engine prefills: the chunk's caches only (its logits are never
                # computed), then the last token alone for its logits
                model(rest[:, :-1], cache=state)
                mx.eval([x for _, x in adapters.state_arrays(state)])
                mx.eval(model(rest[:, -1:], cache=state)[0, -1])

            times = []
            for _ in range(a.repeats + 1):  # the first warms the kernels of these widths
                times.append(timed(floor))
                trim_prompt_cache(state, int(rest.shape[1]))
            row["floor_s"] = min(times[1:])
            row["floor_new"] = int(rest.shape[1])
            del state
            # the SSD after a clean shutdown and a restart, page cache dropped
            row["shutdown_s"] = timed(eng.close)
            stored = sum(p.stat().st_size for p in ssd_dir.rglob("*") if p.is_file())
            row["page_cache"] = drop_cache([p for p in ssd_dir.rglob("*") if p.is_file()])
            mx.clear_cache()
            t = time.perf_counter()
            eng = engine(ssd_dir, a.redis)
            row["restart_s"] = time.perf_counter() - t
            ssd = ask(eng, history + words(a.new))
            row.update(ssd_s=ssd.ttft_s, ssd_restore_s=ssd.restore_s, ssd_bytes=stored,
                       ssd_by_tier=dict(ssd.usage.cached_by_tier),
                       read_s=read_time(root, stored))
            if a.redis:  # a new server: nothing in its RAM or SSD, Redis holds the blocks
                other = engine(None, True)
                red = ask(other, history + words(a.new))
                row.update(redis_s=red.ttft_s, redis_by_tier=dict(red.usage.cached_by_tier))
                other.close()
            log(f"N={row['size']}: live {row['live_s']:.3f} s {row['live_by_tier']}, RAM {row['ram_s']:.3f} s, "
                f"SSD {row['ssd_s']:.3f} s, floor {row['floor_s']:.3f} s, copy "
                f"{row['copy_s']:.3f} s ({copied / 1e6:.0f} MB), dd {row['read_s']:.3f} s "
                f"({stored / 1e6:.0f} MB)"
                + (f", Redis {row['redis_s']:.3f} s" if a.redis else ""))
            rows.append(row)
            if a.out:
                Path(a.out).write_text(json.dumps({"shape": a.shape, "new": a.new,
                                                   "per_token_bytes": per_token,
                                                   "rows": rows}, indent=1))
        print(table(rows, a.redis))
    finally:
        if eng is not None:
            eng.close()
        if redis_srv is not None:
            redis_srv.stop()
        shutil.rmtree(root, ignore_errors=True)
    return 0


def table(rows: list[dict[str, Any]], redis: bool) -> str:
    head = ("| tokens | floor | live | live / floor | RAM | (RAM - floor) / copy | copy "
            "| SSD after restart | SSD / (dd + floor) | dd | " + ("Redis | " if redis else "")
            + "cold prefill |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['floor_s']:.3f} | {r['live_s']:.3f} | "
            f"{r['live_s'] / r['floor_s']:.2f} | {r['ram_s']:.3f} | "
            f"{(r['ram_s'] - r['floor_s']) / r['copy_s']:.2f} | {r['copy_s']:.3f} | "
            f"{r['ssd_s']:.3f} | {r['ssd_s'] / (r['read_s'] + r['floor_s']):.2f} | "
            f"{r['read_s']:.3f} | " + (f"{r['redis_s']:.3f} | " if redis else "")
            + f"{r['cold_s']:.2f} ({r['cold_size']}) |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
