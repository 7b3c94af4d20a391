"""Automated diagnosis and --auto-tune.

A scripted eviction storm (six conversations taking turns, a RAM budget far below
their working set: LRU thrashes) raises the low-hit-rate alert; its log line and the
diagnosis name evicted-before-reuse as the dominant cause with a RAM budget figure, and
the same replay with that budget applied is back above the threshold. The auto-tuner
shrinks under a memory-pressure double, grows from the advisor's figure, and never
leaves its bounds."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from promptcache.advisor import EvictionAdvisor, LookupSample, diagnose
from promptcache.autotune import AutoTuner
from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.meta import Namespace
from promptcache.server.ops.alerts import HitRateMonitor
from promptcache.server.ops.outcome import outcome_of

BS = 16
NS = Namespace("storm-model", BS)
BYTES_PER_TOKEN = 64  # float32 [1, 1, n, 16]
CONVS, TURNS = 6, 20
THRESHOLD = 0.8


def payload_for(start: int, end: int, snapshot: bool) -> dict[str, np.ndarray]:
    return {"0.k": np.full((1, 1, end - start, 16), float(start), dtype=np.float32)}


def conv_prompt(c: int, turn: int) -> list[int]:
    return [1000 * (c + 1) + i for i in range(64 + BS * turn)]


def replay(budget: int) -> tuple[PromptCache, EvictionAdvisor, HitRateMonitor]:
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=budget))
    advisor = EvictionAdvisor(cache, window=50)
    cache.observers.append(advisor)
    monitor = HitRateMonitor(window=50, threshold=THRESHOLD)
    monitor.explain = lambda missed: diagnose(
        advisor.window(), cache.stats().to_dict(), recommended_budget=advisor.recommended_budget(),
        missed=missed)["summary"]
    for turn in range(TURNS):
        for c in range(CONVS):
            prompt = conv_prompt(c, turn)
            hit = cache.acquire(prompt, NS)
            monitor.record(outcome_of(len(prompt), hit.num_tokens, hit.miss))  # as data
            cache.release(hit)
            cache.store(NS, prompt, len(prompt), payload_for, save_point="end_prefill")
    return cache, advisor, monitor


def test_eviction_storm_names_the_cause_and_a_budget_that_fixes_it(
        caplog: pytest.LogCaptureFixture) -> None:
    working_set = CONVS * (64 + BS * (TURNS - 1)) * BYTES_PER_TOKEN
    small = working_set // 4
    with caplog.at_level(logging.WARNING, logger="promptcache.server.ops.alerts"):
        cache, advisor, monitor = replay(small)
    assert monitor.alerting and monitor.hit_rate() < THRESHOLD
    warning = [r.getMessage() for r in caplog.records if "low prompt-cache" in r.getMessage()][-1]
    d = diagnose(advisor.window(), cache.stats().to_dict(),
                 recommended_budget=advisor.recommended_budget())
    assert d["dominant_cause"] == "evicted" and d["share"] == 1.0
    need = d["remedy"]["ram_budget_bytes"]
    assert small < need <= 2 * working_set
    # the log line names the cause and a figure (the working set still grew after it)
    assert ("diagnosis: 100% of missed tokens were blocks evicted before reuse: a RAM budget "
            "of ") in warning
    assert d["summary"].startswith("100% of missed tokens were blocks evicted before reuse: "
                                   "a RAM budget of 160 KB would have kept them (now 34.5 KB)")
    # the same replay with the advised budget: back above the threshold, no alert
    cache2, advisor2, monitor2 = replay(need)
    assert monitor2.hit_rate() >= THRESHOLD and not monitor2.alerting
    assert cache2.stats().evictions == 0 or advisor2.recommended_budget() is None
    # and the figure is not a blind "more": half of it still thrashes
    _, _, monitor3 = replay(need // 2)
    assert monitor3.alerting


def test_diagnosis_of_other_causes_and_findings() -> None:
    samples = [LookupSample(100, 20, "diverged", 20, None, 0),
               LookupSample(100, 60, "diverged", 60, None, 0),
               LookupSample(100, 90, "expired", 90, None, 0),
               LookupSample(500, 0, "cold", 0, None, 0)]  # cold starts do not count
    d = diagnose(samples, {"ram_budget_bytes": 1 << 30})
    assert d["dominant_cause"] == "diverged" and d["share"] == pytest.approx(120 / 130)
    assert d["remedy"] is None  # every canonical-prompt rule is on: none is advised
    assert d["summary"] == ("92% of missed tokens were lost where the prompt diverged from a "
                            "cached one (median at token 40), with every canonical-prompt "
                            "rule on: the client sent a different prompt; each request's "
                            "miss= in the log (or Anthropic diagnostics) says where")
    stats = {"tiers": {"ssd": {"dropped_spills": {"write_budget": 7},
                               "bytes_written_today": 3 * 1024**3},
                       "redis": {"healthy": False, "state": "open"}}}
    d = diagnose([], stats)
    assert d["dominant_cause"] is None
    assert d["findings"] == ["SSD writes over the daily write budget: 7 blocks were not "
                             "written today (3 GB written)",
                             "the shared Redis tier is unhealthy (circuit open)"]
    assert d["summary"] == d["findings"][0]


def test_advice_matches_the_alerts_cause_and_names_only_rules_that_are_off() -> None:
    # the alert's own count (the server's): a session's turn names where its prompt changed
    missed = {"system_changed": 300, "evicted": 100}
    d = diagnose([], {}, missed=missed)
    assert (d["dominant_cause"], d["share"], d["remedy"]) == ("system_changed", 0.75, None)
    assert d["summary"] == ("75% of missed tokens were lost where the system prompt changed, "
                            "with every canonical-prompt rule on: the client sent a different "
                            "prompt; each request's miss= in the log (or Anthropic "
                            "diagnostics) says where")
    d = diagnose([], {}, missed=missed, canonical_off=["tool_order", "billing_header"])
    assert d["remedy"] == {"canonical_rules_on": ["billing_header", "tool_order"]}
    assert d["summary"] == ("75% of missed tokens were lost where the system prompt changed: "
                            "the canonical-prompt rules billing_header, tool_order are off "
                            "(--no-canonicalize): with them on, volatile metadata, reordered "
                            "tools and template drift no longer change the prompt")
    # one-shot questions diverge after the template's first tokens: the cache's lookups
    # see "diverged", the alert counts none of them, and nothing is advised
    samples = [LookupSample(40, 8, "diverged", 8, None, 0) for _ in range(12)]
    assert diagnose(samples, {})["dominant_cause"] == "diverged"
    d = diagnose(samples, {}, missed={})
    assert (d["dominant_cause"], d["remedy"], d["summary"]) == (None, None, None)
    d = diagnose([], {}, missed={"cold": 50})
    assert d["summary"] == ("100% of missed tokens were gone from the cache without a trace "
                            "(deleted, or evicted longer ago than the cache remembers)")


@dataclass
class Memory:
    total: int
    available: int


class Advice:
    def __init__(self, budget: int | None, rate: float) -> None:
        self.budget, self.rate = budget, rate

    def recommended_budget(self) -> int | None:
        return self.budget

    def eviction_miss_rate(self) -> float:
        return self.rate


MB = 1024**2


def _filled(budget: int) -> PromptCache:
    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=budget))
    for c in range(40):
        cache.store(NS, conv_prompt(c, 0), 64, payload_for)
    return cache


def test_auto_tune_shrinks_under_memory_pressure_within_bounds(
        caplog: pytest.LogCaptureFixture) -> None:
    cache = _filled(160 * 1024)
    mem = Memory(total=1000 * MB, available=50 * MB)  # 5% available: pressure
    tuner = AutoTuner(cache, Advice(None, 0.0), min_bytes=64 * 1024, max_bytes=256 * 1024,
                      memory=lambda: mem)
    seen = []
    with caplog.at_level(logging.INFO, logger="promptcache.autotune"):
        for _ in range(6):
            tuner.step()
            seen.append(cache.pool.budget_bytes)
            assert cache.stats().ram_bytes <= cache.pool.budget_bytes
    assert seen == [120 * 1024, 90 * 1024, 69120, 64 * 1024, 64 * 1024, 64 * 1024]
    assert len(tuner.changes) == 4 and all("memory pressure" in c.reason for c in tuner.changes)
    assert sum("auto-tune: RAM budget" in r.getMessage() for r in caplog.records) == 4
    assert cache.stats().evictions > 0  # shrinking evicted blocks
    # pressure gone, evictions before reuse: it grows towards the advice, up to max only
    mem.available = 900 * MB
    tuner.advisor = Advice(10 * MB, 0.3)
    assert tuner.step() == 256 * 1024 and tuner.step() is None
    assert cache.pool.budget_bytes == 256 * 1024
    # a low evicted-before-reuse rate does not grow it; a budget that starts outside the
    # bounds is moved in
    tuner2 = AutoTuner(_filled(1 * MB), Advice(2 * MB, 0.001), min_bytes=0,
                       max_bytes=512 * 1024, memory=lambda: mem)
    assert tuner2.budget == 512 * 1024 and tuner2.step() is None
    with pytest.raises(ValueError):
        AutoTuner(cache, Advice(None, 0), min_bytes=2, max_bytes=1)


def test_auto_tune_growth_is_limited_by_available_memory() -> None:
    cache = _filled(64 * 1024)
    mem = Memory(total=1000 * MB, available=100 * MB + 32 * 1024)  # 32 KiB above the line
    tuner = AutoTuner(cache, Advice(1 * MB, 0.5), min_bytes=0, max_bytes=4 * MB,
                      memory=lambda: mem)
    assert tuner.step() == 96 * 1024


def _Engine(cache: PromptCache) -> Any:
    """Just enough engine for the admin routes: the fake engine (tests/server) named
    ``storm-model``, over a real cache."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent / "server"))
    from fake_engine import FakeEngine

    engine = FakeEngine()
    engine.model_id = "storm-model"  # type: ignore[misc]
    engine.cache = cache  # type: ignore[assignment]
    return engine


