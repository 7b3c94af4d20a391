"""Replay one scenario against one system under test.

A fresh server per (scenario, system) with a fresh cache directory; one short warm-up
request after every (re)start so that process start-up costs (imports, first-call
compilation) are not charged to a turn: the turns measure the cache. S4's restart and
kill -9 happen between turns, as the scenario says.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from .client import TurnResult, send_turn
from .scenarios import Scenario
from .systems import OURS, SPECS, ServerProcess

log = logging.getLogger(__name__)

WARMUP_MESSAGES = ({"role": "user", "content": "Warm up: say ok."},)


@dataclass
class SystemRun:
    system: str
    scenario: str
    api: str
    turns: list[dict[str, Any]] = field(default_factory=list)
    peak_rss: int = 0
    rss_after_warmup: int = 0
    rss_at_end: int = 0
    disk_bytes: int = 0
    startup_s: list[float] = field(default_factory=list)
    cache_stats: dict[str, Any] | None = None
    error: str | None = None  # the run could not complete (start failure...)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def bytes_held_from_stats(stats: dict[str, Any] | None) -> int | None:
    """Bytes the cache holds, from ``/v1/cache/stats`` if it says so: the largest tier.

    Ours: ``{"cache": {"ram_bytes": n, "tiers": {"ssd": {"bytes_on_disk": n}}}}``. Under
    write-through every tier holds a copy of the same blocks, so the dedup figure is per
    tier (the largest one), not their sum. Also accepted: a top-level ``bytes_held``,
    ``<tier>_bytes`` keys, tiers with ``bytes``. None when no such figure is present.
    """
    if not isinstance(stats, dict):
        return None
    if isinstance(stats.get("cache"), dict):
        stats = stats["cache"]
    if isinstance(stats.get("bytes_held"), int):
        return int(stats["bytes_held"])
    sizes: list[int] = []
    for tier in ("ram", "ssd", "redis"):
        v = stats.get(f"{tier}_bytes")
        if isinstance(v, int):
            sizes.append(v)
    tiers = stats.get("tiers")
    for t in (tiers.values() if isinstance(tiers, dict) else ()):
        v = t.get("bytes_on_disk", t.get("bytes")) if isinstance(t, dict) else None
        if isinstance(v, int):
            sizes.append(v)
    return max(sizes) if sizes else None


def _fetch_stats(srv: ServerProcess) -> dict[str, Any] | None:
    try:
        r = httpx.get(f"{srv.base_url}/v1/cache/stats", timeout=10.0)
        if r.status_code == 200:
            data = r.json()
            return data if isinstance(data, dict) else None
    except (httpx.HTTPError, ValueError):
        pass
    return None


def run_scenario(system: str, scenario: Scenario, model: str, work_dir: Path, log_dir: Path, *,
                 max_tokens: int = 16, ram_budget_bytes: int | None = None,
                 progress: Callable[[str], None] | None = None,
                 turn_progress: Callable[[int, int], None] | None = None) -> SystemRun:
    """``progress``: log lines; ``turn_progress(done, total)``: after every turn (a bar)."""
    spec = SPECS[system]
    api = scenario.api if (scenario.api == "openai" or spec.anthropic) else "openai"
    run = SystemRun(system=system, scenario=scenario.name, api=api)
    cache_dir = work_dir / f"{scenario.name}-{system}"
    shutil.rmtree(cache_dir, ignore_errors=True)
    cache_dir.mkdir(parents=True)
    srv = ServerProcess(system, model, log_dir / f"{scenario.name}-{system}.log",
                        cache_dir=cache_dir if system != "nocache" else None,
                        ram_budget_bytes=ram_budget_bytes)
    say = progress or (lambda _msg: None)
    try:
        with httpx.Client() as client:

            def start() -> None:
                run.startup_s.append(srv.start())
                warm = send_turn(client, srv.base_url, api, srv.model_id, WARMUP_MESSAGES,
                                 max_tokens=2)
                if not warm.ok:
                    raise RuntimeError(f"warm-up request failed: {warm.error}")

            start()
            run.rss_after_warmup = srv.current_rss()
            n = len(scenario.turns)
            for i, turn in enumerate(scenario.turns):
                if turn.before == "restart":
                    say(f"  {scenario.name}/{system}: clean restart")
                    srv.stop()
                    start()
                elif turn.before == "kill":
                    say(f"  {scenario.name}/{system}: kill -9")
                    srv.kill()
                    start()
                res: TurnResult = send_turn(client, srv.base_url, api, srv.model_id,
                                            turn.messages, turn.tools, max_tokens=max_tokens)
                row = {"conversation": turn.conversation, "index": turn.index,
                       "before": turn.before, **res.to_dict()}
                row.pop("text", None)
                run.turns.append(row)
                if turn_progress is not None:
                    turn_progress(i + 1, n)
                if not res.ok:
                    log.warning("%s/%s turn %d failed: %s", scenario.name, system, i, res.error)
                if n <= 12 or (i + 1) % 10 == 0 or i + 1 == n:
                    ttft = f"{res.ttft_s * 1000:.0f} ms" if res.ttft_s is not None else "failed"
                    say(f"  {scenario.name}/{system}: turn {i + 1}/{n} ttft {ttft} "
                        f"cached {res.cached_tokens}/{res.prompt_tokens}")
            if system in OURS:
                run.cache_stats = _fetch_stats(srv)
            run.rss_at_end = srv.current_rss()
            time.sleep(0.3)  # one more RSS sample after the last turn
    except Exception as e:  # noqa: BLE001 - one system failing must not stop the bench
        run.error = f"{type(e).__name__}: {e}"
        log.error("%s/%s: %s", scenario.name, system, run.error)
    finally:
        try:
            srv.stop()
        finally:
            run.peak_rss = srv.peak_rss
            run.disk_bytes = srv.disk_bytes()
    return run
