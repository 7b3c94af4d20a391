"""Failed saves by their true cause (issue 22, item 7), through the server on a real
tiny engine: the failed saves of a request are counted by cause in the engine stats,
``/v1/cache/stats`` (and so the dashboard data) and ``/metrics``; the next identical
request misses as ``not_stored: <cause>`` (not ``cold``), which the rolling window and
the advisor's diagnosis name."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from real_engine import make_cache, tiny_engine

from promptcache.engine.api import GenerationRequest, SamplingParams
from promptcache.engine.requests.request import store_error_cause
from promptcache.errors import InvariantError, TierError
from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

BS = 8
MESSAGES = [{"role": "system", "content": "You answer in one short sentence, plainly."},
            {"role": "user", "content": "Which planet is the largest in the solar system?"}]


class FailingStore:
    """Wraps ``PromptCache.store``: raises ``exc`` while armed, counting the calls."""

    def __init__(self, store: Any, exc: Exception) -> None:
        self.store = store
        self.exc = exc
        self.armed = True
        self.raised = 0

    def __call__(self, *a: Any, **k: Any) -> int:
        if self.armed:
            self.raised += 1
            raise self.exc
        return int(self.store(*a, **k))


class Served:
    def __init__(self, path: Path) -> None:
        self.cache = make_cache(block_size=BS)
        # a chunk longer than the prompt: two saves (end of prefill, end of generation)
        # what a failed save leaves to the next turn: the blocks (no live state)
        self.engine = tiny_engine(path, self.cache, block_size=BS, chunk=16 * BS,
                                  live_states=0)
        self.client = TestClient(create_app(self.engine, ServerConfig(prerender=False)))

    def chat(self) -> dict[str, Any]:
        r = self.client.post("/v1/chat/completions", json={
            "model": "default", "max_tokens": 2, "temperature": 0, "messages": MESSAGES})
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def served(tiny_llama_path: Path) -> Iterator[Served]:
    s = Served(tiny_llama_path)
    yield s
    s.close()


def _metric_lines(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name)]


def test_failed_saves_counted_by_cause_and_next_miss_says_not_stored(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    failing = FailingStore(served.cache.store, ValueError("payload layout rejected"))
    monkeypatch.setattr(served.cache, "store", failing)
    first = served.chat()
    assert first["choices"][0]["message"]["content"] is not None  # the request never fails
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert failing.raised == 2  # end of prefill, end of generation
    failing.armed = False

    engine = served.engine.engine_stats()
    assert engine["store_errors"] == 2
    assert engine["store_errors_by_cause"] == {"layout": 2}

    stats = served.client.get("/v1/cache/stats").json()
    assert stats["engine"]["store_errors"] == 2
    assert stats["engine"]["store_errors_by_cause"] == {"layout": 2}
    dash = served.client.get("/v1/dashboard/data").json()
    assert dash["stats"]["engine"]["store_errors_by_cause"] == {"layout": 2}

    metrics = served.client.get("/metrics").text
    assert _metric_lines(metrics, "promptcache_engine_store_errors_by_cause_total") == [
        'promptcache_engine_store_errors_by_cause_total{cause="layout"} 2.0']
    assert "# TYPE promptcache_engine_store_errors_by_cause_total counter" in metrics

    # the same request again: nothing was stored, and the miss says why
    second = served.chat()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = served.client.get("/v1/cache/stats").json()
    assert stats["rolling"]["skipped_new_prompts"] == 1  # the first request only
    assert stats["rolling"]["top_miss_reasons"] == {"not_stored: layout": 1}
    diagnosis = stats["diagnosis"]
    assert diagnosis["dominant_cause"] == "not_stored: layout"
    assert diagnosis["remedy"] == {"store_error_cause": "layout"}
    assert diagnosis["summary"].startswith("100% of missed tokens were never stored: saving "
                                           "their blocks failed (cause: layout)")
    # this time the saves went through: a third request hits
    third = served.chat()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_engine_miss_reason_after_a_failed_save(served: Served,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The structured miss of the next identical request: ``not_stored: tier`` at token 0
    for a save that a tier failure broke; later saves clear it (a hit)."""
    prompt = tuple(range(3, 3 + 5 * BS + 3))  # 43 tokens: 5 full blocks + a partial tail
    failing = FailingStore(served.cache.store, TierError("disk gone"))
    monkeypatch.setattr(served.cache, "store", failing)

    def run() -> Any:
        req = GenerationRequest(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=1),
                                message_starts=(0, 20))
        return served.engine.submit(req).result(timeout=120)

    r1 = run()
    assert r1.miss is not None and r1.miss.cause == "cold"
    assert failing.raised == 2
    failing.armed = False
    r2 = run()
    assert r2.usage.cached_tokens == 0
    assert r2.miss is not None and r2.miss.cause == "not_stored: tier"
    assert (r2.miss.position, r2.miss.restorable, r2.miss.message_index) == (0, 0, 0)
    assert r2.miss_reason is not None and r2.miss_reason.startswith("not_stored")
    assert served.engine.engine_stats()["store_errors_by_cause"] == {"tier": 2}
    assert run().usage.cached_tokens == len(prompt) - 1