def test_stats_dashboard_and_serve_options_carry_the_diagnosis(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from promptcache.cli import build_parser
    from promptcache.cli.serve_cmd import build_configs
    from promptcache.server import create_app
    from promptcache.serving_config import ServerConfig

    cache = PromptCache(CacheConfig(block_size=BS, ram_budget_bytes=8 * 1024))
    app = create_app(_Engine(cache), ServerConfig(auto_tune=True, ram_budget_min_bytes=4096,
                                                  ram_budget_max_bytes=64 * 1024))
    monitor = app.state.pc.monitor
    for turn in range(3):
        for c in range(CONVS):
            p = conv_prompt(c, turn)
            hit = cache.acquire(p, NS)
            monitor.record(outcome_of(len(p), hit.num_tokens, hit.miss))  # as the server does
            cache.release(hit)
            cache.store(NS, p, len(p), payload_for)
    with TestClient(app) as client:
        stats = client.get("/v1/cache/stats").json()
        d = stats["diagnosis"]
        assert d["dominant_cause"] == "evicted" and d["alerting"] is True
        assert d["remedy"]["ram_budget_bytes"] > 8 * 1024
        assert stats["auto_tune"]["min_bytes"] == 4096 and stats["auto_tune"]["max_bytes"] == 65536
        assert client.get("/v1/dashboard/data").json()["diagnosis"] == d
    _, _, _, srv = build_configs(build_parser().parse_args(
        ["serve", "--no-ssd", "--auto-tune", "--ram-budget-min", "1GB", "--ram-budget-max",
         "2GB"]))
    assert (srv.auto_tune, srv.ram_budget_min_bytes, srv.ram_budget_max_bytes) == (
        True, 1024**3, 2 * 1024**3)
    for bad in (["--ram-budget-min", "1GB"],
                ["--auto-tune", "--ram-budget-min", "2GB", "--ram-budget-max", "1GB"]):
        with pytest.raises(ValueError):
            build_configs(build_parser().parse_args(["serve", "--no-ssd", *bad]))
