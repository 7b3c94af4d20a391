"""S6: two servers sharing one Redis (`promptcache bench --scenarios S6`).

A 10-turn chat (S1's shape) whose turns alternate between two servers, every turn:

* ``ours``: two ``promptcache serve --no-ssd --redis-url R`` (separate RAM, no shared
  SSD folder, one Redis); ``ours_one_server``: the same conversation on one server
  alone (the reference of the ">= 95% of what one server reuses" rule);
* each peer (``mlx_lm``, ``vllm_mlx``): two independent servers, alternating (neither
  can share a cache between processes); ``nocache``: one server, the full-prefill
  reference of the outputs (greedy: ours must produce the same text).

Then, for ours only, three fault runs, each on a new conversation and a new pair of
servers (B reaches Redis through a delaying TCP proxy):

* ``killed``: redis-server SIGKILLed before turn 3, restarted before turn 6; counts the
  failed requests (must be 0) and measures how long after the restart both servers'
  circuits are closed again, and when the first Redis hit follows;
* ``slow``: every Redis reply to B delayed 200 ms (4x the 50 ms timeout);
* ``corrupt``: every block value in Redis overwritten before turns 3, 5 and 7.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from .client import send_turn
from .redisproc import DelayProxy, RedisServer
from .runner import WARMUP_MESSAGES
from .scenarios import Scenario, TextGen, _chat
from .systems import ServerProcess

log = logging.getLogger(__name__)

S6_TURNS = 10
FAULT_PHASES = ("killed", "slow", "corrupt")
SLOW_DELAY_S = 0.2
TIMEOUT_MS = 50


def build_s6(*, quick: bool = False, seed: int = 0) -> Scenario:
    g = TextGen(seed * 1000 + 6)
    user, reply = (60, 24) if quick else (270, 80)
    system = "You are a helpful assistant. " + g.text(40)
    turns = _chat(0, S6_TURNS, user, reply, g, system)
    return Scenario("S6", f"{S6_TURNS}-turn chat alternating between two servers every turn",
                    "openai", tuple(turns))


def _redis_tokens(srv: ServerProcess) -> int:
    try:
        cache = httpx.get(f"{srv.base_url}/v1/cache/stats", timeout=10).json().get("cache") or {}
    except (httpx.HTTPError, ValueError):
        return 0
    return int((cache.get("hit_tokens_by_tier") or {}).get("redis", 0))


def _redis_stats(srv: ServerProcess) -> dict[str, Any]:
    try:
        cache = httpx.get(f"{srv.base_url}/v1/cache/stats", timeout=10).json().get("cache") or {}
    except (httpx.HTTPError, ValueError):
        return {}
    out: dict[str, Any] = (cache.get("tiers") or {}).get("redis") or {}
    return out


def _converse(servers: Sequence[ServerProcess], scenario: Scenario, max_tokens: int,
              before: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with httpx.Client() as client:
        for i, turn in enumerate(scenario.turns):
            if before is not None:
                before(i)
            srv = servers[i % len(servers)]
            redis_before = _redis_tokens(srv)
            res = send_turn(client, srv.base_url, "openai", srv.model_id, turn.messages,
                            max_tokens=max_tokens)
            row = {"index": i, "server": i % len(servers), **res.to_dict(),
                   "redis_tokens": _redis_tokens(srv) - redis_before, "t_done": time.monotonic()}
            rows.append(row)
    return rows


def _start_all(servers: Sequence[ServerProcess]) -> None:
    with httpx.Client() as client:
        for s in servers:
            s.start()
            warm = send_turn(client, s.base_url, "openai", s.model_id, WARMUP_MESSAGES,
                             max_tokens=2)
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed: {warm.error}")


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r.get("ok")]
    prompt = sum(r.get("prompt_tokens") or 0 for r in ok)
    cached = sum(r.get("cached_tokens") or 0 for r in ok)
    return {
        "requests": len(rows), "failed": len(rows) - len(ok), "prompt_tokens": prompt,
        "cached_tokens": cached, "hit_rate": cached / prompt if prompt else None,
        "redis_tokens": sum(r.get("redis_tokens") or 0 for r in ok),
        "sum_ttft_s": sum(r.get("ttft_s") or 0.0 for r in ok),
    }


def run_s6(model: str, work_dir: Path, log_dir: Path, systems: Sequence[str], *,
           quick: bool = False, seed: int = 0, max_tokens: int = 16,
           progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    say = progress or (lambda _m: None)
    scenario = build_s6(quick=quick, seed=seed)
    out: dict[str, Any] = {"title": scenario.title, "runs": {}, "faults": {}, "summary": {}}
    redis = RedisServer(work_dir / "s6-redis").start()
    try:
        layouts: list[tuple[str, str, int, tuple[str, ...]]] = []  # (run, system, n, args)
        for system in systems:
            if system == "ours":
                layouts.append(("ours", "ours", 2, ("--no-ssd", "--redis-url", redis.url)))
                layouts.append(("ours_one_server", "ours", 1, ("--no-ssd",)))
            elif system == "nocache":
                layouts.append(("nocache", "nocache", 1, ()))
            else:
                layouts.append((system, system, 2, ()))
        for run, system, n, args in layouts:
            servers = [ServerProcess(system, model, log_dir / f"S6-{run}-{i}.log",
                                     cache_dir=work_dir / f"S6-{run}-{i}", extra_args=args)
                       for i in range(n)]
            say(f"S6/{run}: {n} server(s), {len(scenario.turns)} turns")
            try:
                _start_all(servers)
                rows = _converse(servers, scenario, max_tokens)
                out["runs"][run] = rows
                out["summary"][run] = summarize(rows)
                s = out["summary"][run]
                say(f"S6/{run}: cached {s['cached_tokens']}/{s['prompt_tokens']}, "
                    f"failed {s['failed']}, Σ TTFT {s['sum_ttft_s']:.2f} s")
            except Exception as e:  # noqa: BLE001 - one system failing must not stop the bench
                out["summary"][run] = {"error": f"{type(e).__name__}: {e}"}
                say(f"S6/{run}: ERROR {e}")
            finally:
                for s in servers:
                    s.stop()
        if "ours" in systems:
            for phase in FAULT_PHASES:
                out["faults"][phase] = _fault_run(phase, model, work_dir, log_dir, redis,
                                                  max_tokens, quick, seed, say)
    finally:
        redis.stop()
    out["checks"] = _checks(out)
    return out


def _fault_run(phase: str, model: str, work_dir: Path, log_dir: Path, redis: RedisServer,
               max_tokens: int, quick: bool, seed: int, say: Callable[[str], None]
               ) -> dict[str, Any]:
    scenario = build_s6(quick=quick, seed=seed + 1 + FAULT_PHASES.index(phase))
    proxy = DelayProxy(redis.port).start()
    common = ("--no-ssd", "--redis-timeout-ms", str(TIMEOUT_MS))
    servers = [
        ServerProcess("ours", model, log_dir / f"S6-{phase}-a.log", cache_dir=work_dir / f"S6-{phase}-a",
                      extra_args=(*common, "--redis-url", redis.url)),
        ServerProcess("ours", model, log_dir / f"S6-{phase}-b.log", cache_dir=work_dir / f"S6-{phase}-b",
                      extra_args=(*common, "--redis-url", proxy.url)),
    ]
    result: dict[str, Any] = {}
    say(f"S6/fault {phase}")

    def before(i: int) -> None:
        if phase == "killed" and i == 3:
            redis.kill()
        elif phase == "killed" and i == 6:
            redis.start()
            t0 = time.monotonic()
            result["restarted_at"] = t0
            deadline = t0 + 120
            while time.monotonic() < deadline:
                if all(_redis_stats(s).get("state") == "closed" for s in servers):
                    break
                time.sleep(0.05)
            result["circuits_closed_s"] = time.monotonic() - t0
        elif phase == "corrupt" and i in (3, 5, 7):
            client = redis.client()
            n = 0
            for k in client.scan_iter(match="promptcache:*:b:*", count=1000):
                client.hset(k, "p", b"damaged")
                n += 1
            result.setdefault("corrupted_values", []).append(n)

    try:
        _start_all(servers)
        stats0 = [_redis_stats(s) for s in servers]
        if phase == "slow":
            proxy.delay_s = SLOW_DELAY_S
        rows = _converse(servers, scenario, max_tokens, before)
        proxy.delay_s = 0.0
        stats1 = [_redis_stats(s) for s in servers]
        result["summary"] = summarize(rows)
        result["turns"] = rows
        for key in ("timeouts", "connection_errors", "corrupt", "skipped_ops", "breaker_trips",
                    "breaker_recoveries"):
            result[key] = sum(int(b.get(key, 0)) - int(a.get(key, 0))
                              for a, b in zip(stats0, stats1, strict=True))
        t_restart = result.get("restarted_at")
        if t_restart is not None:
            first = next((r for r in rows[6:] if r.get("redis_tokens")), None)
            result["first_redis_hit_turn"] = None if first is None else first["index"]
            result["first_redis_hit_after_restart_s"] = (
                None if first is None else first["t_done"] - t_restart)
        s = result["summary"]
        say(f"S6/fault {phase}: failed {s['failed']}/{s['requests']}, "
            f"cached {s['cached_tokens']}/{s['prompt_tokens']}, redis {s['redis_tokens']}")
    except Exception as e:  # noqa: BLE001
        result["error"] = f"{type(e).__name__}: {e}"
        say(f"S6/fault {phase}: ERROR {e}")
    finally:
        for srv in servers:
            srv.stop()
        proxy.stop()
        if not redis.running:
            redis.start()
    return result


def _checks(out: dict[str, Any]) -> dict[str, Any]:
    summ = out["summary"]
    checks: dict[str, Any] = {}
    ours, one = summ.get("ours") or {}, summ.get("ours_one_server") or {}
    if ours.get("cached_tokens") is not None and one.get("cached_tokens"):
        checks["reuse_vs_one_server"] = ours["cached_tokens"] / one["cached_tokens"]
    ref = out["runs"].get("nocache")
    if ref is not None and "ours" in out["runs"]:
        checks["outputs_equal_full_prefill"] = [r["text"] for r in out["runs"]["ours"]] == [
            r["text"] for r in ref]
    return checks


def markdown(s6: dict[str, Any]) -> str:
    lines = [f"### S6: {s6['title']}", "",
             "| run | requests | failed | cached / prompt tokens | hit rate | from Redis | Σ TTFT |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for run, s in s6["summary"].items():
        if "error" in s:
            lines.append(f"| {run} | error: {s['error']} | | | | | |")
            continue
        rate = "—" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}"
        lines.append(f"| {run} | {s['requests']} | {s['failed']} | {s['cached_tokens']} / "
                     f"{s['prompt_tokens']} | {rate} | {s['redis_tokens']} | {s['sum_ttft_s']:.2f} s |")
    for name, value in s6.get("checks", {}).items():
        lines.append(f"\n- {name}: {value if not isinstance(value, float) else f'{value:.3f}'}")
    if s6.get("faults"):
        lines += ["", "| fault run | failed | cached / prompt | from Redis | timeouts | corrupt "
                  "| circuits closed after restart | first Redis hit after restart |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for phase, f in s6["faults"].items():
            if "error" in f:
                lines.append(f"| {phase} | error: {f['error']} | | | | | | |")
                continue
            s = f["summary"]
            closed = f.get("circuits_closed_s")
            first = f.get("first_redis_hit_after_restart_s")
            closed_txt = "—" if closed is None else f"{closed:.2f} s"
            first_txt = "—" if first is None else (
                f"{first:.2f} s (turn {f.get('first_redis_hit_turn')})")
            lines.append(
                f"| {phase} | {s['failed']}/{s['requests']} | {s['cached_tokens']} / "
                f"{s['prompt_tokens']} | {s['redis_tokens']} | {f.get('timeouts', 0)} | "
                f"{f.get('corrupt', 0)} | {closed_txt} | {first_txt} |")
    return "\n".join(lines) + "\n"
