"""Concurrent benchmark scenarios (the sequential S1..S5 live in ``scenarios``).

- ``C1``: 1, 4, 8 and 16 concurrent streams, each with its own prompt (never seen
  before) and a fixed output budget: aggregate decode tok/s, per-stream decode tok/s,
  TTFT p50 / p95.
- ``C2``: "main + 3 subagents": four agent conversations that share a long system
  prompt and tool definitions run at the same time, each a sequence of tool steps
  (Anthropic Messages where the system speaks it): Σ TTFT and token hit rate.

Every system gets one fresh server per scenario, started and warmed up as in
``runner``; all of them stay up and take turns round by round, in a rotating order
(``run_plans``), so that load changes on a shared machine hit every system alike.
Requests of one round are released together (a barrier), one thread and one HTTP
connection per stream.
"""

from __future__ import annotations

import os
import shutil
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .client import TurnResult, send_turn
from .runner import WARMUP_MESSAGES
from .scenarios import THINK_CLOSE, THINK_OPEN, TextGen, _tool_defs
from .systems import SPECS, ServerProcess

CONCURRENT_NAMES = ("C1", "C2")
STREAM_COUNTS = (1, 4, 8, 16)
REQUEST_TIMEOUT_S = 3600.0  # a 16-stream round on a loaded 2-core machine is slow

Messages = tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class Job:
    """One request of a concurrent round: its stream and its full history."""

    stream: int
    index: int
    messages: Messages
    tools: tuple[dict[str, Any], ...] = ()


@dataclass
class Timed:
    stream: int
    index: int
    start: float  # perf_counter when the request was sent
    result: TurnResult

    @property
    def first(self) -> float | None:
        return None if self.result.ttft_s is None else self.start + self.result.ttft_s

    @property
    def end(self) -> float | None:
        return None if self.result.total_s is None else self.start + self.result.total_s

    def to_dict(self, t0: float = 0.0) -> dict[str, Any]:
        d = {"stream": self.stream, "index": self.index, "start_s": self.start - t0,
             **self.result.to_dict()}
        d.pop("text", None)
        return d


@dataclass(frozen=True)
class ConcurrentPlan:
    name: str
    title: str
    api: str
    # C1: one round per entry (all jobs of a round at once); C2: one round of
    # conversations whose turns run in order within a conversation
    rounds: tuple[tuple[tuple[Job, ...], ...], ...]
    labels: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)


def _sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"prompt": 60, "output": 8, "system": 200, "tools": 2, "steps": 2, "result": 40,
                "counts": 2}
    return {"prompt": 200, "output": 64, "system": 1500, "tools": 6, "steps": 3, "result": 200,
            "counts": len(STREAM_COUNTS)}


