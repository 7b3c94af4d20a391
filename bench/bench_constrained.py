"""What constrained decoding costs per generated token (engine/formats/constrained.py).

First ("lockstep"), two greedy decodes of the default model (SmolLM2-135M-Instruct),
one of them under a JSON-schema logits processor, advanced one token each in turn, so
both see the same moment's load (the ratio that survives a shared machine). Then
decodes with mlx-lm's ``generate_step``, without and with the processor, alternating
whole runs ``--rounds`` times (paired ratios), and times the processor's own work per
call (feeding the sampled token to the matcher, the llguidance
bitmask, unpacking it and masking the logits) in a third run where each step's forward
pass is finished before the processor starts (the processor normally reads the new
token, launches the forward pass and computes the mask while it runs). Also the one-off costs: the tokenizer
bridge (once per tokenizer), compiling the schema (once per schema, cached) and the copy
each request gets.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        .venv/bin/python bench/bench_constrained.py [--tokens 128] [--rounds 5] [--markdown]
        [--engine | --alone]

``--rounds 0``: the lockstep decodes and the processor alone only.

``--engine``: the same schema through the batched engine (engine/requests/scheduler.py): batches
of 4 requests with 0, 2 or 4 rows constrained (the mask of one row is computed while
the batch's forward pass runs; other rows are untouched).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402

from promptcache.engine.api import Constraint  # noqa: E402
from promptcache.engine.formats import constrained  # noqa: E402
from promptcache.engine.models.gguf import ensure_default_model  # noqa: E402

# a schema whose answer is long enough to measure: 24 short strings
SCHEMA = {"type": "object", "properties": {"cities": {
    "type": "array", "items": {"type": "string", "maxLength": 24},
    "minItems": 24, "maxItems": 24}}, "required": ["cities"], "additionalProperties": False}
PROMPT = "List 24 European cities as JSON: {\"cities\": [...]}"


class Timed:
    """Wraps a processor and records the wall time of each call: the forward pass is
    evaluated first, then the processor runs and its output is evaluated (so the lazy
    masking is inside the measurement)."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc
        self.times: list[float] = []

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        mx.eval(tokens, logits)  # the forward pass is not the processor's time
        t = time.perf_counter()
        out = self.proc(tokens, logits)
        mx.eval(out)
        self.times.append(time.perf_counter() - t)
        return out


class ReadsTokens:
    """A processor that only reads the new token (what any logits processor must do) and
    leaves the logits alone: the cost of having a processor at all."""

    def __init__(self) -> None:
        self.seen: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = int(tokens.size)
        if self.seen is not None and n > self.seen:
            tokens[self.seen:].tolist()
        self.seen = n
        return logits


def decode(model: Any, prompt: mx.array, n: int, processors: list[Any] | None
           ) -> tuple[float, int]:
    """Seconds per generated token after the first (the prefill is left out)."""
    t_first = None
    count = 0
    for tok, _ in generate_step(prompt, model, max_tokens=n, logits_processors=processors):
        mx.eval(tok)
        count += 1
        if t_first is None:
            t_first = time.perf_counter()
    end = time.perf_counter()
    return (end - (t_first or end)) / max(1, count - 1), count


