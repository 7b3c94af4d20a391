"""Long sessions: one conversation grown to 8K, 16K, 32K, ... tokens; at each size the next
turn (``--new`` new tokens, first token only) is timed from the **live state** (nothing
restored), the **RAM tier** (live state released), the **SSD** (a clean restart, page cache
dropped), **Redis** (``--redis``: a new engine, empty RAM and SSD) and on **mlx_lm.server**
(same model folder, its prompt cache kept; ``--no-mlx-lm``: left out), beside the **floor**
(mlx-lm prefilling only the new tokens on a cache holding the rest, sampled after each of those
turns, its best), a **cold prefill**, **one contiguous copy** of the bytes a restore writes and
**one sequential read** (``dd``, page cache dropped) of the SSD's bytes. Issue 41's targets:
live <= 1.05x the floor; RAM <= the floor + 1.2x the copy; SSD <= 1.2x (the read + the floor)
and never more than a cold prefill.

``--shape``: ``small`` (mlx-lm's llama, random float32 weights, 8 layers, 4 / 2 heads of 64,
a 128K window), ``smollm2`` (the embedded default, window widened to 32,768 by YaRN) or
``smollm2-random`` (its structure, random weights, a 128K window); a random model is written
to a folder so mlx_lm.server loads the same weights. The text is one-token words, so
mlx_lm.server's tokenizing gives exactly the engine's tokens (checked).

    PYTHONPATH=src:bench python bench/bench_long_session.py [--shape small] \\
        [--sizes 8192,16384,32768] [--new 256] [--redis] [--gap 1] [--out FILE.json]

Each turn is sent ``--gap`` s after the previous one ended. A size whose estimated time (the
previous size's x the square of the sizes' ratio) exceeds ``--budget-min`` is skipped.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from page_cache import drop_files

from .long_measure import Floor, copy_time, paired, parts, read_time, timed
from .long_session import complete_once, over_budget, table

SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-random": dict(hidden_size=576, num_hidden_layers=30, intermediate_size=1536,
                           num_attention_heads=9, num_key_value_heads=3, head_dim=64),
    "small": dict(hidden_size=256, num_hidden_layers=8, intermediate_size=768,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64),
}
REAL = "smollm2"  # the embedded default's converted folder
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def randomize(model: Any) -> Any:
    """``model`` with random weights (seed 0): norms 1, the rest N(0, 0.02)."""
    mx.random.seed(0)
    for _, m in model.named_modules():
        for key, value in list(m.items()):
            if isinstance(value, mx.array):
                m[key] = (mx.ones(value.shape) if isinstance(m, nn.RMSNorm)  # type: ignore[attr-defined]
                          else 0.02 * mx.random.normal(value.shape))
    mx.eval(model.parameters())
    return model


def write_random_model(shape: str, tokenizer_dir: Path, vocab: int, max_positions: int,
                       out: Path) -> Path:
    """mlx-lm's llama class of ``shape`` with random float32 weights, saved as a model
    folder (config.json, model.safetensors, the tokenizer files of ``tokenizer_dir``)."""
    from mlx.utils import tree_flatten

    module = importlib.import_module("mlx_lm.models.llama")
    config = dict(model_type="llama", vocab_size=vocab, rms_norm_eps=1e-5,
                  max_position_embeddings=max_positions, rope_theta=1e6,
                  tie_word_embeddings=True, **SHAPES[shape])
    model = randomize(module.Model(module.ModelArgs.from_dict(config)))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "float32"}, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def word_tokens(tokenizer: Any) -> list[int]:
    """The vocabulary's one-token words (" word", 2-10 lower-case letters) that encode
    back to themselves: a text of them tokenizes to exactly its tokens."""
    vocab = tokenizer._tokenizer.get_vocab()
    out = [i for s, i in sorted(vocab.items()) if re.fullmatch("\u0120[a-z]{2,10}", s)]
    out = [i for i in out if tokenizer.encode(tokenizer.decode([i])) == [i]]
    if len(out) < 1000:
        raise RuntimeError(f"only {len(out)} one-token words in the vocabulary")
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted([*SHAPES, REAL]), default="small")
    ap.add_argument("--sizes", default="8192,16384,32768")
    ap.add_argument("--new", type=int, default=256, help="new tokens of each next turn")
    ap.add_argument("--chunk", type=int, default=512, help="--prefill-chunk-tokens")
    ap.add_argument("--redis", action="store_true", help="also from a redis-server")
    ap.add_argument("--segment-mb", type=int, default=256, help="0: one SSD file per block")
    ap.add_argument("--no-mlx-lm", action="store_true", help="leave mlx_lm.server out")
    ap.add_argument("--repeats", type=int, default=3, help="the fastest of this many")
    ap.add_argument("--gap", type=float, default=1.0,
                    help="seconds before each turn and each floor sample (think time)")
    ap.add_argument("--budget-min", type=float, default=15.0,
                    help="a size estimated to take longer than this many minutes is skipped")
    ap.add_argument("--dir", default=None, help="folder for the SSD tier (default: a temp)")
    ap.add_argument("--out", default=None)
    return ap


def run(argv: list[str] | None = None) -> str:
    """Run the scenario; its Markdown table."""
    a = parser().parse_args(argv)

    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from promptcache.cli.wiring import build_cache
    from promptcache.config import CacheConfig, RedisConfig, SSDConfig
    from promptcache.engine.api import GenerationRequest, SamplingParams
    from promptcache.engine.engine import Engine
    from promptcache.engine.models.gguf import ensure_default_model
    from promptcache.engine.models.loader import load_model
    from promptcache.engine.payload import adapters
    from promptcache.serving_config import EngineConfig

    sizes = [int(s) for s in a.sizes.split(",")]
    longest = max(sizes) + 4 * a.new + 64
    root = Path(a.dir or tempfile.mkdtemp(prefix="pc-long-"))
    default_dir = ensure_default_model()
    if a.shape == REAL:
        folder = default_dir
    else:
        vocab0 = len(load_tokenizer(default_dir)._tokenizer)
        folder = write_random_model(a.shape, default_dir, vocab0, 131072, root / "model")
    model, tokenizer, info = load_model(folder)
    vocab = len(tokenizer._tokenizer)
    if longest > info.context_length:
        raise SystemExit(f"{longest} tokens exceed the model's window ({info.context_length})")
    probe = make_prompt_cache(model)
    mx.eval(model(mx.array([[1]]), cache=probe))
    per_token = sum(int(x.nbytes) // int(x.shape[2]) for _, x in adapters.state_arrays(probe))
    kv_max = per_token * longest
    log(f"shape {a.shape} ({folder}, window {info.context_length}, {info.dtype}): "
        f"{per_token} B of KV per token, {kv_max / 1e9:.2f} GB at "
        f"{longest} tokens; mlx {getattr(mx, '__version__', '?')} on {mx.default_device()}; "
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}")
    ec = EngineConfig(speculation="off", prefill_chunk_tokens=a.chunk)
    cc = CacheConfig(ram_budget_bytes=max(1 << 30, 4 * kv_max))
    redis_srv = None
    rc = None
    if a.redis:
        from harness.redisproc import RedisServer

        redis_srv = RedisServer(root / "redis").start()
        rc = RedisConfig(url=redis_srv.url, timeout_s=5.0, connect_timeout_s=1.0,
                         policy="write_through")
    peer = None
    if not a.no_mlx_lm:
        from harness.systems import ServerProcess

        # mlx_lm.server lists the Hugging Face cache's models; it must exist
        (Path.home() / ".cache" / "huggingface" / "hub").mkdir(parents=True, exist_ok=True)
        peer = ServerProcess("mlx_lm", str(folder), root / "mlx_lm.log",
                             ram_budget_bytes=max(1 << 30, 4 * kv_max))
        log(f"mlx_lm.server started in {peer.start():.1f} s")

    def engine(ssd_dir: Path | None, with_redis: bool) -> Engine:
        ssd = (SSDConfig(path=ssd_dir, policy="write_back", fsync=False,
                         budget_bytes=max(1 << 30, 4 * kv_max), segment_bytes=a.segment_mb << 20)
               if ssd_dir is not None else None)
        return Engine(model, tokenizer, model_id=info.model_id,
                      fingerprint=f"long-{a.shape}-{info.fingerprint}",
                      context_length=longest, vocab_size=vocab, engine_config=ec,
                      cache_config=cc,
                      cache=build_cache(cc, ssd, rc if with_redis else None))

    def ask(eng: Engine, tokens: list[int]) -> Any:
        # think time before each turn: what the previous request left running is done
        time.sleep(a.gap)
        r = eng.submit(GenerationRequest(prompt_tokens=tuple(tokens),
                                         sampling=SamplingParams(max_tokens=1),
                                         session_id="long")).result()
        if r.error:
            raise RuntimeError(r.error)
        return r

    def ask_peer(tokens: list[int]) -> tuple[float, dict[str, Any]]:
        assert peer is not None
        time.sleep(a.gap)
        took, usage = complete_once(peer.base_url, tokenizer.decode(tokens))
        if usage.get("prompt_tokens") != len(tokens):
            raise RuntimeError(f"mlx_lm.server counted {usage.get('prompt_tokens')} prompt "
                               f"tokens, the engine {len(tokens)}")
        return took, usage

    def cold_prefill(tokens: list[int]) -> float:
        """mlx-lm alone, the whole prompt on an empty cache, chunked as the engine
        prefills (the chunks' caches, then the last token alone for its logits)."""
        state = make_prompt_cache(model)
        arr = mx.array(tokens)[None]

        def run(state: Any = state) -> None:
            for i in range(0, len(tokens) - 1, a.chunk):
                model(arr[:, i:min(i + a.chunk, len(tokens) - 1)], cache=state)
                mx.eval([x for _, x in adapters.state_arrays(state)])
            mx.eval(model(arr[:, -1:], cache=state)[0, -1])
        took = timed(run)
        state.clear()
        mx.clear_cache()
        return took

    rng = random.Random(0)
    vocab_words = word_tokens(tokenizer)

    def words(n: int) -> list[int]:
        return [rng.choice(vocab_words) for _ in range(n)]

    eng = None
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    done: list[tuple[int, float]] = []
    firsts: dict[str, float] = {}  # the first turn's prefill (nothing cached), per system

    def dump() -> None:
        if a.out:
            Path(a.out).write_text(json.dumps({
                "shape": a.shape, "model": str(folder), "window": info.context_length,
                "new": a.new, "per_token_bytes": per_token, "first_prefill": firsts, "rows": rows,
                "skipped": skipped}, indent=1))

    try:
        ssd_dir = root / "blocks"
        eng = engine(ssd_dir, a.redis)
        ns = eng.namespace()
        history = words(sizes[0])
        # a size's time includes the growing of the conversation to it (here from nothing)
        t_size = time.perf_counter()
        first = ask(eng, history)
        firsts["engine_s"] = first.ttft_s
        log(f"first prefill of {sizes[0]} (the engine, cold): {first.ttft_s:.2f} s")
        if peer is not None:
            firsts["mlx_lm_s"], _ = ask_peer(history)
            log(f"first prefill of {sizes[0]} on mlx_lm.server (cold): "
                f"{firsts['mlx_lm_s']:.2f} s")
        for n in sizes:
            why = over_budget(done, n, a.budget_min)
            if why is not None:
                skipped.append(why)
                log(f"skipped: {why}")
                continue
            if len(history) < n:  # a turn that grows the conversation (from the live state)
                history += words(n - len(history))
                ask(eng, history)
                if peer is not None:
                    ask_peer(history)
            row: dict[str, Any] = {"size": len(history)}
            # the floor: mlx-lm alone, the new tokens on a cache holding the conversation,
            # sampled between the turns below (the machine's drift hits both alike): its best
            cache = eng.cache
            assert cache is not None
            hit = cache.acquire(history, ns)
            m = min(int(hit.num_tokens), len(history) - 1)
            state = adapters.restore(model, hit.blocks, m, reserve=len(history) - m + a.new + 1)
            cache.release(hit)
            rest = mx.array(history[m:] + words(a.new))[None]
            floor = Floor(model, state, rest, a.gap, adapters.state_arrays)
            floors = floor.samples
            floor()
            floors.clear()  # the first warms the kernels of these widths
            live = paired(lambda e=eng, h=history: ask(e, h + words(a.new)), a.repeats, floor, row,
                          "live")
            row.update(live_s=live.ttft_s, live_by_tier=dict(live.usage.cached_by_tier),
                       live_parts=parts(live))
            before = eng.engine_stats()
            ram = paired(lambda e=eng, h=history: (e.release_live(), ask(e, h + words(a.new)))[1],
                         a.repeats, floor, row, "ram")
            after = eng.engine_stats()
            copied = (after["restore_copy_bytes"] - before["restore_copy_bytes"]) // a.repeats
            row.update(ram_s=ram.ttft_s, ram_restore_s=ram.restore_s, ram_parts=parts(ram),
                       ram_by_tier=dict(ram.usage.cached_by_tier), copy_bytes=copied,
                       copies=(after["restore_copies"] - before["restore_copies"]) // a.repeats,
                       copy_s=copy_time(copied, fresh=True), copy_warm_s=copy_time(copied),
                       floor_new=int(rest.shape[1]))
            # the SSD after a clean shutdown and a restart, page cache dropped
            row["shutdown_s"] = timed(eng.close)
            stored = sum(p.stat().st_size for p in ssd_dir.rglob("*") if p.is_file())
            # the SSD's files only: a global drop would also evict the process's own code
            row["page_cache"] = drop_files([p for p in ssd_dir.rglob("*") if p.is_file()])
            mx.clear_cache()
            t = time.perf_counter()
            eng = engine(ssd_dir, a.redis)
            row["restart_s"] = time.perf_counter() - t
            ssd = ask(eng, history + words(a.new))
            row.update(ssd_s=ssd.ttft_s, ssd_restore_s=ssd.restore_s, ssd_bytes=stored,
                       ssd_by_tier=dict(ssd.usage.cached_by_tier), ssd_parts=parts(ssd),
                       read_s=read_time(root, stored))
            floor()
            row["ssd_floor_s"] = floors[-1]
            if a.redis:  # a new server: nothing in its RAM or SSD, Redis holds the blocks
                other = engine(None, True)
                red = ask(other, history + words(a.new))
                row.update(redis_s=red.ttft_s, redis_by_tier=dict(red.usage.cached_by_tier),
                           redis_parts=parts(red))
                other.close()
                floor()
            if peer is not None:  # the same next turns on mlx_lm.server
                peers = []
                for _ in range(a.repeats):
                    peers.append(ask_peer(history + words(a.new)))
                    floor()
                took, usage = min(peers, key=lambda p: p[0])
                row.update(mlx_lm_s=took, mlx_lm_cached=(usage.get("prompt_tokens_details")
                                                         or {}).get("cached_tokens"))
                # what its tokenizing of such a prompt takes in this process
                prompt = tokenizer.decode(history + words(a.new))
                t = time.perf_counter()
                tokenizer.encode(prompt)
                row["tokenize_s"] = time.perf_counter() - t
            row.update(floor_s=min(floors), floor_samples=floors)
            del state, floor, floors
            # a cold prefill of the next turn's whole prompt
            row["cold_s"] = cold_prefill(history + words(a.new))
            row["size_s"] = time.perf_counter() - t_size
            done.append((n, row["size_s"]))
            t_size = time.perf_counter()
            log(f"N={row['size']} ({row['size_s']:.0f} s): live {row['live_s']:.3f} s "
                f"{row['live_by_tier']}, RAM {row['ram_s']:.3f} s ({row['copies']} copies), "
                f"SSD {row['ssd_s']:.3f} s, floor {row['floor_s']:.3f} s, copy "
                f"{row['copy_s']:.3f} s ({copied / 1e6:.0f} MB), dd {row['read_s']:.3f} s "
                f"({stored / 1e6:.0f} MB), cold {row['cold_s']:.2f} s"
                + (f", Redis {row['redis_s']:.3f} s" if a.redis else "")
                + (f", mlx_lm.server {row['mlx_lm_s']:.3f} s ({row['mlx_lm_cached']} cached; "
                   f"tokenizing {row['tokenize_s']:.3f} s)" if peer is not None else ""))
            rows.append(row)
            dump()
        dump()
        md = table(rows, redis=a.redis, skipped=skipped)
    finally:
        if eng is not None:
            eng.close()
        if peer is not None:
            peer.stop()
        if redis_srv is not None:
            redis_srv.stop()
        shutil.rmtree(root, ignore_errors=True)
    return md
