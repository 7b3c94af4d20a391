"""Auth, scoping headers, admin endpoints, metrics, hit-rate alert, disconnects (fake engine)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import sse_events, uvicorn_thread

from promptcache.engine.api import CacheMiss
from promptcache.server import create_app
from promptcache.server.ops.alerts import HitRateMonitor
from promptcache.server.ops.diagnostics import Divergence
from promptcache.server.ops.outcome import outcome_of
from promptcache.serving_config import ServerConfig

HI = {"messages": [{"role": "user", "content": "hi"}]}
AHI = {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


def test_api_key_required(engine: FakeEngine) -> None:
    c = TestClient(create_app(engine, ServerConfig(api_key="sekret")))
    r = c.post("/v1/chat/completions", json=HI)
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert r.json()["error"]["code"] == "invalid_api_key"
    r = c.post("/v1/messages", json=AHI, headers={"x-api-key": "wrong"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": "invalid API key"}}
    # auth is checked before the body: a bad body without a key is still a 401
    assert c.post("/v1/messages", content=b"{").status_code == 401
    assert c.post("/v1/chat/completions", json=HI,
                  headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert c.post("/v1/messages", json=AHI, headers={"x-api-key": "sekret"}).status_code == 200
    assert c.get("/v1/cache/stats").status_code == 401
    assert c.get("/health").status_code == 200
    assert c.get("/metrics").status_code == 200


def test_api_keys_file_maps_tenants(engine: FakeEngine, tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"key-a": "alice", "key-b": "bob"}))
    c = TestClient(create_app(engine, ServerConfig(api_keys_file=keys)))
    assert c.post("/v1/chat/completions", json=HI).status_code == 401
    c.post("/v1/chat/completions", json=HI, headers={"Authorization": "Bearer key-a"})
    c.post("/v1/messages", json=AHI, headers={"x-api-key": "key-b", "X-Tenant-Id": "bob"})
    assert [r.tenant for r in engine.submitted] == ["alice", "bob"]
    r = c.post("/v1/chat/completions", json=HI,
               headers={"Authorization": "Bearer key-a", "X-Tenant-Id": "bob"})
    assert r.status_code == 403
    # a tenant-bound key deletes only its own tenant's blocks
    r = c.delete("/v1/cache", headers={"x-api-key": "key-a"})
    assert r.json() == {"deleted_blocks": 1, "tenant": "alice", "cache_enabled": True}
    assert c.delete("/v1/cache?tenant=bob", headers={"x-api-key": "key-a"}).status_code == 403


def test_bad_api_keys_file(engine: FakeEngine, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"k": "../etc"}))
    with pytest.raises(ValueError, match="tenant"):
        create_app(engine, ServerConfig(api_keys_file=bad))


def test_tenant_and_session_headers(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/chat/completions", json=HI,
                    headers={"X-Tenant-Id": "team-1", "X-Session-Id": "sess-42"})
    assert r.status_code == 200
    assert (engine.submitted[-1].tenant, engine.submitted[-1].session_id) == ("team-1", "sess-42")
    # another tenant never sees team-1's cached prefix
    body = client.post("/v1/chat/completions", json=HI,
                       headers={"X-Tenant-Id": "team-2"}).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    body = client.post("/v1/chat/completions", json=HI,
                       headers={"X-Tenant-Id": "team-1"}).json()
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 23
    for bad in ("../x", "", "a b", "-lead"):
        r = client.post("/v1/chat/completions", json=HI, headers={"X-Tenant-Id": bad})
        assert r.status_code == 400, bad
        assert r.json()["error"]["code"] == "invalid_tenant"
    r = client.post("/v1/messages", json=AHI, headers={"X-Session-Id": "x" * 300})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert len(engine.submitted) == 3


def test_cache_admin_endpoints(client: TestClient, engine: FakeEngine) -> None:
    client.post("/v1/chat/completions", json=HI, headers={"X-Tenant-Id": "t1",
                                                          "X-Session-Id": "s1"})
    client.post("/v1/chat/completions", json=HI, headers={"X-Tenant-Id": "t2"})
    client.post("/v1/chat/completions", json=HI, headers={"X-Tenant-Id": "t2",
                                                          "X-Session-Id": "s2"})
    stats = client.get("/v1/cache/stats").json()
    assert stats["cache"]["sequences"] == 3
    assert stats["cache"]["tiers"]["ssd"]["spills"] == 2
    assert stats["cache_enabled"] is True
    assert stats["rolling"]["requests_in_window"] == 1  # two new prompts skipped
    assert stats["rolling"]["skipped_new_prompts"] == 2
    assert stats["alert"] == {"active": False, "threshold": 0.8, "min_requests": 10}
    assert client.delete("/v1/cache/sessions/s2").json() == {
        "deleted_blocks": 1, "session_id": "s2", "cache_enabled": True}
    assert client.delete("/v1/cache?tenant=t1").json()["deleted_blocks"] == 1
    assert client.delete("/v1/cache?tenant=../x").status_code == 400
    assert client.delete("/v1/cache").json()["deleted_blocks"] == 1
    assert engine.cache is not None
    assert engine.cache.deleted == [("session", "s2"), ("tenant", "t1"), ("tenant", None)]
    assert client.get("/health").json()["status"] == "ok"


def test_cache_disabled(tmp_path: Path) -> None:
    c = TestClient(create_app(FakeEngine(use_cache=False), ServerConfig()))
    assert c.get("/v1/cache/stats").json()["cache"] is None
    assert c.delete("/v1/cache").json()["cache_enabled"] is False
    body = c.post("/v1/messages", json=AHI).json()
    assert body["usage"]["cache_creation_input_tokens"] == 0


def test_metrics(client: TestClient) -> None:
    client.post("/v1/chat/completions", json=HI)
    client.post("/v1/messages", json=AHI)
    client.post("/v1/chat/completions", json={"messages": []})
    text = client.get("/metrics").text
    lines = set(text.splitlines())
    assert 'promptcache_requests_total{api="openai",status="ok"} 1.0' in lines
    assert 'promptcache_requests_total{api="anthropic",status="ok"} 1.0' in lines
    assert "promptcache_prompt_tokens_total 48.0" in lines
    assert 'promptcache_cached_tokens_total{tier="ram"} 23.0' in lines
    assert "promptcache_generated_tokens_total 17.0" in lines
    assert 'promptcache_ttft_seconds_count{api="openai"} 1.0' in lines
    # read from cache.stats().to_dict() at scrape time
    assert "promptcache_cache_ram_bytes 200.0" in lines
    assert 'promptcache_cache_hit_tokens_by_tier{tier="ssd"} 10.0' in lines
    assert 'promptcache_cache_token_hit_rate_per_tier{tier="ram"} 0.2' in lines
    assert 'promptcache_cache_misses_by_cause{cause="cold"} 2.0' in lines
    assert 'promptcache_cache_saves{save_point="end_prefill"} 2.0' in lines
    assert 'promptcache_cache_spills{tier="ssd"} 2.0' in lines
    assert 'promptcache_cache_quarantined{tier="ssd"} 1.0' in lines
    assert 'promptcache_cache_bytes_on_disk{tier="ssd"} 4096.0' in lines
    assert 'promptcache_cache_dropped_spills{reason="queue_full",tier="ssd"} 3.0' in lines
    assert 'promptcache_cache_degraded{tier="ssd"} 0.0' in lines
    assert "promptcache_hit_rate_alert 0.0" in lines
    # each app has its own registry
    other = TestClient(create_app(FakeEngine(), ServerConfig())).get("/metrics").text
    assert "promptcache_prompt_tokens_total 0.0" in other.splitlines()


def test_monitor_rules(caplog: pytest.LogCaptureFixture) -> None:
    m = HitRateMonitor(window=4, threshold=0.8, min_samples=2)
    m.record(outcome_of(100, 0, CacheMiss("cold", 0, 0, 100)))  # new: nothing to share
    # a new question after a shared preamble: it diverges in its own, last, message
    m.record(outcome_of(100, 30, CacheMiss("diverged", 30, 30, 100), last_message_start=20))
    m.record(outcome_of(100, 0, None, caching=False))  # no cache: neither counted nor new
    assert m.hit_rate() is None and m.num_skipped_new == 2
    m.record(outcome_of(100, 90, None))  # a hit: 90 of 90 shared tokens
    assert not m.alerting  # below min_samples
    with caplog.at_level(logging.WARNING, logger="promptcache.server.ops.alerts"):
        m.record(outcome_of(100, 10, CacheMiss("evicted", 10, 10, 100)))  # 10 of 100
        m.record(outcome_of(100, 20, CacheMiss("evicted", 20, 20, 100)))  # 20 of 100
        # the history changed before the last message: 30 of the 60 tokens before it
        m.record(outcome_of(100, 30, CacheMiss("diverged", 30, 30, 100), last_message_start=60))
    assert m.alerting
    assert m.hit_rate() == pytest.approx(150 / 350)
    assert m.missed_by_cause() == {"evicted": 170, "diverged": 30}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1  # logged once on entering the alert state
    assert warnings[0] == ("low prompt-cache hit rate: 52.6% of the tokens 2 requests repeat "
                           "from earlier traffic were reused (threshold 80%); most common "
                           "miss reasons: evicted x1")
    for _ in range(4):
        m.record(outcome_of(100, 99, None))
    assert not m.alerting and m.hit_rate() == 1.0
    with pytest.raises(ValueError):
        HitRateMonitor(window=0)


@pytest.mark.parametrize("args, kw, words, counted", [
    ((100, 0, CacheMiss("cold", 0, 0, 100)), {}, "new", False),
    ((100, 3, CacheMiss("diverged", 3, 3, 100)), {"last_message_start": 2}, "new", False),
    # a raw prompt (no message offsets) going on differently: a hit of what it shares
    ((100, 3, CacheMiss("diverged", 3, 3, 100)), {"cached_by_tier": {"ram": 3}}, "hit:ram",
     True),
    ((100, 0, CacheMiss("diverged", 0, 0, 100)), {}, "new", False),
    ((100, 40, CacheMiss("diverged", 40, 40, 100)), {"last_message_start": 60},
     "miss:diverged", True),
    ((100, 64, CacheMiss("cold", 64, 64, 100)), {"cached_by_tier": {"ram": 64}},
     "hit:ram", True),  # continues a stored prompt: its new tokens were never seen
    ((100, 99, None), {"cached_by_tier": {"ssd": 35, "live": 64}}, "hit:live+ssd", True),
    ((100, 0, CacheMiss("evicted", 0, 0, 100)), {}, "miss:evicted", True),
    ((100, 0, CacheMiss("expired", 0, 0, 100)), {}, "miss:expired", True),
    ((100, 0, CacheMiss("not_stored", 0, 0, 100, store_error="budget")), {},
     "miss:not_stored: budget", True),
    ((100, 0, None), {"caching": False}, "off", False),
    # a session's next turn: the previous turn's 80 reusable tokens
    ((100, 80, CacheMiss("cold", 80, 80, 100)),
     {"cached_by_tier": {"live": 80}, "divergence": Divergence(True, reachable=80, position=99)},
     "hit:live", True),
    ((100, 0, CacheMiss("evicted", 0, 0, 100)),
     {"divergence": Divergence(True, reachable=80, position=99)}, "miss:evicted", True),
    ((100, 0, CacheMiss("cold", 0, 0, 100)),
     {"divergence": Divergence(True, reachable=80, position=99)}, "miss:cold", True),
    ((100, 10, CacheMiss("diverged", 10, 10, 100)),
     {"divergence": Divergence(True, reachable=80, position=10, changed="system_changed")},
     "miss:system_changed", True),
])
def test_outcome_words(args: tuple[Any, ...], kw: dict[str, Any], words: str,
                       counted: bool) -> None:
    o = outcome_of(*args, **kw)
    assert (o.words, o.counted) == (words, counted)


def test_alert_quiet_on_unrelated_questions(caplog: pytest.LogCaptureFixture) -> None:
    """Twelve unrelated one-shot questions (each shares only the template's first tokens
    with the others): all new, none counted, no alert; the log calls each ``new``."""
    engine = FakeEngine()
    c = TestClient(create_app(engine, ServerConfig(hit_rate_window=3)))
    with caplog.at_level(logging.INFO):
        for i in range(12):
            c.post("/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": chr(97 + i) * 40}]})
    stats = c.get("/v1/cache/stats").json()
    rolling = stats["rolling"]
    assert (rolling["requests_in_window"], rolling["skipped_new_prompts"]) == (0, 12)
    assert rolling["alerting"] is False and stats["alert"]["active"] is False
    assert "promptcache_hit_rate_alert 0.0" in c.get("/metrics").text.splitlines()
    assert not any("low prompt-cache hit rate" in r.getMessage() for r in caplog.records)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    assert len(lines) == 12 and all(line.endswith(" cache=new") for line in lines)


def test_alert_gauge_through_app(caplog: pytest.LogCaptureFixture) -> None:
    """Retries of earlier prompts whose blocks were evicted raise it."""
    engine = FakeEngine()
    c = TestClient(create_app(engine, ServerConfig(hit_rate_window=3)))
    with caplog.at_level(logging.WARNING, logger="promptcache.server.ops.alerts"):
        for i in range(4):
            body = {"messages": [{"role": "user", "content": f"{i}" * 40}]}
            c.post("/v1/chat/completions", json=body)
            assert engine.cache is not None
            engine.cache.evict()  # the retry below misses: evicted
            c.post("/v1/chat/completions", json=body)
    stats = c.get("/v1/cache/stats").json()["rolling"]
    assert stats["requests_in_window"] == 3 and stats["skipped_new_prompts"] == 4
    assert stats["alerting"] is True
    assert "promptcache_hit_rate_alert 1.0" in c.get("/metrics").text.splitlines()
    assert any("low prompt-cache hit rate" in r.getMessage() for r in caplog.records)


def test_disconnect_cancels_and_server_keeps_serving() -> None:
    engine = FakeEngine(reply="x" * 200, delay=0.02)
    with uvicorn_thread(create_app(engine, ServerConfig())) as base:
        with httpx.Client(base_url=base, timeout=10) as hc:
            with hc.stream("POST", "/v1/chat/completions",
                           json={**HI, "stream": True}) as r:
                lines = r.iter_lines()
                for _ in range(6):
                    next(lines)
            deadline = time.monotonic() + 5
            while not engine.cancelled and time.monotonic() < deadline:
                time.sleep(0.02)
            assert engine.cancelled == [engine.submitted[0].request_id]
            engine.delay = 0
            body = hc.post("/v1/chat/completions", json=HI).json()
            assert body["choices"][0]["message"]["content"] == "x" * 64
            metrics = hc.get("/metrics").text.splitlines()
            assert 'promptcache_requests_total{api="openai",status="cancelled"} 1.0' in metrics
            assert "promptcache_requests_in_flight 0.0" in metrics


def test_non_streaming_disconnect_cancels() -> None:
    engine = FakeEngine(reply="y" * 100, delay=0.05)
    with uvicorn_thread(create_app(engine, ServerConfig())) as base:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/messages", json={**AHI, "max_tokens": 100}, timeout=0.5)
        deadline = time.monotonic() + 5
        while not engine.cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.cancelled == [engine.submitted[0].request_id]


def test_concurrent_streams() -> None:
    """Eight streams are served at once, not one after another: every stream waits at
    its first token until all eight have reached it (a server that serialised them
    would never open the gate, and the streams would fail)."""
    engine = FakeEngine(delay=0.005)
    gate: dict[str, Any] = {"arrived": 0, "open": None}

    async def all_eight_started() -> None:
        if gate["open"] is None:
            gate["open"] = asyncio.Event()
        gate["arrived"] += 1
        if gate["arrived"] == 8:
            gate["open"].set()
        await asyncio.wait_for(gate["open"].wait(), timeout=30)

    engine.before_first_token = all_eight_started

    async def one(ac: httpx.AsyncClient, i: int) -> str:
        r = await ac.post("/v1/messages", json={
            "max_tokens": 50, "stream": True, "system": "shared system prompt",
            "messages": [{"role": "user", "content": f"q{i}"}]})
        return "".join(d["delta"]["text"] for n, d in sse_events(r.text)
                       if n == "content_block_delta")

    async def main(base: str) -> list[str]:
        async with httpx.AsyncClient(base_url=base, timeout=60) as ac:
            return await asyncio.gather(*(one(ac, i) for i in range(8)))

    with uvicorn_thread(create_app(engine, ServerConfig())) as base:
        outs = asyncio.run(main(base))
    assert outs == ["Hello world!"] * 8
    assert gate["arrived"] == 8


class _PathTier:
    """A tier whose reason names its folder, as the SSD tier's does."""

    name = "ssd"

    def health(self) -> dict[str, Any]:
        return {"mode": "off", "degraded": True, "index_errors": 0,
                "reason": "cannot create the folder /srv/secret/blocks: Permission denied"}


