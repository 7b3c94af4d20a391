"""Concurrent benchmark scenarios: run their plans on every system, timed and summarized.

The plans (each scenario's streams and requests) are built by ``concurrent_plans``;
the sequential S1..S5 live in ``scenarios``.

- ``C1``: 1, 4, 8 and 16 concurrent streams, each with its own prompt (never seen
  before) and a fixed output budget: aggregate decode tok/s, per-stream decode tok/s,
  TTFT p50 / p95.
- ``C2``: "main + 3 subagents": four agent conversations that share a long system
  prompt and tool definitions run at the same time, each a sequence of tool steps
  (Anthropic Messages where the system speaks it): Σ TTFT and token hit rate.
- ``E2`` .. ``E5``: speculative decoding's cases, each at 1 and 8 streams
  (``--streams`` overrides), greedy, every stream its own text: ``E2`` an edit (a code
  file returned with one identifier renamed, E1 per stream); ``E3`` an agentic replay
  with tool calls (read a file, then write it back changed through a tool call, then
  report on a test run whose output quotes the file: the replies repeat earlier tool
  output); ``E4`` a chat with nothing to copy (a story from a random prompt); ``E5`` the
  edit's next turn (a code file and a rename asked, then the same file and another name
  asked: turn 2's prompt shares the file with turn 1's, so its decode is what is
  measured; two rounds per stream count, over streams of their own). Per round:
  aggregate and per-stream decode tok/s and, for ours, the speculation counters over the
  round from ``/v1/cache/stats`` (drafted, accepted, acceptance rate, mean accepted
  length, tokens per verify forward).

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from .client import TurnResult, send_turn
from .concurrent_plans import SPEC_NAMES, ConcurrentPlan, Job
from .runner import WARMUP_MESSAGES, _fetch_stats
from .systems import OURS, SPECS, ServerProcess

SPEC_COUNTERS = ("spec_verifies", "spec_drafted", "spec_accepted", "spec_pool_drafted",
                 "spec_pool_accepted", "spec_gated", "spec_presync_gated", "spec_paused",
                 "spec_guard_off",
                 "decode_steps")
REQUEST_TIMEOUT_S = 3600.0  # a 16-stream round on a loaded 2-core machine is slow


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


def spec_delta(before: dict[str, Any] | None, after: dict[str, Any] | None
               ) -> dict[str, Any] | None:
    """The speculation counters over a round (``/v1/cache/stats`` → ``engine`` before and
    after it) with the acceptance rate (accepted / drafted), the mean accepted length
    (accepted / verify) and tokens per verify forward (1 + that); None without stats."""
    if not isinstance(before, dict) or not isinstance(after, dict):
        return None
    b, a = before.get("engine") or {}, after.get("engine") or {}
    d = {k: int(a.get(k) or 0) - int(b.get(k) or 0) for k in SPEC_COUNTERS}
    v, drafted, acc = d["spec_verifies"], d["spec_drafted"], d["spec_accepted"]
    return {**d, "acceptance_rate": acc / drafted if drafted else None,
            "mean_accepted": acc / v if v else None,
            "tokens_per_forward": 1 + acc / v if v else None}


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
            template = None
            if plan.chat_template is not None:
                template = work_dir / f"{plan.name}-chat-template.jinja"
                template.write_text(plan.chat_template, encoding="utf-8")
            srv = ServerProcess(system, model, log_dir / f"{plan.name}-{system}.log",
                                cache_dir=cache_dir if system != "nocache" else None,
                                chat_template=template)
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
                before = _fetch_stats(srv) if system in OURS else None
                rows = run_round(srv.base_url, out[system]["api"], srv.model_id, streams,
                                 max_tokens)
                summary = summarize_round(rows)
                if system in OURS:
                    summary["spec"] = spec_delta(before, _fetch_stats(srv))
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
    if name in SPEC_NAMES:
        lines += ["| streams | system | aggregate decode tok/s | per-stream tok/s | agg. decode "
                  "vs mlx_lm | vs no spec | acceptance rate | mean accepted | tokens / verify "
                  "| ok |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    elif name == "C1":
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
            if name in SPEC_NAMES:
                # the baseline without speculation (on by default: ours_nospec)
                ours = runs.get("ours_nospec", {}).get("rounds", {}).get(label, {}).get(
                    "summary", {})
                agg = s["aggregate_decode_tps"]
                vs = [agg / ref["aggregate_decode_tps"] if agg and ref.get(
                    "aggregate_decode_tps") else None for ref in (base, ours)]
                sp = s.get("spec") or {}
                rate = sp.get("acceptance_rate")
                lines.append(
                    f"| {label} | {system} | {f(agg, '', 1)} | "
                    f"{f(s['per_stream_decode_tps'], '', 1)} | {f(vs[0], '×')} | "
                    f"{f(vs[1], '×')} | {'—' if rate is None else f'{rate:.1%}'} | "
                    f"{f(sp.get('mean_accepted'))} | {f(sp.get('tokens_per_forward'))} | "
                    f"{s['ok']}/{s['requests']} |")
            elif name == "C1":
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