def build(name: str, *, quick: bool = False, seed: int = 0,
          streams: Sequence[int] | None = None) -> ConcurrentPlan:
    """``streams``: C1's stream counts, one round each (default 1/4/8/16; --quick 1/4)."""
    key = name.strip().upper()
    sz = _sizes(quick)
    g = TextGen(seed * 1000 + 100 + CONCURRENT_NAMES.index(key)) if key in CONCURRENT_NAMES \
        else None
    if key == "C1" and g is not None:
        counts = STREAM_COUNTS[: sz["counts"]] if not quick else (1, 4)
        if streams:
            counts = tuple(streams)
        rounds = []
        for n in counts:
            jobs = []
            for s in range(n):
                msgs = ({"role": "system", "content": f"You are writer number {s}."},
                        {"role": "user", "content": "Write a long, detailed story that continues "
                                                    "this text: " + g.text(sz["prompt"])})
                jobs.append((Job(s, 0, msgs),))
            rounds.append(tuple(jobs))
        return ConcurrentPlan(
            "C1", f"{'/'.join(str(n) for n in counts)} concurrent streams (~{sz['prompt']}-token prompts, "
                  f"{sz['output']} output tokens each)", "openai", tuple(rounds),
            labels=tuple(str(n) for n in counts))
    if key == "C2" and g is not None:
        tools = tuple(_tool_defs(g, sz["tools"], max(20, sz["system"] // (3 * sz["tools"]))))
        system = "You are a coding agent working in a repository. " + g.text(sz["system"])
        convs = []
        for c in range(4):
            role = "main agent" if c == 0 else f"subagent {c}"
            task = {"role": "user", "content": f"[{role}] Task: " + g.text(100)}
            history: list[dict[str, Any]] = [{"role": "system", "content": system}, task]
            turns = []
            for k in range(sz["steps"]):
                turns.append(Job(c, k, tuple(dict(m) for m in history), tools))
                fn = tools[k % len(tools)]["function"]["name"]
                call = g.ident("call")
                history.append({
                    "role": "assistant",
                    "content": f"{THINK_OPEN}{g.text(40)}{THINK_CLOSE}\n{g.text(20)}",
                    "tool_calls": [{"id": call, "type": "function", "function": {
                        "name": fn, "arguments": f'{{"path": "src/{g.ident("mod")}.py"}}'}}]})
                history.append({"role": "tool", "tool_call_id": call, "name": fn,
                                "content": g.text(sz["result"])})
            convs.append(tuple(turns))
        return ConcurrentPlan(
            "C2", f"main + 3 subagents: 4 concurrent agent conversations sharing a "
                  f"~{sz['system']}-token system prompt + {sz['tools']} tools, "
                  f"{sz['steps']} tool steps each", "anthropic", (tuple(convs),),
            labels=("4 agents",))
    raise ValueError(f"unknown concurrent scenario {name!r}; expected one of "
                     f"{', '.join(CONCURRENT_NAMES)}")


def output_tokens(quick: bool) -> int:
    return _sizes(quick)["output"]


def run_round(base_url: str, api: str, model_id: str, streams: Sequence[Sequence[Job]],
              max_tokens: int) -> list[Timed]:
    """Run each stream's jobs in order, all streams at once; never raises."""
    barrier = threading.Barrier(len(streams))
    out: list[Timed] = []
    lock = threading.Lock()

    def worker(jobs: Sequence[Job]) -> None:
        with httpx.Client() as client:
            barrier.wait()
            for job in jobs:
                t = time.perf_counter()
                res = send_turn(client, base_url, api, model_id, job.messages, job.tools,
                                max_tokens=max_tokens, timeout_s=REQUEST_TIMEOUT_S)
                with lock:
                    out.append(Timed(job.stream, job.index, t, res))

    threads = [threading.Thread(target=worker, args=(jobs,), daemon=True) for jobs in streams]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return sorted(out, key=lambda r: (r.stream, r.index))


def _pct(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    vs = sorted(values)
    k = (len(vs) - 1) * q
    lo, hi = int(k), min(len(vs) - 1, int(k) + 1)
    return vs[lo] + (vs[hi] - vs[lo]) * (k - lo)


def summarize_round(rows: Sequence[Timed]) -> dict[str, Any]:
    """Throughput = Σ completion tokens / (last end - first send); aggregate decode
    tok/s = Σ (completion - 1) / (last end - first first-token); per stream:
    (completion - 1) / (end - first token), median; TTFT p50 / p95; hit rate."""
    ok = [r for r in rows if r.result.ok and r.first is not None and r.end is not None]
    ttfts = [r.result.ttft_s for r in ok if r.result.ttft_s is not None]
    decoded = [max(0, (r.result.completion_tokens or 0) - 1) for r in ok]
    per_stream = [d / (r.end - r.first) for r, d in zip(ok, decoded, strict=True)
                  if r.end is not None and r.first is not None and r.end > r.first and d > 0]
    span = (max(r.end for r in ok if r.end is not None)
            - min(r.first for r in ok if r.first is not None)) if ok else 0.0
    wall = (max(r.end for r in ok if r.end is not None) - min(r.start for r in ok)) if ok else 0.0
    prompt = sum(r.result.prompt_tokens or 0 for r in ok)
    cached = [r.result.cached_tokens for r in ok]
    return {
        "requests": len(rows), "ok": len(ok),
        "completion_tokens": sum(r.result.completion_tokens or 0 for r in ok),
        "throughput_tps": (sum(r.result.completion_tokens or 0 for r in ok) / wall)
        if wall > 0 else None,
        "aggregate_decode_tps": (sum(decoded) / span) if span > 0 else None,
        "per_stream_decode_tps": statistics.median(per_stream) if per_stream else None,
        "ttft_p50_s": _pct(ttfts, 0.5), "ttft_p95_s": _pct(ttfts, 0.95),
        "sum_ttft_s": sum(ttfts) if ttfts else None,
        "hit_rate": (sum(c or 0 for c in cached) / prompt)
        if prompt and all(c is not None for c in cached) else None,
        "errors": sorted({r.result.error or "" for r in rows if not r.result.ok}),
    }


def run_plans(systems: Sequence[str], plan: ConcurrentPlan, model: str, work_dir: Path,
              log_dir: Path, *, max_tokens: int, progress: Callable[[str], None] | None = None
              ) -> dict[str, dict[str, Any]]:
    """Every system's server is up for the whole plan and the systems take turns round
    by round (the order rotates), so load drift on a shared machine hits them alike.
    Idle servers use ~no CPU (vllm-mlx: ~5% of a core). Returns a run dict per system."""
    say = progress or (lambda _m: None)
    servers: dict[str, ServerProcess] = {}
    out: dict[str, dict[str, Any]] = {}
    try:
        for system in systems:
            api = plan.api if (plan.api == "openai" or SPECS[system].anthropic) else "openai"
            out[system] = {"system": system, "api": api, "rounds": {}, "error": None}
            cache_dir = work_dir / f"{plan.name}-{system}"
            shutil.rmtree(cache_dir, ignore_errors=True)
            cache_dir.mkdir(parents=True)
            srv = ServerProcess(system, model, log_dir / f"{plan.name}-{system}.log",
                                cache_dir=cache_dir if system != "nocache" else None)
            try:
                srv.start()
                with httpx.Client() as client:
                    warm = send_turn(client, srv.base_url, api, srv.model_id, WARMUP_MESSAGES,
                                     max_tokens=2)
                if not warm.ok:
                    raise RuntimeError(f"warm-up request failed: {warm.error}")
                servers[system] = srv
            except Exception as e:  # noqa: BLE001 - one system failing must not stop the bench
                out[system]["error"] = f"{type(e).__name__}: {e}"
                srv.stop()
        for k, (label, streams) in enumerate(zip(plan.labels, plan.rounds, strict=True)):
            names = list(servers)
            names = names[k % len(names):] + names[: k % len(names)] if names else names
            for system in names:
                srv = servers[system]
                t = time.time()
                rows = run_round(srv.base_url, out[system]["api"], srv.model_id, streams,
                                 max_tokens)
                summary = summarize_round(rows)
                t0 = min((r.start for r in rows), default=0.0)
                out[system]["rounds"][label] = {
                    "summary": summary, "started_at": t, "load_avg": os.getloadavg()[0],
                    "requests": [r.to_dict(t0) for r in rows]}
                say(f"  {plan.name}/{system} [{label}]: {summary['ok']}/{summary['requests']} ok, "
                    f"throughput {summary['throughput_tps'] or 0:.1f} tok/s, aggregate decode "
                    f"{summary['aggregate_decode_tps'] or 0:.1f} tok/s, TTFT p95 "
                    f"{(summary['ttft_p95_s'] or 0):.2f} s (load {os.getloadavg()[0]:.1f})")
    finally:
        for system, srv in servers.items():
            srv.stop()
            out[system]["peak_rss"] = srv.peak_rss
    return out


def markdown(name: str, plan_title: str, runs: dict[str, dict[str, Any]]) -> str:
    """A table per concurrent scenario: one row per (round, system)."""
    lines = [f"### {name}: {plan_title}", ""]
    if name == "C1":
        lines += ["| streams | system | throughput tok/s | aggregate decode tok/s | "
                  "per-stream tok/s | TTFT p50 | TTFT p95 | ok | agg. decode vs mlx_lm |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    else:
        lines += ["| round | system | Σ TTFT | TTFT p50 | TTFT p95 | token hit rate | ok |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
    labels: list[str] = []
    for run in runs.values():
        for label in run.get("rounds", {}):
            if label not in labels:
                labels.append(label)

    def f(v: float | None, unit: str = "", digits: int = 2) -> str:
        return "—" if v is None else f"{v:.{digits}f}{unit}"

    for label in labels:
        base = runs.get("mlx_lm", {}).get("rounds", {}).get(label, {}).get("summary", {})
        for system, run in runs.items():
            s = run.get("rounds", {}).get(label, {}).get("summary")
            if s is None:
                lines.append(f"| {label} | {system} | {run.get('error') or 'not run'} |")
                continue
            if name == "C1":
                ratio = None
                if base.get("aggregate_decode_tps") and s["aggregate_decode_tps"]:
                    ratio = s["aggregate_decode_tps"] / base["aggregate_decode_tps"]
                lines.append(
                    f"| {label} | {system} | {f(s.get('throughput_tps'), '', 1)} | "
                    f"{f(s['aggregate_decode_tps'], '', 1)} | "
                    f"{f(s['per_stream_decode_tps'], '', 1)} | {f(s['ttft_p50_s'], ' s')} | "
                    f"{f(s['ttft_p95_s'], ' s')} | {s['ok']}/{s['requests']} | {f(ratio, '×')} |")
            else:
                hit = s.get("hit_rate")
                lines.append(
                    f"| {label} | {system} | {f(s['sum_ttft_s'], ' s')} | "
                    f"{f(s['ttft_p50_s'], ' s')} | {f(s['ttft_p95_s'], ' s')} | "
                    f"{'—' if hit is None else f'{hit:.1%}'} | {s['ok']}/{s['requests']} |")
    return "\n".join(lines) + "\n"
