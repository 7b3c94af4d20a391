"""The server over a real (tiny) batched engine: overload answers 429 / 529 with
Retry-After and never a 5xx while memory stays within the configured budgets (from
the server's own accounting); a dead engine thread turns /health into 503 and fails
pending requests with 500; the engine's numbers are in /metrics and /v1/cache/stats."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from promptcache.cache import PromptCache
from promptcache.config import CacheConfig
from promptcache.engine.engine import Engine
from promptcache.engine.payload.payload import MLXPayloadAdapter
from promptcache.server import create_app
from promptcache.serving_config import EngineConfig, ServerConfig

RAM_BUDGET = 8 * 1024**2
MAX_TOKENS = 8


def _engine(path, *, max_active=8, max_queued=8, kv_rows=None):
    cc = CacheConfig(block_size=8, ram_budget_bytes=RAM_BUDGET)
    cache = PromptCache(cc, adapter=MLXPayloadAdapter())
    eng = Engine.load(path, EngineConfig(prefill_chunk_tokens=16, max_active_requests=max_active,
                                         max_queued_requests=max_queued), cc, cache=cache)
    if kv_rows is not None:  # a KV budget that admits about kv_rows typical requests
        budget = kv_rows * eng.row_bytes(120 + MAX_TOKENS)
        eng.admission.kv_budget = budget
    return eng


def _body(i):
    if i % 2:
        return "/v1/messages", {"model": "default", "max_tokens": MAX_TOKENS,
                                "stream": i % 4 == 1,
                                "messages": [{"role": "user", "content": f"question {i} " * 8}]}
    return "/v1/chat/completions", {"model": "default", "max_tokens": MAX_TOKENS,
                                    "stream": i % 4 == 2,
                                    "messages": [{"role": "user", "content": f"ask {i} " * 9}]}


async def _fire(app, n):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as c:
        async def one(i):
            path, body = _body(i)
            r = await c.post(path, json=body)
            return path, r.status_code, r.headers.get("retry-after"), r.text
        return await asyncio.gather(*(one(i) for i in range(n)))


def _hold_engine_until_submitted(eng, n):
    """The engine thread starts no step until ``n`` submits have returned (admitted,
    queued or refused), so how many are refused does not depend on how fast the
    engine runs compared with the event loop: exactly ``max_queued`` wait. The calls
    queued for the engine thread (the preparer's cache lookups) still run meanwhile,
    or each would wait out its timeout before its request is submitted."""
    gate, lock, done = threading.Event(), threading.Lock(), [0]
    real_submit, real_step = eng.submit, eng.scheduler.step

    def submit(req):
        try:
            return real_submit(req)
        finally:
            with lock:
                done[0] += 1
                if done[0] == n:
                    gate.set()

    def step():
        deadline = time.monotonic() + 120  # a deadlock guard only: the assertions tell
        while not gate.wait(0.002) and time.monotonic() < deadline:  # what went wrong
            eng.calls.run()
        return real_step()

    eng.submit, eng.scheduler.step = submit, step
    return gate


def test_64_concurrent_requests_against_a_limit_of_8(tiny_llama_path):
    eng = _engine(tiny_llama_path, kv_rows=6)
    try:
        app = create_app(eng, ServerConfig())
        gate = _hold_engine_until_submitted(eng, 64)
        results = asyncio.run(_fire(app, 64))
        assert gate.is_set()
        statuses = [s for _, s, _, _ in results]
        assert all(s in (200, 429, 529) for s in statuses), statuses
        for path, status, retry, text in results:
            if status != 200:
                assert status == (529 if path == "/v1/messages" else 429)
                assert retry is not None and int(retry) >= 1
                assert "overloaded_error" in text if status == 529 else "rate_limit_error" in text
            else:
                assert "error" not in text.split("data:")[-1] or "[DONE]" in text
        stats = eng.stats()
        e = stats["engine"]
        # at the gate: at most 8 admitted (fewer if the KV budget says so), exactly 8
        # queued, every other one refused; the queued ones ran as slots freed
        assert e["queued_total"] == 8 and e["admitted"] == statuses.count(200)
        assert 8 < statuses.count(200) <= 16
        assert e["peak_active"] <= 8 and e["rejected"] == 64 - statuses.count(200)
        # memory within the budgets, from the server's own accounting
        assert 0 < e["peak_active_kv_bytes"] <= e["kv_budget_bytes"]
        assert stats["cache"]["ram_bytes"] <= RAM_BUDGET
        assert e["errors"] == 0 and e["active"] == 0 and e["queued"] == 0
        assert e["engine_calls_timed_out"] == 0 and e["engine_calls_failed"] == 0
    finally:
        eng.close()


def test_engine_numbers_in_metrics_and_stats(tiny_llama_path):
    eng = _engine(tiny_llama_path)
    try:
        client = TestClient(create_app(eng, ServerConfig()))
        r = client.post("/v1/chat/completions", json={
            "model": "default", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hello there"}]})
        assert r.status_code == 200
        text = client.get("/metrics").text
        for name in ("promptcache_engine_active_kv_bytes", "promptcache_engine_queued",
                     "promptcache_engine_peak_active_kv_bytes", "promptcache_engine_alive 1.0",
                     "promptcache_queue_wait_seconds_count 1.0"):
            assert name in text, name
        body = client.get("/v1/cache/stats").json()
        assert body["engine"]["admitted"] == 1 and body["engine"]["alive"] is True
    finally:
        eng.close()


@pytest.mark.parametrize("stream", [False, True])
def test_a_dead_engine_turns_health_503_and_pending_requests_500(tiny_llama_path, stream):
    eng = _engine(tiny_llama_path)
    try:
        client = TestClient(create_app(eng, ServerConfig()))
        assert client.get("/health").status_code == 200

        def broken():
            raise RuntimeError("scheduler bug")

        eng.scheduler.step = broken
        r = client.post("/v1/chat/completions", json={
            "model": "default", "max_tokens": 4, "stream": stream,
            "messages": [{"role": "user", "content": "hello"}]})
        if stream:  # headers were sent: the error arrives as an SSE error event
            assert r.status_code == 200 and '"type": "server_error"' in r.text
        else:
            assert r.status_code == 500 and "engine thread died" in r.text
        eng._thread.join(timeout=60)
        h = client.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "engine_dead"
        r = client.post("/v1/messages", json={
            "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503
    finally:
        eng.close()


def test_serve_admission_options(tmp_path):
    import psutil

    from promptcache.cli import build_parser
    from promptcache.cli.serve_cmd import MIN_KV_BUDGET, build_configs

    def configs(*argv):
        return build_configs(build_parser().parse_args(["serve", "--no-ssd", *argv]))

    eng, _, _, _ = configs("--max-active", "4", "--max-queue", "0", "--kv-budget", "2GB")
    assert (eng.max_active_requests, eng.max_queued_requests) == (4, 0)
    assert eng.active_kv_budget_bytes == 2 * 1024**3
    eng, _, _, _ = configs()  # defaults: 16 active, 64 queued, 10% of available RAM
    assert (eng.max_active_requests, eng.max_queued_requests) == (16, 64)
    assert eng.active_kv_budget_bytes == pytest.approx(
        max(MIN_KV_BUDGET, psutil.virtual_memory().available * 0.1), rel=0.05)
    assert configs("--kv-budget", "1MB")[0].active_kv_budget_bytes == MIN_KV_BUDGET
    for bad in (("--max-active", "0"), ("--max-queue", "-1"), ("--kv-budget", "lots")):
        with pytest.raises(ValueError):
            configs(*bad)