def test_health_shows_no_paths_without_a_key_and_an_unreachable_redis(
        engine: FakeEngine) -> None:
    from harness.systems import free_port
    from promptcache.config import RedisConfig
    from promptcache.tiers.redis import RedisTier

    # nothing listens there: the startup check finds it unreachable
    redis = RedisTier(RedisConfig(url=f"redis://127.0.0.1:{free_port()}"), start_prober=False)
    assert redis.check_reachable() is False
    try:
        engine.cache.lower = [_PathTier(), redis]  # type: ignore[union-attr]
        c = TestClient(create_app(engine, ServerConfig(api_key="k")))
        h = c.get("/health")
        assert h.status_code == 200
        assert h.json()["tiers"] == {
            "ssd": {"mode": "off", "degraded": True, "index_errors": 0},
            "redis": {"healthy": False, "state": "open"}}
        assert "/srv" not in h.text
        for bad in ({}, {"Authorization": "Bearer wrong"}):
            assert "/srv" not in c.get("/health", headers=bad).text
        full = c.get("/health", headers={"Authorization": "Bearer k"}).json()["tiers"]
        assert full["ssd"]["reason"].startswith("cannot create the folder /srv/secret")
        assert full["redis"]["healthy"] is False
        assert full["redis"]["reason"].startswith("startup: ConnectionError")
        # a normal request beside it is served (the fake engine's cache, no tier touched)
        r = c.post("/v1/chat/completions", headers={"Authorization": "Bearer k"},
                   json={"model": "default", "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200
    finally:
        redis.close()
