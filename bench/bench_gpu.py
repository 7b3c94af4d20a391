"""On an accelerator (mlx[cuda] or Metal): a random-weight model of a real 30B shape, and

1. **the verify cost of speculation**: a forward of k + 1 positions per row (k = 1, 2,
   4, 8, 16) in decode steps of the same rows, at 1 and 8 rows over ``--verify-context``
   tokens per row (fastest of ``--repeats``, the cache trimmed back after each), beside
   the gate's startup fit (``engine/speculation/cost.measure_verify_cost``, what the server
   prices verifies with before it has timed any);
2. **restore vs prefill** through the engine and the cache (RAM tier + SSD tier, no
   speculation): for each context N, the time to first token of an N-token prompt with
   nothing cached (prefill), of the same prompt + 16 new tokens served from the live state
   (engine/payload/live.py), of the prompt + 16 other new tokens served from the RAM tier (the
   live state released first),
   and, after a clean shutdown and a new cache over the same SSD folder (a restart), of
   the prompt + 16 other new tokens served from the SSD tier (the page cache dropped
   first where the machine allows it; the output says how).

Shapes (mlx-lm's own model classes, random weights, activations bfloat16, ``--bits 4``
quantized as users run them on a Mac): ``qwen3-30b-a3b`` (qwen3_moe: 48 layers, 128
experts, 8 active, 32 query / 4 KV heads of 128), ``qwen3-32b`` (qwen3: 64 layers,
hidden 5120, 64 query / 8 KV heads of 128), and ``tiny`` / ``tiny-moe`` (the same code
on a CPU, to check the script). The vocabulary is the tokenizer's (``--tokenizer``: a
folder with tokenizer.json; default: the embedded SmolLM2's), 49,152 ids.

    PYTHONPATH=src python bench/bench_gpu.py --shape qwen3-30b-a3b --bits 4 \\
        [--contexts 8192,16384,32768,65536] [--verify-context 8192] [--out FILE.json]

Prints markdown tables; ``--out`` also writes the numbers as JSON. ``--deadline-s``: a
step that would start past this many seconds from the start is skipped (said so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from page_cache import drop_cache

QWEN3_30B_A3B: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=48, intermediate_size=6144,
    moe_intermediate_size=768, num_attention_heads=32, num_key_value_heads=4,
    head_dim=128, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=1e6,
    tie_word_embeddings=False)
QWEN3_32B: dict[str, Any] = dict(
    hidden_size=5120, num_hidden_layers=64, intermediate_size=25600,
    num_attention_heads=64, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
    rope_theta=1e6, tie_word_embeddings=False)
# the same structures, small enough for a CPU (to check the script)
TINY: dict[str, Any] = dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32)
SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-30b-a3b": ("qwen3_moe", QWEN3_30B_A3B),
    "qwen3-32b": ("qwen3", QWEN3_32B),
    "tiny": ("qwen3", {**QWEN3_32B, **TINY}),
    "tiny-moe": ("qwen3_moe", {**QWEN3_30B_A3B, **TINY, "moe_intermediate_size": 64,
                               "num_experts": 16, "num_experts_per_tok": 4}),
}

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def build_model(shape: str, bits: int, vocab: int, max_positions: int) -> Any:
    """The model class of ``shape`` with random weights (normal, std 0.02), cast to
    bfloat16 and, with ``bits`` < 16, quantized (group 64); evaluated layer by layer so
    the float32 initial weights of one layer at most are alive at a time."""
    import importlib

    kind, cfg = SHAPES[shape]
    module = importlib.import_module(f"mlx_lm.models.{kind}")
    args = module.ModelArgs(model_type=kind, vocab_size=vocab,
                            max_position_embeddings=max_positions, **cfg)
    model = module.Model(args)
    mx.random.seed(0)

    def randomize(part: nn.Module) -> None:
        for _, m in part.named_modules():
            for key, value in list(m.items()):
                if isinstance(value, mx.array):
                    m[key] = (mx.ones(value.shape) if isinstance(m, nn.RMSNorm)
                              else 0.02 * mx.random.normal(value.shape)).astype(mx.bfloat16)

    parts: list[nn.Module] = [model.model.embed_tokens, model.model.norm]
    if hasattr(model, "lm_head"):
        parts.append(model.lm_head)
    parts.extend(model.model.layers)
    for part in parts:
        randomize(part)
        if bits < 16:
            nn.quantize(part, group_size=64, bits=bits)
        mx.eval(part.parameters())
    mx.clear_cache()
    return model


def param_bytes(model: Any) -> int:
    return sum(p.nbytes for _, p in nn.utils.tree_flatten(model.parameters()))


def timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def verify_cost(model: Any, vocab: int, rows_list: list[int], context: int,
                repeats: int, chunk: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Decode step and verify forwards (k = 1, 2, 4, 8, 16) per batch size, over
    ``context`` tokens of KV per row; and the startup fit's parameters."""
    import dataclasses

    from mlx_lm.models.cache import make_prompt_cache

    from promptcache.engine.speculation.cost import measure_verify_cost

    ks = (1, 2, 4, 8, 16)
    fitted = measure_verify_cost(model, vocab)
    log(f"startup fit: {fitted}")
    out = []
    for rows in rows_list:
        cache = make_prompt_cache(model)
        rng = random.Random(rows)
        x = mx.array([[rng.randrange(10, vocab - 10) for _ in range(context + 17)]
                      for _ in range(rows)], dtype=mx.uint32)
        step = max(1, chunk // rows)  # at most ``chunk`` tokens per forward
        for s in range(0, context, step):
            mx.eval(model(x[:, s:min(context, s + step)], cache=cache))
        mx.clear_cache()
        tail = x[:, context:]

        def once(width: int, tail: Any = tail, cache: Any = cache) -> float:
            def run() -> None:
                mx.eval(model(tail[:, :width], cache=cache))
            took = timed(run)
            for c in cache:
                c.trim(width)
            return took

        for w in (1, 2, 5, 17):
            once(w)
        base = min(once(1) for _ in range(repeats))
        row: dict[str, Any] = {"rows": rows, "context": context, "decode_ms": base * 1e3,
                               "verify": {}, "fit": {}}
        for k in ks:
            row["verify"][k] = min(once(k + 1) for _ in range(repeats)) / base
            row["fit"][k] = fitted.relative(rows, k + 1)
        log(f"rows {rows}: decode {base * 1e3:.1f} ms, verify "
            + ", ".join(f"k={k} {row['verify'][k]:.2f}" for k in ks))
        out.append(row)
        del cache, x, tail
        mx.clear_cache()
    return out, dataclasses.asdict(fitted)


def drop_page_cache(folder: Path) -> str:
    """Write back and drop ``folder``'s files from the page cache (``page_cache.py``)."""
    os.sync()
    return drop_cache([p for p in folder.rglob("*") if p.is_file()])


def restore_vs_prefill(model: Any, tokenizer: Any, vocab: int, contexts: list[int],
                       chunk: int, folder: Path, deadline: float, fingerprint: str,
                       out: list[dict[str, Any]], save: Any) -> None:
    """Appends one row per context to ``out`` and calls ``save`` after each."""
    from promptcache.cli.wiring import build_cache
    from promptcache.config import CacheConfig, SSDConfig
    from promptcache.engine.api import GenerationRequest, SamplingParams
    from promptcache.engine.engine import Engine
    from promptcache.serving_config import EngineConfig

    longest = max(contexts) + 64
    kv_bytes = 0
    ec = EngineConfig(speculation="off", prefill_chunk_tokens=chunk)

    def engine(path: Path) -> Engine:
        cc = CacheConfig(ram_budget_bytes=max(1 << 30, 3 * kv_bytes))
        ssd = SSDConfig(path=path, budget_bytes=max(1 << 30, 3 * kv_bytes))
        return Engine(model, tokenizer, model_id="random", fingerprint=fingerprint,
                      context_length=longest, vocab_size=vocab, engine_config=ec,
                      cache_config=cc, cache=build_cache(cc, ssd))

    def ask(eng: Engine, tokens: list[int]) -> Any:
        req = GenerationRequest(prompt_tokens=tuple(tokens),
                                sampling=SamplingParams(max_tokens=1), session_id="bench")
        r = eng.submit(req).result()
        if r.error:
            raise RuntimeError(r.error)
        return r

    # warm-up: kernels of every width the engine uses, nothing kept
    probe = Path(tempfile.mkdtemp(dir=folder))
    eng = engine(probe)
    ask(eng, [random.Random(-1).randrange(10, vocab - 10) for _ in range(chunk + 40)])
    kv_bytes = eng.row_bytes(longest)
    eng.close()
    shutil.rmtree(probe)
    for n in contexts:
        if time.perf_counter() - T0 > deadline:
            log(f"N={n}: skipped (past --deadline-s)")
            continue
        rng = random.Random(n)
        prompt = [rng.randrange(10, vocab - 10) for _ in range(n)]
        tail_a = [rng.randrange(10, vocab - 10) for _ in range(16)]
        tail_b = [rng.randrange(10, vocab - 10) for _ in range(16)]
        tail_c = [rng.randrange(10, vocab - 10) for _ in range(16)]
        path = Path(tempfile.mkdtemp(dir=folder))
        eng = engine(path)
        cold = ask(eng, prompt)
        live = ask(eng, prompt + tail_a)  # the live state of the first request
        eng.release_live()  # as under memory pressure: the next hit is the RAM tier's
        ram = ask(eng, prompt + tail_c)
        t = time.perf_counter()
        eng.close()
        shutdown_s = time.perf_counter() - t
        stored = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
        how = drop_page_cache(path)
        mx.clear_cache()
        t = time.perf_counter()
        eng = engine(path)
        start_s = time.perf_counter() - t
        ssd = ask(eng, prompt + tail_b)
        eng.close()
        shutil.rmtree(path)
        row = {"context": n, "prefill_s": cold.ttft_s, "live_s": live.ttft_s,
               "live_cached": live.usage.cached_tokens, "ram_s": ram.ttft_s,
               "ram_cached": ram.usage.cached_tokens, "ram_restore_s": ram.restore_s,
               "ram_lookup_s": ram.lookup_s, "ssd_lookup_s": ssd.lookup_s,
               "ssd_s": ssd.ttft_s, "ssd_cached": ssd.usage.cached_tokens,
               "ssd_restore_s": ssd.restore_s, "ssd_bytes": stored,
               "shutdown_s": shutdown_s, "restart_s": start_s, "page_cache": how}
        log(f"N={n}: prefill {cold.ttft_s:.2f} s; live state {live.ttft_s:.3f} s "
            f"({live.usage.cached_tokens} cached); RAM hit {ram.ttft_s:.3f} s "
            f"({ram.usage.cached_tokens} cached); SSD hit after restart {ssd.ttft_s:.3f} s "
            f"({ssd.usage.cached_tokens} cached, {stored / 1e9:.2f} GB, {how})")
        out.append(row)
        save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--bits", type=int, choices=(4, 8, 16), default=4)
    ap.add_argument("--contexts", default="8192,16384,32768,65536")
    ap.add_argument("--verify-context", type=int, default=8192)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--chunk", type=int, default=2048,
                    help="prefill chunk (the engine's --prefill-chunk-tokens here)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--dir", default=None, help="folder for the SSD tier (default: a temp)")
    ap.add_argument("--deadline-s", type=float, default=float("inf"))
    ap.add_argument("--skip", default="", help="verify,restore: parts to skip")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from mlx_lm.tokenizer_utils import load as load_tokenizer

    tok_dir = args.tokenizer
    if tok_dir is None:
        from promptcache.engine.models.gguf import ensure_default_model

        root = Path(__file__).resolve().parent.parent / ".models" / "default"
        tok_dir = str(ensure_default_model(root))
    tokenizer = load_tokenizer(Path(tok_dir))
    vocab = len(tokenizer._tokenizer)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    device = str(mx.default_device())
    try:
        import subprocess

        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpu = ""
    t = time.perf_counter()
    model = build_model(args.shape, args.bits, vocab, max(contexts + [args.verify_context]) + 64)
    built = time.perf_counter() - t
    size = param_bytes(model)
    log(f"{args.shape} {args.bits}-bit: {size / 1e9:.2f} GB of weights, built in {built:.1f} s "
        f"on {device} {gpu}")
    result: dict[str, Any] = {
        "shape": args.shape, "bits": args.bits, "weights_bytes": size, "vocab": vocab,
        "device": device, "gpu": gpu, "mlx": mx.__version__, "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "chunk": args.chunk,
    }

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1))

    skip = set(args.skip.split(","))
    if "verify" not in skip:
        result["verify"], result["startup_fit"] = verify_cost(model, vocab, [int(r) for r in args.rows.split(",")],
                                       args.verify_context, args.repeats, args.chunk)
        save()
    if "restore" not in skip:
        folder = Path(args.dir or tempfile.mkdtemp())
        folder.mkdir(parents=True, exist_ok=True)
        result["restore"] = []
        restore_vs_prefill(model, tokenizer, vocab, contexts, args.chunk, folder,
                           args.deadline_s, f"random-{args.shape}-{args.bits}",
                           result["restore"], save)
    print(markdown(result))
    return 0


