"""Micro-benchmarks behind the batching engine's design decisions (no HTTP).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python bench/bench_batching.py {save,scheduler,render,profile} [--model PATH]

- ``save``: storing a long prompt chunk by chunk (the mid-prefill save point) as the engine
  does: before (the tokens re-validated and the chain re-hashed at every save) and now (one
  uint32 buffer + a ChainCursor). Synthetic KV, 256-token chunks.
- ``scheduler``: our scheduler vs mlx-lm's BatchGenerator: decode throughput at batch sizes
  1/4/8, and reading a request's state at every chunk boundary (extract_cache copies the whole
  KV; we read only the new blocks).
- ``profile``: where a step's time goes for a burst of ~225-token prompts: the bare batched
  forward (the floor), both schedulers' prefill and decode steps, a cProfile of ours.
- ``render``: a long chat's template: one render with offsets (now) vs one per message (before).
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
import numpy as np
from bench_decode_step import floor_steps
from mlx_lm.models.cache import KVCache

from promptcache.cache import ChainCursor, PromptCache
from promptcache.config import CacheConfig
from promptcache.engine.payload import adapters
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.meta import Namespace

CHUNK = 256
BLOCK = 64


def _header(title: str, command: str) -> None:
    preload = "openblas" in os.environ.get("LD_PRELOAD", "")
    print(f"### {title}\n")
    print(f"Command: `{'LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 ' if preload else ''}"
          f".venv/bin/python bench/bench_batching.py {command}`  ")
    load = os.getloadavg()
    print(f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared with other agents "
          f"(load average at start {load[0]:.1f}), mlx {mx.__version__} CPU, OpenBLAS preloaded: "
          f"{'yes' if preload else 'no'}  ")
    print(f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")


# ---------------------------------------------------------------- save


def _synthetic_caches(n_tokens: int, layers: int = 4, heads: int = 2, dim: int = 32) -> list[KVCache]:
    out = []
    for i in range(layers):
        k = mx.random.normal((1, heads, n_tokens, dim), key=mx.random.key(i))
        v = mx.random.normal((1, heads, n_tokens, dim), key=mx.random.key(100 + i))
        out.append(KVCache.from_state((k, v, n_tokens)))
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


def _store_all(n: int, cursor: bool, caches: list[KVCache]) -> tuple[float, list[float]]:
    ns = Namespace("bench-model", BLOCK, "float32")
    cache = PromptCache(CacheConfig(block_size=BLOCK, ram_budget_bytes=2 * 1024**3),
                        adapter=MLXPayloadAdapter())
    tokens_list = [int(t) for t in np.random.default_rng(0).integers(3, 50_000, size=n)]
    buf = np.asarray(tokens_list, dtype=np.uint32)
    cur = ChainCursor(ns) if cursor else None

    def payload_for(start: int, end: int, snapshot: bool) -> dict[str, mx.array]:
        return adapters.extract_block(caches, start, end, snapshot)

    per_save = []
    t_all = time.perf_counter()
    for end in range(CHUNK, n + 1, CHUNK):
        t = time.perf_counter()
        if cursor:
            cache.store(ns, buf, end, payload_for, include_partial=False, cursor=cur)
        else:  # before: the list copied and validated, the chain hashed from the root
            cache.store(ns, list(tokens_list), end, payload_for, include_partial=False)
        per_save.append(time.perf_counter() - t)
    return time.perf_counter() - t_all, per_save


def bench_save(sizes: list[int]) -> None:
    _header("Save cost: a long prompt stored chunk by chunk", "save")
    print(f"Synthetic KV (4 layers, 2 heads x 32, float32), block {BLOCK}, one save per "
          f"{CHUNK}-token chunk (the mid-prefill save point), RAM tier large enough for all.\n")
    print("| prompt tokens | saves | before: total | before: last 10% of saves, per save "
          "| now: total | now: first 10%, per save | now: last 10%, per save | before / now |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    caches = _synthetic_caches(max(sizes))
    for n in sizes:
        before, b_per = _store_all(n, False, caches)
        now, n_per = _store_all(n, True, caches)
        k = max(1, len(n_per) // 10)
        print(f"| {n:,} | {len(n_per)} | {before:.2f} s | {statistics.mean(b_per[-k:]) * 1e3:.2f} ms "
              f"| {now:.2f} s | {statistics.mean(n_per[:k]) * 1e3:.2f} ms "
              f"| {statistics.mean(n_per[-k:]) * 1e3:.2f} ms | {before / now:.1f}x |")
        sys.stdout.flush()


# ---------------------------------------------------------------- scheduler


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, 1000, size=length)] for _ in range(n)]


def _our_scheduler(model, tok, prompts, max_tokens, on_event):
    """Our scheduler with ``prompts`` submitted (greedy, no cache); ``on_event`` per event."""
    from promptcache.engine.api import GenerationRequest, SamplingParams
    from promptcache.engine.requests.admission import Admission, Ticket
    from promptcache.engine.requests.request import EngineContext, Request, validate_request
    from promptcache.engine.requests.scheduler import Scheduler
    from promptcache.serving_config import EngineConfig

    ctx = EngineContext(model=model, tokenizer=tok, config=EngineConfig(prefill_chunk_tokens=CHUNK),
                        context_length=1 << 20, vocab_size=1 << 20, eos_token_ids=frozenset())
    adm = Admission(64, 64, None, lambda n: n)

    def make(t: Ticket) -> Request:
        req: GenerationRequest = t.item
        return Request(ctx, req, validate_request(req, ctx), on_event)

    sched = Scheduler(ctx, adm, make)
    for p in prompts:
        adm.submit(Ticket(GenerationRequest(prompt_tokens=tuple(p), use_cache=False,
                                            sampling=SamplingParams(max_tokens=max_tokens)),
                          len(p) + max_tokens))
    return sched


def _ours(model, tok, prompts, max_tokens) -> tuple[float, float, int]:
    """(total s, decode tok/s once every stream started, tokens) through our scheduler."""
    stamps: list[float] = []
    sched = _our_scheduler(model, tok, prompts, max_tokens,
                           lambda ev: stamps.append(time.perf_counter()))
    t0 = time.perf_counter()
    first_all = None
    while sched.step():
        if first_all is None and len(sched.batch) == len(prompts):
            first_all = (time.perf_counter(), len(stamps))
    total = time.perf_counter() - t0
    tokens = len(stamps) - len(prompts)  # minus the results
    t_all, n_all = first_all if first_all else (t0, 0)
    decode = (tokens - n_all) / (time.perf_counter() - t_all)
    return total, decode, tokens


def _mlx_batch(model, prompts, max_tokens) -> tuple[float, float, int]:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[],
                         completion_batch_size=len(prompts), prefill_batch_size=len(prompts),
                         prefill_step_size=CHUNK)
    t0 = time.perf_counter()
    gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    tokens = 0
    started = None
    done = 0
    while done < len(prompts):
        _, responses = gen.next()
        tokens += len(responses)
        if started is None and len(responses) == len(prompts):
            started = (time.perf_counter(), tokens)
        done += sum(1 for r in responses if r.finish_reason is not None)
    total = time.perf_counter() - t0
    t_all, n_all = started if started else (t0, 0)
    decode = (tokens - n_all) / (time.perf_counter() - t_all)
    gen.close()
    return total, decode, tokens


def _extract_cost(layers: int, heads: int, dim: int, n: int) -> tuple[float, float]:
    """Reading a request's state at every chunk boundary of an n-token prompt, on KV of
    the model's shape: (what BatchGenerator.extract_cache does -- BatchKVCache.extract
    of every layer, a copy of the whole KV so far --, Σ s; our per-chunk extraction of
    the new blocks only, Σ s)."""
    from mlx_lm.models.cache import BatchKVCache

    caches = _synthetic_caches(n, layers, heads, dim)
    t_theirs = t_ours = 0.0
    for pos in range(CHUNK, n, CHUNK):
        batch = []
        for c in caches:  # the state a prompt batch holds at this chunk boundary
            b = BatchKVCache([0])
            b.keys, b.values, b._idx = c.keys, c.values, pos
            b.offset = mx.array([pos])
            batch.append(b)
        t = time.perf_counter()
        out = [b.extract(0) for b in batch]
        mx.eval([o.keys for o in out] + [o.values for o in out])
        t_theirs += time.perf_counter() - t
        del out
        t = time.perf_counter()
        for start in range(pos - CHUNK, pos, BLOCK):
            adapters.extract_block(caches, start, start + BLOCK, False)
        t_ours += time.perf_counter() - t
    return t_theirs, t_ours


def bench_scheduler(model_path: str, batches: list[int], max_tokens: int, long_prompt: int) -> None:
    from promptcache.engine.models.loader import load_model

    model, tok, _ = load_model(model_path)
    _header("Our scheduler vs mlx-lm's BatchGenerator", f"scheduler --model {model_path}")
    print(f"Model {Path(model_path).name}; 128-token prompts, {max_tokens} tokens each, greedy, "
          f"no cache; the two run alternately, best of 2.\n")
    print("| streams | ours: total | BatchGenerator: total | ours: decode tok/s | "
          "BatchGenerator: decode tok/s | ours / BatchGenerator (decode) |")
    print("|---:|---:|---:|---:|---:|---:|")
    _ours(model, tok, _prompts(2, 32, 0), 4)  # warm up
    _mlx_batch(model, _prompts(2, 32, 0), 4)
    for b in batches:
        prompts = _prompts(b, 128, b)
        ours = max((_ours(model, tok, prompts, max_tokens) for _ in range(2)), key=lambda r: r[1])
        theirs = max((_mlx_batch(model, prompts, max_tokens) for _ in range(2)), key=lambda r: r[1])
        print(f"| {b} | {ours[0]:.2f} s | {theirs[0]:.2f} s | {ours[1]:.1f} | {theirs[1]:.1f} | "
              f"{ours[1] / theirs[1]:.2f} |")
        sys.stdout.flush()
    args = model.args
    heads = getattr(args, "num_key_value_heads", None) or args.num_attention_heads
    dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    layers = len(model.layers)
    print(f"\nReading the state at every {CHUNK}-token chunk boundary (what the mid-prefill save "
          f"point needs), KV of this model's shape ({layers} layers x {heads} KV heads x {dim}, "
          "float32):\n")
    print("| prompt tokens | BatchGenerator.extract_cache, Σ | ours: the new blocks only, Σ | ratio |")
    print("|---:|---:|---:|---:|")
    for n in (long_prompt // 4, long_prompt // 2, long_prompt):
        theirs, ours = _extract_cost(layers, heads, dim, n)
        print(f"| {n:,} | {theirs:.2f} s | {ours:.2f} s | {theirs / ours:.1f}x |")
        sys.stdout.flush()


# ---------------------------------------------------------------- profile


def _ours_steps(model, tok, prompts, max_tokens, profiler=None):
    """Our scheduler on a burst: (s until every stream had its first token, per decode
    step s after that); ``profiler`` (cProfile) runs during those decode steps."""
    sched = _our_scheduler(model, tok, prompts, max_tokens, lambda ev: None)
    t0 = time.perf_counter()
    while len(sched.batch) < len(prompts):
        sched.step()
    prefill = time.perf_counter() - t0
    steps = []
    if profiler is not None:
        profiler.enable()
    while True:
        t = time.perf_counter()
        if not sched.step() or len(sched.batch) < len(prompts):
            break
        steps.append(time.perf_counter() - t)
    if profiler is not None:
        profiler.disable()
    while sched.step():
        pass
    return prefill, steps


def _theirs_steps(model, prompts, max_tokens):
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, stop_tokens=[],
                         completion_batch_size=len(prompts), prefill_batch_size=len(prompts),
                         prefill_step_size=2048)  # mlx_lm.server's defaults for the burst
    gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
    t0 = time.perf_counter()
    prefill = None
    steps = []
    done = 0
    while done < len(prompts):
        t = time.perf_counter()
        _, responses = gen.next()
        if prefill is None:
            if len(responses) == len(prompts):
                prefill = time.perf_counter() - t0
            continue
        steps.append(time.perf_counter() - t)
        done += sum(1 for r in responses if r.finish_reason is not None)
    gen.close()
    return prefill or 0.0, steps


def bench_profile(model_path: str, batch: int, prompt_len: int, max_tokens: int, repeats: int) -> None:
    import cProfile
    import io
    import pstats

    from promptcache.engine.models.loader import load_model

    model, tok, _ = load_model(model_path)
    _header(f"Where a step goes at {batch} streams",
            f"profile --model {model_path} --batches {batch} --prompt-len {prompt_len} "
            f"--max-tokens {max_tokens}")
    prompts = _prompts(batch, prompt_len, 5)
    _ours_steps(model, tok, _prompts(2, 32, 0), 4)  # warm up
    _theirs_steps(model, _prompts(2, 32, 0), 4)
    rows: dict[str, list[tuple[float, float]]] = {"ours": [], "BatchGenerator": [], "floor": []}
    for _ in range(repeats):  # interleaved, so load changes hit each alike
        pre, st = _ours_steps(model, tok, prompts, max_tokens)
        rows["ours"].append((pre, statistics.median(st)))
        pre, st = _theirs_steps(model, prompts, max_tokens)
        rows["BatchGenerator"].append((pre, statistics.median(st)))
        rows["floor"].append((0.0, statistics.median(floor_steps(model, prompts, max_tokens))))
    print(f"{batch} prompts of {prompt_len} tokens arriving together, {max_tokens} tokens each, "
          f"greedy, no cache; medians over the decode steps, best of {repeats} interleaved runs.\n")
    print("| | burst prefill (until every stream has its first token) | decode step | "
          "decode tok/s | vs BatchGenerator (decode) |")
    print("|---|---:|---:|---:|---:|")
    bg = min(r[1] for r in rows["BatchGenerator"])
    for name, label in (("floor", "bare forward + argmax (floor)"), ("ours", "our scheduler"),
                        ("BatchGenerator", "mlx-lm BatchGenerator")):
        pre = min(r[0] for r in rows[name])
        step = min(r[1] for r in rows[name])
        print(f"| {label} | {'—' if name == 'floor' else f'{pre:.2f} s'} | {step * 1e3:.1f} ms | "
              f"{batch / step:.1f} | {bg / step:.2f}x |")
    prof = cProfile.Profile()
    _ours_steps(model, tok, prompts, max_tokens, profiler=prof)
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
    print("\ncProfile of our decode steps (top 12 by own time):\n\n```")
    print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[-2600:])
    print("```")
    sys.stdout.flush()


# ---------------------------------------------------------------- render


def bench_render(model_path: str, n_messages: int) -> None:
    from promptcache.engine.formats.templates import ChatTemplate
    from promptcache.engine.models.loader import load_model

    _, tok, _ = load_model(model_path)
    rng = random.Random(0)
    words = "cache block token prefix model layer window chunk state tier memory disk".split()
    msgs = [{"role": "system", "content": "You are a helpful assistant."}]
    for i in range(n_messages - 1):
        role = "user" if i % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": " ".join(rng.choice(words) for _ in range(180))})
    t = ChatTemplate(tok)
    t0 = time.perf_counter()
    tokens, starts = t.render_with_offsets(msgs)
    now = time.perf_counter() - t0
    t0 = time.perf_counter()
    full = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    for i in range(1, len(msgs)):  # before: one render per message prefix
        tok.apply_chat_template(msgs[:i], add_generation_prompt=False, tokenize=True)
    before = time.perf_counter() - t0
    assert list(full) == tokens
    _header("Chat template: tokens + message offsets", f"render --model {model_path}")
    print("| messages | prompt tokens | before: a render per message | now: one pass | ratio |")
    print("|---:|---:|---:|---:|---:|")
    print(f"| {len(msgs)} | {len(tokens):,} | {before:.2f} s | {now * 1e3:.1f} ms | "
          f"{before / now:.0f}x |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("save", "scheduler", "render", "profile"))
    ap.add_argument("--model", default=None, help="model folder (default: the embedded SmolLM2)")
    ap.add_argument("--sizes", default="16384,32768,65536,131072")
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--long-prompt", type=int, default=16384)
    ap.add_argument("--messages", type=int, default=122)
    ap.add_argument("--prompt-len", type=int, default=225)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    if args.what == "save":
        bench_save([int(s) for s in args.sizes.split(",")])
        return 0
    model = args.model
    if model is None:
        from promptcache.engine.models.gguf import ensure_default_model

        model = str(ensure_default_model(Path(__file__).resolve().parent.parent / ".models" / "default"))
    if args.what == "profile":
        bench_profile(model, int(args.batches.split(",")[0]), args.prompt_len, args.max_tokens,
                      args.repeats)
    elif args.what == "scheduler":
        bench_scheduler(model, [int(b) for b in args.batches.split(",")], args.max_tokens,
                        args.long_prompt)
    else:
        bench_render(model, args.messages)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
