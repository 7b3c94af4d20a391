"""Anthropic cache_control breakpoints on the server side: their token positions and
``cache_creation_input_tokens`` / ``usage.cache_creation`` (fake engine: one token per
byte, the template ``<|role|>content\\n``)."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from promptcache.config import ServerConfig
from promptcache.server import create_app
from promptcache.server.anthropic import creation

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