def markdown(r: dict[str, Any]) -> str:
    lines = [f"Model: random-weight {r['shape']}, {r['bits']}-bit, "
             f"{r['weights_bytes'] / 1e9:.1f} GB of weights; mlx {r['mlx']} on "
             f"{r['device']} {r['gpu']}; {r['date']}", ""]
    if r.get("verify"):
        ks = list(r["verify"][0]["verify"])
        lines += ["| rows | context | decode step ms | " + " | ".join(f"k={k}" for k in ks)
                  + " |", "| --- | --- | --- | " + " | ".join("---" for _ in ks) + " |"]
        for v in r["verify"]:
            lines.append(f"| {v['rows']} | {v['context']} | {v['decode_ms']:.1f} | "
                         + " | ".join(f"{v['verify'][k]:.2f} (fit {v['fit'][k]:.2f})"
                                      for k in ks) + " |")
        lines.append("")
    if r.get("restore"):
        lines += ["| context | prefill (nothing cached) s | live state +16 s | RAM hit +16 s "
                  "| SSD hit after restart +16 s | prefill / SSD | stored GB |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for v in r["restore"]:
            lines.append(f"| {v['context']} | {v['prefill_s']:.2f} | {v.get('live_s', 0):.3f} "
                         f"| {v['ram_s']:.3f} | "
                         f"{v['ssd_s']:.3f} | {v['prefill_s'] / v['ssd_s']:.1f}x | "
                         f"{v['ssd_bytes'] / 1e9:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
