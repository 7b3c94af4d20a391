"""The dashboard's routes and data without a browser (fake engine, in-process client),
and ``RequestHistory`` with exact figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

sys.path.insert(0, str(Path(__file__).parent.parent / "server"))

from fake_engine import FakeEngine  # noqa: E402

from promptcache.server import create_app  # noqa: E402
from promptcache.server.ops.history import RequestHistory  # noqa: E402
from promptcache.serving_config import ServerConfig  # noqa: E402


def _chat(c: TestClient, text: str, headers: dict[str, str]) -> None:
    r = c.post("/v1/chat/completions", headers=headers, json={
        "model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_page_and_assets_are_served_from_the_package() -> None:
    c = TestClient(create_app(FakeEngine(), ServerConfig()))
    page = c.get("/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/dashboard/static/dashboard.js">' in page.text
    assert "http" not in page.text.replace("http://www.w3.org", "")  # no CDN
    js = c.get("/dashboard/static/dashboard.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert "/v1/dashboard/data" in js.text
    assert c.get("/dashboard/static/dashboard.css").status_code == 200
    for bad in ("dashboard.html", "..%2Fadmin.py", "x.js"):
        assert c.get(f"/dashboard/static/{bad}").status_code == 404


def test_data_equals_cache_stats_and_counts_requests() -> None:
    c = TestClient(create_app(FakeEngine(), ServerConfig()))
    _chat(c, "hello there", {"X-Session-Id": "s1"})
    _chat(c, "hello there", {"X-Session-Id": "s1", "X-Tenant-Id": "t2"})
    data = c.get("/v1/dashboard/data").json()
    assert data["stats"] == c.get("/v1/cache/stats").json()
    req = data["requests"]
    assert req["requests"] == 2 and req["window_requests"] == 2
    assert [t["id"] for t in req["busiest_tenants"]] == ["default", "t2"]
    assert req["busiest_sessions"][0]["id"] == "s1" and req["busiest_sessions"][0]["requests"] == 2
    assert data["engine"] == {"active": 0, "queued": None, "source": "server"}
    assert data["server"]["tenant_scope"] is None


def test_data_needs_the_key_and_a_tenant_key_sees_its_tenant_only(tmp_path: Path) -> None:
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"ka": "alice", "kb": "bob"}))
    c = TestClient(create_app(FakeEngine(), ServerConfig(api_key="root", api_keys_file=keys)))
    assert c.get("/dashboard").status_code == 200  # the shell holds no data
    assert c.get("/v1/dashboard/data").status_code == 401
    assert c.get("/v1/dashboard/data", headers={"Authorization": "Bearer nope"}).status_code == 401
    _chat(c, "from alice", {"Authorization": "Bearer ka", "X-Session-Id": "a-1"})
    _chat(c, "from bob", {"Authorization": "Bearer kb", "X-Session-Id": "b-1"})
    alice = c.get("/v1/dashboard/data", headers={"x-api-key": "ka"}).json()
    assert alice["server"]["tenant_scope"] == "alice"
    assert alice["requests"]["requests"] == 1
    assert [s["id"] for s in alice["requests"]["busiest_sessions"]] == ["a-1"]
    root = c.get("/v1/dashboard/data", headers={"Authorization": "Bearer root"}).json()
    assert root["requests"]["requests"] == 2


def test_history_summary_exact() -> None:
    t = [100.0]
    h = RequestHistory(capacity=3, clock=lambda: t[0])
    h.record(api="chat", tenant="a", session="s", prompt_tokens=100, cached_tokens=0,
             ttft_s=0.5, cause="cold", rolling_hit_rate=None)
    h.record(api="chat", tenant="a", session="s", prompt_tokens=200, cached_tokens=150,
             ttft_s=0.1, cause="diverged", rolling_hit_rate=0.75)
    h.record(api="chat", tenant="b", session=None, prompt_tokens=50, cached_tokens=0,
             ttft_s=0.5, cause="cold", rolling_hit_rate=0.6)
    s = h.summary()
    assert (s["requests"], s["prompt_tokens"], s["cached_tokens"]) == (3, 350, 150)
    # prefill per token of the uncached requests: mean(0.5/100, 0.5/50) = 0.0075 s
    assert s["seconds_saved_estimate"] == pytest.approx(150 * 0.0075)
    assert (s["ttft_cached_s"], s["ttft_uncached_s"]) == (0.1, 0.5)
    assert [p["hit_rate"] for p in s["series"]] == [0.0, 0.75, 0.0]
    assert s["busiest_tenants"][0] == {"id": "a", "requests": 2, "prompt_tokens": 300,
                                       "cached_tokens": 150, "hit_rate": 0.5}
    assert [r["id"] for r in s["busiest_sessions"]] == ["s"]
    h.record(api="chat", tenant="b", session=None, prompt_tokens=10, cached_tokens=5,
             ttft_s=None, cause=None, rolling_hit_rate=0.6)
    s = h.summary()
    assert s["window_requests"] == 3 and s["requests"] == 4  # the ring drops the oldest
    assert s["tokens_saved"] == 155
    assert h.summary(tenant="b")["requests"] == 2
    with pytest.raises(ValueError):
        RequestHistory(capacity=0)


class _ArraysEngine(FakeEngine):
    """A fake engine that reports the arrays and the memory governor's numbers."""

    STATS = {"active": 1, "queued": 2, "ram_arrays": 1234, "live_arrays": 56,
             "max_arrays": 400_000, "memory_limit_bytes": 3 * 2**30,
             "memory_footprint_bytes": 2**30, "memory_level": "ok"}

    def engine_stats(self) -> dict[str, Any] | None:
        return dict(self.STATS)


def test_arrays_and_their_cap_are_in_the_data_the_page_and_metrics() -> None:
    c = TestClient(create_app(_ArraysEngine(), ServerConfig()))
    data = c.get("/v1/dashboard/data").json()
    eng = data["stats"]["engine"]
    assert (eng["ram_arrays"], eng["live_arrays"], eng["max_arrays"]) == (1234, 56, 400_000)
    assert data["engine"] == {"active": 1, "queued": 2, "source": "engine"}
    page = c.get("/dashboard").text
    for el in ("arrays", "ram-arrays", "live-arrays", "max-arrays", "footprint",
               "memory-limit", "memory-level"):
        assert f'id="{el}"' in page
    js = c.get("/dashboard/static/dashboard.js").text
    for key in ("ram_arrays", "live_arrays", "max_arrays", "memory_footprint_bytes"):
        assert f"es.{key}" in js
    metrics = c.get("/metrics").text
    for line in ("promptcache_engine_ram_arrays 1234.0", "promptcache_engine_live_arrays 56.0",
                 "promptcache_engine_max_arrays 400000.0",
                 "promptcache_engine_memory_footprint_bytes 1.073741824e+09"):
        assert line in metrics.splitlines(), line