def test_partial_save_failure_names_the_first_unsaved_block(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that stored 3 blocks, then failed: the next request restores those and its
    miss at token 24 says ``not_stored: invariant``."""
    prompt = tuple(range(500, 500 + 5 * BS + 3))
    real = served.cache.store

    def store_three_then_fail(ns: Any, tokens: Any, num_tokens: int, payload_for: Any,
                              **k: Any) -> int:
        real(ns, tokens, 3 * BS, payload_for, **{**k, "include_partial": False})
        raise InvariantError("broken chain")

    monkeypatch.setattr(served.cache, "store", store_three_then_fail)
    req = GenerationRequest(prompt_tokens=prompt, sampling=SamplingParams(max_tokens=1))
    served.engine.submit(req).result(timeout=120)
    monkeypatch.setattr(served.cache, "store", real)
    r2 = served.engine.submit(req).result(timeout=120)
    assert r2.usage.cached_tokens == 3 * BS
    assert r2.miss is not None and r2.miss.cause == "not_stored: invariant"
    assert (r2.miss.position, r2.miss.restorable) == (3 * BS, 3 * BS)
    assert served.engine.engine_stats()["store_errors_by_cause"] == {"invariant": 2}


def test_the_miss_keeps_the_failed_save_cause() -> None:
    """One miss type: the alert and the stats count a failed save by its cause, the
    diagnostics read its kind, the log line says both; nothing is parsed from text."""
    from promptcache.engine.api import CacheMiss
    from promptcache.server.ops.alerts import HitRateMonitor
    from promptcache.server.ops.diagnostics import cache_cause_of
    from promptcache.server.ops.outcome import outcome_of

    miss = CacheMiss("not_stored", 0, 0, 9, store_error="tier").at_message((0, 5))
    assert (miss.kind, miss.cause, miss.message_index) == ("not_stored", "not_stored: tier", 0)
    assert miss.describe() == "not_stored: tier: first uncached token at position 0 (chat message 0)"
    assert cache_cause_of(miss) == "not_stored" and cache_cause_of(None) is None
    m = HitRateMonitor(window=4, min_samples=1)
    m.record(outcome_of(9, 0, miss))
    m.record(outcome_of(9, 8, CacheMiss("evicted", 8, 8, 9)))
    assert m.snapshot()["top_miss_reasons"] == {"not_stored: tier": 1, "evicted": 1}


@pytest.mark.parametrize("exc, cause", [
    (TierError("x"), "tier"), (InvariantError("x"), "invariant"), (MemoryError(), "budget"),
    (ValueError("x"), "layout"), (KeyError("x"), "layout"), (RuntimeError("x"), "other")])
def test_store_error_cause(exc: Exception, cause: str) -> None:
    assert store_error_cause(exc) == cause


def test_diagnosis_of_blocks_dropped_for_want_of_budget() -> None:
    from promptcache.advisor import LookupSample, diagnose

    samples = [LookupSample(100, 20, "not_stored: budget", 20, None, 0),
               LookupSample(50, 0, "cold", 0, None, 0)]
    d = diagnose(samples, {"ram_budget_bytes": 2 * 1024**2})
    assert (d["dominant_cause"], d["share"]) == ("not_stored: budget", 1.0)
    assert d["missed_tokens_by_cause"] == {"not_stored: budget": 80}
    assert d["remedy"] == {"store_error_cause": "budget"}
    assert d["summary"] == ("100% of missed tokens were never stored: the RAM budget (2 MB) "
                            "had no room for them (blocks in use filled it): raise --ram-budget")
