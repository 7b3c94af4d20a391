"""``RequestFinished`` (server/finished.py): one event per answered request, heard by the
operations' subscribers on ``ServerState.finished``; a failing subscriber breaks nothing.
And the port's degradation: a cache call that fails on the engine side never fails the
request."""

from __future__ import annotations

from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from promptcache.server import create_app
from promptcache.server.finished import RequestFinished
from promptcache.serving_config import ServerConfig

BODY = {"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}


def test_every_answered_request_is_one_event_to_the_subscribers() -> None:
    engine = FakeEngine()
    app = create_app(engine, ServerConfig(prerender=False))
    seen: list[RequestFinished] = []

    def broken(ev: RequestFinished) -> None:
        raise RuntimeError("a broken subscriber")

    app.state.pc.finished[:0] = [broken]  # first: the others still hear every event
    app.state.pc.finished.append(seen.append)
    client = TestClient(app)
    r = client.post("/v1/messages", json=BODY, headers={"X-Claude-Code-Session-Id": "s1"})
    assert r.status_code == 200
    r = client.post("/v1/chat/completions", json={**BODY, "stream": True},
                    headers={"X-Tenant-Id": "t2"})
    assert r.status_code == 200
    assert [(e.api, e.tenant, e.scope.session_id, e.result.finish_reason) for e in seen] == [
        ("anthropic", "default", "s1", "length"), ("openai", "t2", None, "length")]
    first = seen[0]
    assert first.served and not first.failed and first.usage.completion_tokens == 5
    assert first.request_id == engine.submitted[0].request_id and first.ttft_s == 0.001
    # the standard subscribers ran for both: history, session counts, metrics
    st = app.state.pc
    assert st.history.summary(None)["requests"] == 2
    assert st.metrics.registry.get_sample_value("promptcache_requests_in_flight") == 0


def test_a_failing_cache_call_degrades_and_the_request_is_answered() -> None:
    class Broken(FakeEngine):
        def predict_cached(self, tokens, tenant, extra_keys=()):  # type: ignore[no-untyped-def]
            raise RuntimeError("lookup failed")

        def protect(self, *a, **kw):  # type: ignore[no-untyped-def]
            raise RuntimeError("protect failed")

    engine = Broken()
    client = TestClient(create_app(engine, ServerConfig(prerender=False)))
    body = {**BODY, "stream": True,
            "system": [{"type": "text", "text": "Agent.",
                        "cache_control": {"type": "ephemeral"}}]}
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200 and "message_stop" in r.text
    assert '"cache_read_input_tokens":0' in r.text.replace(" ", "")
