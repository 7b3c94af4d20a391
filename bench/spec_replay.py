"""Speculation's gate replayed offline: many runs of one 8-stream round in seconds.

A round of ``promptcache bench`` at 8 streams takes minutes and its ratio moves by
±0.15 from run to run on this machine, so a change to the gate (``engine/speculation/speculator.py``,
``engine/speculation/cost.py``) cannot be judged from one run. This replays a round instead:
the greedy replies of its streams (recorded once with speculation off: the replies do
not depend on speculation) go through the engine's own ``Speculator`` (drafts from each
request's history, the gate, the credits, ``OnlineCost`` with the startup fit), and each
step takes the time a measured table says (a decode step of ``n`` rows; a verify of
``n`` rows and ``k`` drafts in decode steps, from ``bench_speculation.py --verify-cost
--rows``; its extra over a decode step scaled by ``--scale``: verifies inside a server
cost ~1.35x more than timed alone, measured 2026-12-06), times a uniform jitter of
``--jitter``, which is what the online cost sees. A verify keeps the longest draft prefix
the recorded reply agrees with, as the model would. Reported: the aggregate decode
speed-up over decoding without speculation (the same replay without the speculator)
over ``--seeds`` runs (the jitter's seed and which startup fit): min, 10th percentile,
median, max.

Not a measurement of the engine: the forward, the pipelining of plain steps and the
host work are not modelled. What it answers is how the gate's decisions turn a cost
model and acceptance into speed, and how often they stall.

``--mix``: also chat rows next to edit rows (E4's replies, recorded with ``--record
--scenario E4 --out FILE``): how much later the chats end than without speculation, and
how much sooner the edits.

Usage: .venv/bin/python bench/spec_replay.py --record [--scenario E5] [--out FILE]
       .venv/bin/python bench/spec_replay.py [--seeds 60] [--jitter 0.3] [--scale 1.35]
                                             [--mix FILE] [--cost cpu|h100-32b|h100-30b-a3b]
(record with OpenBLAS: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0)
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from promptcache.engine.speculation.cost import OnlineCost, VerifyCost
from promptcache.engine.speculation.speculator import Speculator
from promptcache.serving_config import EngineConfig

OUT = Path(__file__).parent / "out" / "spec_replay.json"
# decode step ms and verify cost in decode steps at k = 1, 2, 4, 8, 16, per batch size
# (bench_speculation.py --verify-cost --rows 1,2,4,8: 2026-12-06 for 1 and 8 rows,
# 2026-12-04 for 2 and 4; SmolLM2-135M fp32, OpenBLAS, 2 vCPUs)
TABLE: dict[int, tuple[float, dict[int, float]]] = {
    1: (67.0, {1: 1.15, 2: 1.31, 4: 1.49, 8: 1.94, 16: 2.86}),
    2: (80.0, {1: 1.32, 2: 1.57, 4: 2.05, 8: 2.31, 16: 3.44}),
    4: (110.0, {1: 1.13, 2: 2.05, 4: 1.96, 8: 2.73, 16: 5.33}),
    8: (176.0, {1: 1.42, 2: 1.71, 4: 2.16, 8: 3.31, 16: 5.60}),
}
# the startup fits (spec_cost.measure_verify_cost) of three server starts, 2026-12-06
FITS = (VerifyCost(0.05624, 0.006294, 0.009792, 6.88e-06, 1024),
        VerifyCost(0.06248, 0.005876, 0.010366, 5.42e-06, 1024),
        VerifyCost(0.06205, 0.006189, 0.011085, 4.1e-07, 1024))
Table = dict[int, tuple[float, dict[int, float]]]
# ``--cost``: the table and startup fits above ("cpu"), or those measured on one H100 with
# mlx[cuda] 0.32.4 over 8,192 tokens of context per row (bench_gpu.py, 2026-12-06, random
# weights, 4-bit): a Qwen3-32B-shaped dense model and a Qwen3-30B-A3B-shaped MoE
COSTS: dict[str, tuple[Table, tuple[VerifyCost, ...]]] = {
    "cpu": (TABLE, FITS),
    "h100-32b": ({1: (26.2, {1: 1.86, 2: 2.50, 4: 3.76, 8: 2.21, 16: 3.01}),
                  8: (133.0, {1: 1.13, 2: 1.13, 4: 1.15, 8: 1.14, 16: 1.81})},
                 (VerifyCost(0.02498, 0.0006357, 0.01751, 0.0, 1024),)),
    "h100-30b-a3b": ({1: (11.1, {1: 1.50, 2: 1.77, 4: 1.95, 8: 2.72, 16: 3.55}),
                      8: (29.7, {1: 1.36, 2: 1.59, 4: 2.07, 8: 3.02, 16: 4.74})},
                     (VerifyCost(0.009789, 0.0011466, 0.0, 2.69e-07, 1024),
                      VerifyCost(0.01924, 0.0006444, 0.001569, 2.79e-06, 1024))),
}


def _interp(points: dict[int, float], x: float, at_zero: float) -> float:
    xs = sorted(points)
    if x <= xs[0]:
        return at_zero + (points[xs[0]] - at_zero) * x / xs[0]
    if x >= xs[-1]:
        return points[xs[-1]]
    lo = max(k for k in xs if k <= x)
    hi = min(k for k in xs if k >= x)
    return points[lo] if lo == hi else \
        points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


def step_ms(rows: int, width: int, scale: float, table: Table = TABLE) -> float:
    """A step of ``rows`` rows feeding ``width`` positions each, in ms (the table)."""
    decode = _interp({n: ms for n, (ms, _) in table.items()}, rows, 0.0)
    if width <= 1:
        return decode
    per_size = {n: _interp(ks, width - 1, 1.0) for n, (_, ks) in table.items()}
    return decode * (1.0 + (_interp(per_size, rows, 1.0) - 1.0) * scale)


class Row:
    """A request as the speculator sees it, its reply known in advance."""

    def __init__(self, i: int, prompt: list[int], reply: list[int]) -> None:
        self.request_id = f"r{i}"
        self.n_prompt = len(prompt)
        self.seq = np.array(prompt + reply, dtype=np.int64)
        self.reply = reply
        self.output = reply[:1]  # the first token comes with the prefill
        self.processors: list[Any] = []
        self.sampler = SimpleNamespace(greedy=True)
        self.ctx = SimpleNamespace(logits_hook=None)
        self.usage = SimpleNamespace(spec_drafted=0, spec_accepted=0)
        self.req = SimpleNamespace(tenant="t", sampling=SimpleNamespace(max_tokens=len(reply)))

    @property
    def pos(self) -> int:
        return self.n_prompt + len(self.output) - 1

    @property
    def done(self) -> bool:
        return len(self.output) >= len(self.reply)


def replay(prompts: list[list[int]], replies: list[list[int]], *, speculate: bool,
           seed: int, jitter: float, scale: float, ends: list[float] | None = None,
           cost_of: str = "cpu") -> float:
    """Seconds until the last reply is complete (each reply's end into ``ends``)."""
    from mlx_lm.models.cache import BatchKVCache

    rng = random.Random(seed)
    rows = [Row(i, p, r) for i, (p, r) in enumerate(zip(prompts, replies, strict=True))]
    if ends is not None:
        ends[:] = [0.0] * len(rows)
    cache = [BatchKVCache([0] * len(rows))]
    table, fits = COSTS[cost_of]
    cost = OnlineCost(fits[seed % len(fits)])
    spec = Speculator(EngineConfig(speculation="suffix"), cost=cost)
    now = [0.0]
    spec.clock = lambda: now[0]
    while rows:
        n = len(rows)
        context = max(r.pos for r in rows)
        noise = 1.0 + jitter * (2.0 * rng.random() - 1.0) if speculate else 1.0
        width, tokens = 1, n
        if speculate and spec.eligible(rows, cache, None) and not spec.waiting(rows) \
                and spec.presync(rows, cache, None, [True] * n):
            spec.step_started()
            drafts: list[Any] = [spec.propose(r) for r in rows]
            cut = spec.plan(rows, drafts, cache, None)
            if cut:
                drafts = [tuple(d[:cut]) for d in drafts]
                width = 1 + max(len(d) for d in drafts)
                for r, d in zip(rows, drafts, strict=True):
                    at, kept = len(r.output), 0
                    while kept < len(d) and at + kept < len(r.reply) \
                            and d[kept] == r.reply[at + kept]:
                        kept += 1
                    if d:
                        spec.feedback(r, len(d), kept)
                    r.output = r.reply[:at + 1 + kept]
                    tokens += kept
                spec.settle(rows)
        seconds = step_ms(n, width, scale, table) * noise / 1e3
        now[0] += seconds
        if width > 1:
            spec.observe_verify(n, width, seconds, context)
            spec.step_done(n, width, tokens, context)
        else:
            for r in rows:
                r.output = r.reply[:len(r.output) + 1]
            if speculate:
                spec.observe_decode(n, seconds, context)
        for r in rows:
            if r.done:
                spec.forget(r)
                if ends is not None:
                    ends[int(r.request_id[1:])] = now[0]
        rows = [r for r in rows if not r.done]
    return now[0]


def mixed(edits: dict[str, Any], chats: dict[str, Any], n_edit: int, chat_tokens: int
          ) -> tuple[list[list[int]], list[list[int]]]:
    """``n_edit`` edit rows from their 40th reply token on (past the preamble: they copy
    at once) and chat rows (E4's) of ``chat_tokens`` tokens, 8 in all."""
    prompts = [p + r[:40] for p, r in zip(edits["prompts"][:n_edit],
                                          edits["replies"][:n_edit], strict=True)]
    replies = [r[40:] for r in edits["replies"][:n_edit]]
    prompts += chats["prompts"][n_edit:8]
    replies += [r[:chat_tokens] for r in chats["replies"][n_edit:8]]
    return prompts, replies


def record(scenario: str, streams: int, out: Path) -> None:
    from harness.concurrent_plans import build
    from promptcache.config import CacheConfig
    from promptcache.engine.api import GenerationRequest, SamplingParams
    from promptcache.engine.engine import Engine
    from promptcache.engine.models.gguf import ensure_default_model

    plan = build(scenario, streams=[streams])
    eng = Engine.load(ensure_default_model(), EngineConfig(speculation="off"), CacheConfig())
    rounds = []
    try:
        for jobs in plan.rounds:
            prompts = [eng.render_chat(list(s[0].messages), tools=list(s[0].tools) or None)
                       for s in jobs]
            handles = [eng.submit(GenerationRequest(tuple(p), SamplingParams(
                max_tokens=plan.max_tokens or 160, temperature=0.0))) for p in prompts]
            replies = [list(h.result().tokens) for h in handles]
            rounds.append({"prompts": prompts, "replies": replies})
            print(f"recorded a round of {len(prompts)}", flush=True)
    finally:
        eng.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"scenario": scenario, "streams": streams, "rounds": rounds}))
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", action="store_true", help="record the replies first")
    ap.add_argument("--scenario", default="E5")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--seeds", type=int, default=60)
    ap.add_argument("--jitter", type=float, default=0.3)
    ap.add_argument("--scale", type=float, default=1.35)
    ap.add_argument("--cost", choices=sorted(COSTS), default="cpu",
                    help="step times and startup fits: this CPU's, or one H100's")
    ap.add_argument("--mix", type=Path, default=None, metavar="CHAT_FILE",
                    help="also: chat rows (a recording of E4) next to edit rows (--out's "
                         "turn 1): 4 + 4 of 160 tokens, 7 edits + 1 chat of 60")
    args = ap.parse_args()
    if args.record:
        record(args.scenario, args.streams, args.out)
        return
    data = json.loads(args.out.read_text())
    if args.mix is not None:
        chats = json.loads(args.mix.read_text())["rounds"][0]
        for n_edit, chat_tokens in ((4, 160), (7, 60)):
            prompts, replies = mixed(data["rounds"][0], chats, n_edit, chat_tokens)
            off: list[float] = []
            replay(prompts, replies, speculate=False, seed=0, jitter=args.jitter,
                   scale=args.scale, ends=off, cost_of=args.cost)
            slow, fast = [], []
            for s in range(args.seeds):
                on: list[float] = []
                replay(prompts, replies, speculate=True, seed=s, jitter=args.jitter,
                       scale=args.scale, ends=on, cost_of=args.cost)
                slow.append(max(on[i] / off[i] for i in range(n_edit, 8)))
                fast.append(sum(off[i] / on[i] for i in range(n_edit)) / n_edit)
            slow.sort()
            fast.sort()
            print(f"{n_edit} edits + {8 - n_edit} chats of {chat_tokens} tokens: the slowest "
                  f"chat ends at {slow[len(slow) // 2]:.2f}x its time without speculation "
                  f"(median; worst {slow[-1]:.2f}), the edits {fast[len(fast) // 2]:.2f}x "
                  f"faster (median) ({args.seeds} runs)")
    for i, rnd in enumerate(data["rounds"]):
        off = replay(rnd["prompts"], rnd["replies"], speculate=False, seed=0,
                     jitter=args.jitter, scale=args.scale, cost_of=args.cost)
        ups = sorted(off / replay(rnd["prompts"], rnd["replies"], speculate=True, seed=s,
                                  jitter=args.jitter, scale=args.scale, cost_of=args.cost)
                     for s in range(args.seeds))
        print(f"{data['scenario']} round {i + 1} ({len(rnd['prompts'])} streams): speed-up "
              f"over decoding min {ups[0]:.2f}, p10 {ups[len(ups) // 10]:.2f}, median "
              f"{ups[len(ups) // 2]:.2f}, max {ups[-1]:.2f} ({args.seeds} runs)")


if __name__ == "__main__":
    main()
