"""POST /v1/cache/probe on a real tiny engine: one test per cause (cold, diverged in the
tools / the system prompt / the messages, evicted, expired, not restorable), a full hit,
the three request kinds, and the errors. The probe is a pure query: it never stores."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from real_engine import Clock, make_cache, tiny_engine

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

SYSTEM = "You are a terse assistant who answers questions about caches and blocks."
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
HEADERS = {"X-Session-Id": "probe-session"}


def chat_body(user: str = "Tell me about the memory of a server please.",
              system: str = SYSTEM, tools: Any = None, **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "default", "max_tokens": 1,
                            "messages": [{"role": "system", "content": system},
                                         {"role": "user", "content": user}], **kw}
    if tools:
        body["tools"] = tools
    return body


class Served:
    def __init__(self, path: Path, ttl: float | None = None) -> None:
        self.clock = Clock()
        self.cache = make_cache(ttl_seconds=ttl, clock=self.clock)
        self.engine = tiny_engine(path, self.cache)
        self.client = TestClient(create_app(self.engine, ServerConfig()))

    def turn(self, body: dict[str, Any], path: str = "/v1/chat/completions") -> Any:
        r = self.client.post(path, json=body, headers=HEADERS)
        assert r.status_code == 200, r.text
        return r.json()

    def probe(self, body: dict[str, Any], api: str | None = None,
              headers: dict[str, str] | None = None) -> dict[str, Any]:
        url = "/v1/cache/probe" + (f"?api={api}" if api else "")
        r = self.client.post(url, json=body, headers=headers or HEADERS)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data

    def close(self) -> None:
        self.engine.close()


@pytest.fixture
def served(tiny_llama_path: Path) -> Iterator[Served]:
    s = Served(tiny_llama_path, ttl=60.0)
    yield s
    s.close()


def test_full_hit_and_nothing_is_stored(served: Served) -> None:
    served.turn(chat_body())
    before = served.cache.stats()
    got = served.probe(chat_body())
    n = got["prompt_tokens"]
    assert (got["api"], got["tenant"], got["session_id"]) == ("chat", "default", "probe-session")
    assert got["cached_tokens"] == n - 1 and got["cached_by_tier"] == {"ram": n - 1}
    assert got["matched_tokens"] == n
    assert got["divergence"] is None and got["cause"] is None
    assert got["cache_miss_reason"] is None
    assert got["canonicalization"] == ["billing_header", "tool_keys", "tool_order"]
    after = served.cache.stats()
    assert (after.lookups, after.ram_blocks) == (before.lookups, before.ram_blocks)


def test_cold(served: Served) -> None:
    got = served.probe(chat_body())
    assert got["cached_tokens"] == 0 and got["matched_tokens"] == 0
    assert got["cause"] == got["cache_miss_reason"] == "cold"
    div = got["divergence"]
    assert div["token_index"] == 0 and div["message_index"] == 0 and div["role"] == "system"
    assert div["cached_text"] == "" and div["common_text"] == ""
    assert div["request_text"].startswith("<|im_start|>system\nYou are")


def test_cold_after_the_stored_prefix_is_the_new_message(served: Served) -> None:
    """A next turn: everything up to the new user message is cached; the rest is new."""
    served.turn(chat_body())
    body = chat_body()
    body["messages"] += [{"role": "assistant", "content": "apital"},
                         {"role": "user", "content": "And the disk?"}]
    got = served.probe(body)
    assert got["cause"] == "cold"
    div = got["divergence"]
    assert div["cached_text"] == ""
    # the reply's one token was generated, not stored (its KV was never computed)
    assert (div["message_index"], div["role"], div["block"]) == (2, "assistant",
                                                                 "messages[2].content")
    assert div["token_index"] == got["cached_tokens"] == got["matched_tokens"]
    assert div["common_text"].endswith("<|im_start|>assistant\n")
    assert div["request_text"].startswith("apital<|im_end|>")


def test_system_changed(served: Served) -> None:
    served.turn(chat_body())
    changed = SYSTEM.replace("caches and blocks", "rivers and mountains")
    got = served.probe(chat_body(system=changed))
    assert got["cause"] == "diverged"
    assert got["cache_miss_reason"] == "system_changed"
    div = got["divergence"]
    assert (div["message_index"], div["role"], div["in_tools"]) == (0, "system", False)
    assert div["block"] == "messages[0].content"
    assert "caches" in div["common_text"] + div["cached_text"]
    assert "rivers" in div["common_text"] + div["request_text"]
    assert got["cached_tokens"] <= div["token_index"] < got["prompt_tokens"]


def test_tools_changed(served: Served) -> None:
    served.turn(chat_body(tools=TOOLS))
    tools = [{"type": "function", "function": {**TOOLS[0]["function"],
                                               "description": "Get the forecast for a city"}}]
    got = served.probe(chat_body(tools=tools))
    assert got["cause"] == "diverged"
    assert got["cache_miss_reason"] == "tools_changed"
    div = got["divergence"]
    assert div["in_tools"] is True
    assert div["block"] == "tools[0].function.description"
    assert "forecast" in div["request_text"] or "forecast" in div["common_text"] + div["request_text"]


def test_messages_changed(served: Served) -> None:
    body = chat_body()
    body["messages"] += [{"role": "assistant", "content": "apital"},
                         {"role": "user", "content": "And what about the disk of a server?"}]
    served.turn(body)
    body["messages"][1] = {"role": "user",
                           "content": "Tell me about the weather of a server please."}
    got = served.probe(body)
    assert got["cause"] == "diverged"
    assert got["cache_miss_reason"] == "messages_changed"
    div = got["divergence"]
    assert (div["message_index"], div["role"]) == (1, "user")
    assert div["block"] == "messages[1].content"
    assert "memory" in div["cached_text"] and "weather" in div["request_text"]


def test_evicted(served: Served) -> None:
    served.turn(chat_body())
    served.cache.evict()
    got = served.probe(chat_body())
    assert got["cached_tokens"] == 0
    assert got["cause"] == got["cache_miss_reason"] == "evicted"
    assert got["divergence"]["token_index"] == 0


def test_the_restore_plan_is_probed_and_logged(tiny_llama_path: Path, tmp_path: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Blocks on the SSD only: the probe reports the plan a turn would take (here forced:
    --restore-plan recompute), the turn takes it and its log line names it."""
    from promptcache.config import SSDConfig
    from promptcache.tiers.ssd import SSDTier

    cache = make_cache(lower=[SSDTier(SSDConfig(path=tmp_path, fsync=False))],
                       write_through=True)
    engine = tiny_engine(tiny_llama_path, cache, restore_plan="recompute")
    client = TestClient(create_app(engine, ServerConfig()))
    try:
        r = client.post("/v1/chat/completions", json=chat_body(), headers=HEADERS)
        assert r.status_code == 200
        got = client.post("/v1/cache/probe", json=chat_body(), headers=HEADERS).json()
        n = got["cached_tokens"]
        assert got["cached_by_tier"] == {"ram": n} and got["restore_plan"] is None
        assert cache.flush(10.0)
        cache.evict()
        got = client.post("/v1/cache/probe", json=chat_body(), headers=HEADERS).json()
        assert got["cached_by_tier"] == {"ssd": n}
        assert got["restore_plan"] == {
            "kind": "recompute", "why": "forced", "load_tokens": 0, "recompute": [0, n],
            "tail_load": [n, n], "predicted_s": {"load": None, "recompute": None,
                                                 "split": None}}
        with caplog.at_level("INFO", logger="promptcache.server.replies.runner"):
            r = client.post("/v1/chat/completions", json=chat_body(), headers=HEADERS)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert f"plan=recompute/forced[0:{n}:{n}]" in caplog.text
        assert "cache=hit:recompute" in caplog.text  # a planned recompute is no miss
        assert engine.engine_stats()["restore_plans_by_kind"] == {"recompute": 1}
        metrics = client.get("/metrics").text
        assert 'promptcache_engine_restore_plans_by_kind_total{kind="recompute"} 1.0' in metrics
        assert 'promptcache_engine_restore_plans_by_why_total{why="forced"} 1.0' in metrics
    finally:
        engine.close()


