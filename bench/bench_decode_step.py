"""mlx-lm's batched decode step, standalone: runs under any venv that has mlx-lm.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        PYTHON bench/bench_decode_step.py MODEL_DIR [--batch 8] [--prompt-len 64]

Prints one JSON line: the mlx / mlx-lm versions, the median time of a decode step of
``BatchGenerator`` at ``--batch`` rows, and of the bare batched forward + argmax over
the same caches (the floor). Run it with the project's venv (mlx-lm 0.32.x: ours and
mlx_lm.server) and with vllm-mlx's (mlx-lm 0.31.x), alternately, to compare the two
mlx-lm versions on one machine (C1 in BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from importlib.metadata import version

import mlx.core as mx
import numpy as np
from mlx_lm import load
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache


def _generation(responses):
    # mlx-lm 0.32: (prompt responses, generation responses); 0.31: generation responses
    return responses[1] if isinstance(responses, tuple) else responses


def bg_steps(model, prompts, steps):
    gen = BatchGenerator(model, max_tokens=steps + 1, completion_batch_size=len(prompts),
                         prefill_batch_size=len(prompts))
    gen.insert(prompts, max_tokens=[steps + 1] * len(prompts))
    times = []
    started = False
    while True:
        t = time.perf_counter()
        out = _generation(gen.next())
        if not out and started:
            break
        if len(out) == len(prompts):
            if started:
                times.append(time.perf_counter() - t)
            started = True
        if any(r.finish_reason is not None for r in out):
            break
    gen.close()
    return times


def floor_steps(model, prompts, steps):
    caches = []
    for p in prompts:
        c = make_prompt_cache(model)
        model(mx.array(p)[None], cache=c)
        mx.eval([x.state for x in c])
        caches.append(c)
    batch = [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]
    toks = mx.array([p[-1] for p in prompts], dtype=mx.uint32)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        toks = mx.argmax(model(toks[:, None], cache=batch)[:, -1, :], axis=-1).astype(mx.uint32)
        mx.eval(toks)
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    model, _ = load(args.model)
    rng = np.random.default_rng(0)
    # lengths differ by a few tokens, as C1's prompts do (rows are left-padded)
    prompts = [[int(t) for t in rng.integers(3, 1000, size=args.prompt_len + i % 4)]
               for i in range(args.batch)]
    bg_steps(model, prompts[:2], 3)  # warm up
    bg = bg_steps(model, prompts, args.steps)
    fl = floor_steps(model, prompts, args.steps)
    print(json.dumps({"mlx": version("mlx"), "mlx_lm": version("mlx-lm"), "batch": args.batch,
                      "prompt_len": args.prompt_len,
                      "batchgenerator_step_ms": round(statistics.median(bg[2:]) * 1e3, 1),
                      "floor_step_ms": round(statistics.median(fl[2:]) * 1e3, 1)}), flush=True)


if __name__ == "__main__":
    main()
