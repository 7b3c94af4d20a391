"""Anthropic cache_control breakpoints on the server side: their token positions and
``cache_creation_input_tokens`` / ``usage.cache_creation`` (fake engine: one token per
byte, the template ``<|role|>content\\n``)."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from promptcache.server import create_app
from promptcache.server.api.anthropic_body import creation
from promptcache.serving_config import ServerConfig

CC = {"type": "ephemeral"}
CC_1H = {"type": "ephemeral", "ttl": "1h"}


def post(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    r = client.post("/v1/messages", json={"model": "default", "max_tokens": 5, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine, ServerConfig(prerender=False)))


def test_claude_code_breakpoints(client: TestClient, engine: FakeEngine) -> None:
    """System blocks (5m) and the newest user block (1h): the system prompt's tokens are
    created under 5m, the rest up to the end of the prompt under 1h."""
    body = {"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"},
                       {"type": "text", "text": "Agent.", "cache_control": CC},
                       {"type": "text", "text": " Be brief.", "cache_control": CC}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi", "cache_control": CC_1H}]}]}
    u = post(client, body)["usage"]
    system = len("<|system|>Agent. Be brief.\n")
    prompt = len(engine.submitted[-1].prompt_tokens)
    assert u["cache_creation"] == {"ephemeral_5m_input_tokens": system,
                                   "ephemeral_1h_input_tokens": prompt - system}
    assert (u["cache_creation_input_tokens"], u["input_tokens"]) == (prompt, 0)


def test_a_breakpoint_mid_conversation_bounds_the_creation(client: TestClient,
                                                           engine: FakeEngine) -> None:
    head = [{"role": "user", "content": [{"type": "text", "text": "first question",
                                          "cache_control": CC}]},
            {"role": "assistant", "content": "first answer"}]
    body = {"system": "sys", "messages": head + [{"role": "user", "content": "second"}]}
    u = post(client, body)["usage"]
    prompt = len(engine.submitted[-1].prompt_tokens)
    # the end of messages[0]: where the prompt leaves a rendering of it + a placeholder
    # message (with the fake's byte tokens the two share the "<|" of the next marker)
    end = len("<|system|>sys\n<|user|>first question\n<|")
    assert u["cache_creation_input_tokens"] == end
    assert u["cache_creation"] == {"ephemeral_5m_input_tokens": end,
                                   "ephemeral_1h_input_tokens": 0}
    assert u["input_tokens"] == prompt - end
    # the second turn reads the first one's prompt: nothing new before the breakpoint
    u2 = post(client, body)["usage"]
    assert u2["cache_read_input_tokens"] == prompt - 1
    assert u2["cache_creation_input_tokens"] == 0 and u2["input_tokens"] == 1


def test_tool_results_count_as_template_messages(client: TestClient,
                                                 engine: FakeEngine) -> None:
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "w",
                                               "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "sunny"},
                {"type": "text", "text": "thanks", "cache_control": CC}]},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "bye"}]
    u = post(client, {"messages": msgs})["usage"]
    rendered = engine.rendered[-1][0]
    assert [m["role"] for m in rendered] == ["user", "assistant", "tool", "user",
                                             "assistant", "user"]
    text = bytes(engine.submitted[-1].prompt_tokens).decode()
    end = text.index("<|assistant|>ok") + len("<|")
    assert u["cache_creation_input_tokens"] == end


def test_without_breakpoints_every_stored_token_is_created(client: TestClient,
                                                           engine: FakeEngine) -> None:
    u = post(client, {"messages": [{"role": "user", "content": "hi"}]})["usage"]
    prompt = len(engine.submitted[-1].prompt_tokens)
    assert u["cache_creation_input_tokens"] == prompt
    assert u["cache_creation"] == {"ephemeral_5m_input_tokens": prompt,
                                   "ephemeral_1h_input_tokens": 0}


def test_a_top_level_cache_control_marks_the_end(client: TestClient, engine: FakeEngine
                                                 ) -> None:
    u = post(client, {"cache_control": CC_1H, "messages": [{"role": "user", "content": "hi"}]}
             )["usage"]
    prompt = len(engine.submitted[-1].prompt_tokens)
    assert u["cache_creation"]["ephemeral_1h_input_tokens"] == prompt


@pytest.mark.parametrize("cc, message", [
    ({"type": "persistent"}, "expected {'type': 'ephemeral'}"),
    ({"type": "ephemeral", "ttl": "2h"}, "expected '5m' or '1h', got '2h'"),
])
def test_bad_cache_control_is_a_400(client: TestClient, cc: dict[str, Any], message: str
                                    ) -> None:
    r = client.post("/v1/messages", json={"model": "default", "max_tokens": 5, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": cc}]}]})
    assert r.status_code == 400
    assert message in r.json()["error"]["message"]
    assert "messages[0].content[0].cache_control" in r.json()["error"]["message"]


def test_creation_split() -> None:
    assert creation(100, 0, ()) == (100, {"ephemeral_5m_input_tokens": 100,
                                          "ephemeral_1h_input_tokens": 0})
    assert creation(100, 30, ((20, 3600.0), (60, 300.0))) == (
        30, {"ephemeral_5m_input_tokens": 30, "ephemeral_1h_input_tokens": 0})
    assert creation(100, 10, ((20, 3600.0), (60, 300.0))) == (
        50, {"ephemeral_5m_input_tokens": 40, "ephemeral_1h_input_tokens": 10})
    assert creation(100, 99, ((60, 300.0),)) == (0, {"ephemeral_5m_input_tokens": 0,
                                                     "ephemeral_1h_input_tokens": 0})


def sync(client: TestClient) -> None:
    """The preparation worker runs in order: a later preparation done, so is the
    protection queued before it."""
    client.post("/v1/messages/count_tokens", json={"model": "default", "messages": [
        {"role": "user", "content": "sync"}]})


def test_breakpoints_are_protected_for_their_ttl(client: TestClient, engine: FakeEngine
                                                 ) -> None:
    body = {"system": [{"type": "text", "text": "Agent.", "cache_control": CC}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi", "cache_control": CC_1H}]}]}
    post(client, body)
    sync(client)
    prompt = len(engine.submitted[-1].prompt_tokens)
    assert engine.cache is not None
    assert engine.cache.protected == [("default", len("<|system|>Agent.\n"), 300.0, None, True),
                                      ("default", prompt, 3600.0, None, True)]
    assert engine.cache.active == []  # no session header: no session level


def test_a_session_marks_its_latest_chain_per_agent(client: TestClient, engine: FakeEngine
                                                    ) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/messages", json={"model": "default", "max_tokens": 5, **body},
                    headers={"X-Claude-Code-Session-Id": "s1"})
    assert r.status_code == 200
    r = client.post("/v1/messages", json={"model": "default", "max_tokens": 5, **body},
                    headers={"X-Claude-Code-Session-Id": "s1", "X-Claude-Code-Agent-Id": "a1",
                             "X-Claude-Code-Parent-Agent-Id": "main"})
    assert r.status_code == 200
    sync(client)
    n = len(engine.submitted[-1].prompt_tokens) + 5
    assert engine.cache is not None
    assert engine.cache.active == [("default", n, "s1"), ("default", n, "s1\x1fa1")]
    assert engine.cache.protected == []


@pytest.mark.parametrize("retention, persist", [(None, False), ("in_memory", False),
                                                ("24h", True)])
def test_prompt_cache_key_protects_the_turns_chain(client: TestClient, engine: FakeEngine,
                                                   retention: str | None, persist: bool
                                                   ) -> None:
    body: dict[str, Any] = {"model": "default", "max_tokens": 5, "prompt_cache_key": "k1",
                            "messages": [{"role": "user", "content": "hi"}]}
    if retention:
        body["prompt_cache_retention"] = retention
    r = client.post("/v1/chat/completions", json=body, headers={"X-Tenant-Id": "t1"})
    assert r.status_code == 200
    sync(client)
    n = len(engine.submitted[-1].prompt_tokens) + 5
    assert engine.submitted[-1].session_id == "k1"
    assert engine.cache is not None
    assert engine.cache.protected == [("t1", n, 600.0, "k1", persist)]
    # 24h also pins the chain on the SSD for a day; in_memory pins nothing
    assert engine.cache.pinned == [("k1", 86400.0 if persist else None)]
    assert engine.cache.active == [("t1", n, "k1")]
    # the Responses API reads the same fields
    r = client.post("/v1/responses", json={"model": "default", "input": "hi",
                                           "max_output_tokens": 5, "prompt_cache_key": "k2",
                                           "prompt_cache_retention": retention or "in_memory"})
    assert r.status_code == 200
    sync(client)
    assert engine.cache.protected[-1][2:] == (600.0, "k2", persist)
    assert engine.cache.pinned[-1] == ("k2", 86400.0 if persist else None)


def test_without_a_key_nothing_is_protected_and_bad_retention_is_a_400(
        client: TestClient, engine: FakeEngine) -> None:
    body = {"model": "default", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    sync(client)
    assert engine.cache is not None and engine.cache.protected == []
    r = client.post("/v1/chat/completions", json={**body, "prompt_cache_key": "k",
                                                  "prompt_cache_retention": "forever"})
    assert r.status_code == 400
    assert "prompt_cache_retention must be one of in_memory, 24h" in r.json()["error"]["message"]