def test_expired(served: Served) -> None:
    served.turn(chat_body())
    served.clock.advance(61.0)
    got = served.probe(chat_body())
    assert got["cached_tokens"] == 0
    assert got["cause"] == got["cache_miss_reason"] == "expired"


def test_not_restorable(tiny_hybrid_path: Path) -> None:
    """A hybrid (SSM) state restores only where a snapshot was stored: a prompt that
    leaves the stored one mid-block matches further than it can restore."""
    s = Served(tiny_hybrid_path)
    try:
        served_body = chat_body(user="Tell me about the memory of a server please, "
                                     "and about its disk too.")
        s.turn(served_body)
        got = s.probe(chat_body(user="Tell me about the memory of a server please, "
                                     "and about its water too."))
        assert got["cause"] == got["cache_miss_reason"] == "not_restorable"
        assert got["cached_tokens"] < got["matched_tokens"]
        assert got["divergence"]["token_index"] == got["matched_tokens"]
    finally:
        s.close()


BILLING = "x-anthropic-billing-header: cc_version=2.1.197.{v}; cc_entrypoint=sdk-cli; cch={v};"


def messages_body(v: str) -> dict[str, Any]:
    return {"model": "default", "max_tokens": 1,
            "system": [{"type": "text", "text": BILLING.format(v=v)},
                       {"type": "text", "text": SYSTEM}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Tell me about the memory of a server please."}]}]}


@pytest.mark.parametrize("off", [(), ("billing_header",)])
def test_messages_body_and_the_billing_header(tiny_llama_path: Path, off: tuple[str, ...]
                                              ) -> None:
    s = Served(tiny_llama_path)
    try:
        s.client = TestClient(create_app(s.engine, ServerConfig(canonicalize_off=off)))
        s.turn(messages_body("a1"), "/v1/messages")
        got = s.probe(messages_body("b2"), headers={**HEADERS, "anthropic-version": "2023-06-01"})
        assert got["api"] == "messages"
        if not off:
            assert got["cached_tokens"] == got["prompt_tokens"] - 1
            assert got["cache_miss_reason"] is None
        else:
            assert got["cache_miss_reason"] == "system_changed"
            assert got["divergence"]["block"] == "system[0].text"
            assert got["canonicalization"] == ["tool_keys", "tool_order"]
    finally:
        s.close()


def test_responses_body_and_previous_turn(served: Served) -> None:
    body = {"model": "default", "instructions": SYSTEM, "max_output_tokens": 1,
            "input": [{"role": "user", "content": "Tell me about the memory of a server."}]}
    served.turn(body, "/v1/responses")
    got = served.probe(body)
    assert got["api"] == "responses"
    assert got["cached_tokens"] == got["prompt_tokens"] - 1
    # the session's previous turn (the same request): nothing to reuse was lost
    assert got["previous_turn"]["found"] is True
    assert got["previous_turn"]["diverges_at"] is None
    edited = {**body, "instructions": SYSTEM.replace("caches", "rivers")}
    prev = served.probe(edited)["previous_turn"]
    assert prev["change"] == "system_changed" and prev["block"] == "instructions"


def test_without_a_cache_and_bad_requests() -> None:
    client = TestClient(create_app(FakeEngine(use_cache=False), ServerConfig()))
    r = client.post("/v1/cache/probe", json=chat_body())
    assert r.status_code == 200
    assert r.json()["cause"] == r.json()["cache_miss_reason"] == "unavailable"
    r = client.post("/v1/cache/probe?api=vertex", json=chat_body())
    assert r.status_code == 400 and "api must be one of" in r.json()["error"]["message"]
    r = client.post("/v1/cache/probe?api=chat", json={"model": "default"})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = client.post("/v1/cache/probe", content=b"[1, 2]",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    r = client.post("/v1/cache/probe", json={**chat_body(), "model": "gpt-9"})
    assert r.status_code == 404