def lockstep(model: Any, prompt: mx.array, n: int, proc: Any
             ) -> tuple[list[float], list[float]]:
    """Two greedy decodes of the same prompt advanced in lockstep, one token each in
    turn (the order alternating every step), the second under ``proc``: per-step wall
    times (forward, processor, argmax, evaluated) of each. Both see the machine's load
    of the same moment, so their ratio survives a shared machine's swings."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = [make_prompt_cache(model), make_prompt_cache(model)]
    seq = prompt.tolist()
    ys = []
    for k, cache in enumerate(caches):
        logits = model(prompt[None], cache=cache)[:, -1, :]
        if k == 1:
            logits = proc(mx.array(seq), logits)
        ys.append(mx.argmax(logits, axis=-1))
        mx.eval(ys[-1])
    times: list[list[float]] = [[], []]
    for step in range(n):
        for k in ((0, 1) if step % 2 == 0 else (1, 0)):
            t = time.perf_counter()
            logits = model(ys[k][:, None], cache=caches[k])[:, -1, :]
            if k == 1:
                seq.append(int(ys[1].item()))
                logits = proc(mx.array(seq), logits)
            ys[k] = mx.argmax(logits, axis=-1)
            mx.eval(ys[k])
            times[k].append(time.perf_counter() - t)
    return times[0], times[1]


def processor_alone(c: Constraint, tok: Any, vocab: int, answer: str, repeat: int
                    ) -> tuple[list[float], list[float]]:
    """The processor on its own (fixed logits, no model): per call, the whole call and
    the bitmask alone, feeding the tokens of ``answer`` one by one."""
    ids = tok.encode(answer, add_special_tokens=False)
    logits = mx.zeros((1, vocab))
    mx.eval(logits)
    whole, masks = [], []
    for _ in range(repeat):
        proc = constrained.logits_processor(c, tok, vocab)
        seq = [1, 2, 3]
        mx.eval(proc(mx.array(seq), logits))
        for t in ids:
            seq.append(t)
            arr = mx.array(seq)
            mx.eval(arr)
            t0 = time.perf_counter()
            mx.eval(proc(arr, logits))
            whole.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            proc.allowed()  # type: ignore[attr-defined]
            masks.append(time.perf_counter() - t0)
    return whole, masks


STORIES = ["Write a long story about a lighthouse keeper.",
           "Write a long story about a lost dog in a big city.",
           "Write a long story about a baker who can fly.",
           "Write a long story about two rival chess players."]


def engine_batches(path: Path, tokens: int, rounds: int) -> list[tuple[str, str]]:
    """Through the batched engine: a batch of 4 requests submitted together, with 0, 2
    (rows 0 and 2) or 4 of them under the JSON schema; the time per decode step while
    all 4 rows decode (token arrival times, so the rows' prefills are left out), and its
    ratio to the all-unconstrained batch of the same round."""
    from promptcache.engine.api import GenerationRequest, SamplingParams, TokenEvent
    from promptcache.engine.engine import Engine
    from promptcache.serving_config import EngineConfig

    eng = Engine.load(path, EngineConfig(), cache=None)
    try:
        prompts = [eng.render_chat([{"role": "user", "content": s}]) for s in STORIES]
        c = Constraint("json_schema", json.dumps(SCHEMA))

        def batch(constrained_rows: set[int]) -> tuple[float, list[int], list[str]]:
            """Seconds per decode step while all 4 rows decode (the window from the
            last row's first token to the first row's last token)."""
            handles = [eng.submit(GenerationRequest(
                prompt_tokens=tuple(p), sampling=SamplingParams(max_tokens=tokens),
                use_cache=False, constraint=c if i in constrained_rows else None))
                for i, p in enumerate(prompts)]
            stamps: list[list[float]] = [[] for _ in handles]

            def read(i: int) -> None:
                for ev in handles[i].events():
                    if isinstance(ev, TokenEvent):
                        stamps[i].append(time.perf_counter())

            threads = [threading.Thread(target=read, args=(i,)) for i in range(len(handles))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            res = [h.result(timeout=3600) for h in handles]
            lo = max(s[0] for s in stamps)
            hi = min(s[-1] for s in stamps)
            steps = statistics.median(sum(1 for x in s if lo < x <= hi) for s in stamps)
            return (hi - lo) / max(1, steps), [len(r.tokens) for r in res], \
                [r.finish_reason for r in res]

        batch(set())  # warm up
        configs = {"none": set(), "half": {0, 2}, "all": {0, 1, 2, 3}}
        ms: dict[str, list[float]] = {k: [] for k in configs}
        ratio: dict[str, list[float]] = {k: [] for k in configs}
        counts: dict[str, list[int]] = {}
        for _ in range(rounds):
            base = 0.0
            for name, rows in configs.items():
                t, n, _ = batch(rows)
                ms[name].append(t)
                counts[name] = n
                if name == "none":
                    base = t
                ratio[name].append(t / base)
    finally:
        eng.close()
    out = []
    for name, label in (("none", "0 of 4"), ("half", "2 of 4"), ("all", "4 of 4")):
        r = ratio[name]
        value = (f"{statistics.median(ms[name]) * 1e3:.1f} ms; ratio {statistics.median(r):.3f} "
                 f"(range {min(r):.3f}-{max(r):.3f}); tokens per row {counts[name]}")
        out.append((f"engine, batch of 4, {label} constrained: time per decode step (median), "
                    "ratio to 0 of 4 (median of paired ratios)", value))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--engine", action="store_true",
                    help="only the batched engine: batches of 4 with 0 / 2 / 4 rows constrained")
    ap.add_argument("--alone", action="store_true",
                    help="only the processor on its own (no decoding runs)")
    args = ap.parse_args()
    path = ensure_default_model(REPO / ".models" / "default")
    if args.engine:
        rows = engine_batches(path, args.tokens, args.rounds)
        rows.append(("load average (1 min) at the end", f"{os.getloadavg()[0]:.1f}"))
        _print(rows, args.markdown)
        return
    model, tok = load(str(path))
    vocab = int(model.args.vocab_size)
    c = Constraint("json_schema", json.dumps(SCHEMA))

    t = time.perf_counter()
    constrained.ll_tokenizer(tok, vocab)
    bridge_s = time.perf_counter() - t
    t = time.perf_counter()
    constrained.prepare(c, tok, vocab)
    compile_s = time.perf_counter() - t
    t = time.perf_counter()
    constrained.logits_processor(c, tok, vocab)
    copy_s = time.perf_counter() - t

    text = tok.apply_chat_template([{"role": "user", "content": PROMPT}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = mx.array(tok.encode(text))
    decode(model, prompt, 8, None)  # warm up
    plain: list[float] = []
    cons: list[float] = []
    serial: list[float] = []
    ratios: list[float] = []
    serial_ratios: list[float] = []
    sync_ratios: list[float] = []
    calls: list[float] = []
    n_cons = 0
    plain_ls, cons_ls = ([], []) if args.alone else lockstep(
        model, prompt, args.tokens, constrained.logits_processor(c, tok, vocab))
    step_ratios = [b / a for a, b in zip(plain_ls, cons_ls, strict=True)]
    for _ in range(0 if args.alone else args.rounds):
        p, _ = decode(model, prompt, args.tokens, None)
        q, n_cons = decode(model, prompt, args.tokens,
                           [constrained.logits_processor(c, tok, vocab)])
        timed = Timed(constrained.logits_processor(c, tok, vocab))
        r, _ = decode(model, prompt, args.tokens, [timed])
        s_, _ = decode(model, prompt, args.tokens, [ReadsTokens()])
        sync_ratios.append(s_ / p)
        plain.append(p)
        cons.append(q)
        serial.append(r)
        ratios.append(q / p)
        serial_ratios.append(r / p)
        calls += timed.times[1:]
    answer = json.dumps({"cities": [f"City number {i}" for i in range(24)]})
    whole, masks = processor_alone(c, tok, vocab, answer, 5)
    load1 = os.getloadavg()[0]
    rows = [] if args.alone else [
        ("lockstep: ms/token unconstrained / JSON schema (median)",
         f"{statistics.median(plain_ls) * 1e3:.2f} / {statistics.median(cons_ls) * 1e3:.2f}"),
        ("lockstep: constrained / unconstrained, total time of the two decodes",
         f"{sum(cons_ls) / sum(plain_ls):.3f}"),
        ("lockstep: constrained / unconstrained per step (median, p10-p90)",
         f"{statistics.median(step_ratios):.3f} ({sorted(step_ratios)[len(step_ratios) // 10]:.3f}"
         f"-{sorted(step_ratios)[len(step_ratios) * 9 // 10]:.3f})"),
    ]
    rows += [] if args.alone or not args.rounds else [
        ("decode ms/token, unconstrained (median)", f"{statistics.median(plain) * 1e3:.2f}"),
        ("decode ms/token, JSON schema (median)", f"{statistics.median(cons) * 1e3:.2f}"),
        ("constrained / unconstrained (median of paired ratios)",
         f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})"),
        ("the same with the mask computed after the forward pass (no overlap)",
         f"{statistics.median(serial_ratios):.3f} "
         f"(range {min(serial_ratios):.3f}-{max(serial_ratios):.3f})"),
        ("a processor that only reads the new token / unconstrained",
         f"{statistics.median(sync_ratios):.3f} "
         f"(range {min(sync_ratios):.3f}-{max(sync_ratios):.3f})"),
        ("processor call ms, after the forward pass (median / p90)",
         f"{statistics.median(calls) * 1e3:.3f} / "
         f"{sorted(calls)[int(len(calls) * 0.9)] * 1e3:.3f}"),
        ("tokens generated per constrained run", str(n_cons)),
    ]
    rows += [
        ("processor alone, no model: call ms (median / p90)",
         f"{statistics.median(whole) * 1e3:.3f} / {sorted(whole)[int(len(whole) * 0.9)] * 1e3:.3f}"),
        ("processor alone: llguidance bitmask + unpack ms (median / p90)",
         f"{statistics.median(masks) * 1e3:.3f} / {sorted(masks)[int(len(masks) * 0.9)] * 1e3:.3f}"),
        ("tokenizer bridge (once per tokenizer) s", f"{bridge_s:.2f}"),
        ("schema compile (once per schema) ms", f"{compile_s * 1e3:.1f}"),
        ("per-request matcher copy ms", f"{copy_s * 1e3:.2f}"),
        ("load average (1 min) at the end", f"{load1:.1f}"),
    ]
    _print(rows, args.markdown)


def _print(rows: list[tuple[str, str]], markdown: bool) -> None:
    if markdown:
        print("| measure | value |\n| --- | --- |")
        for k, v in rows:
            print(f"| {k} | {v} |")
    else:
        for k, v in rows:
            print(f"{k:58s} {v}")


if __name__ == "__main__":
    main()
