"""Anthropic endpoints against the fake engine: shapes, event sequence, usage, errors."""

from __future__ import annotations

from typing import Any

import pytest
import sse_checks
from fake_engine import FakeCache, FakeEngine
from fastapi.testclient import TestClient
from server_helpers import sse_events

from promptcache.server import create_app
from promptcache.serving_config import ServerConfig

HI = [{"role": "user", "content": "hi"}]


def test_messages_non_streaming(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/messages", json={"model": "default", "max_tokens": 100,
                                          "system": "be nice", "messages": HI})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["type"] == "message" and body["role"] == "assistant"
    assert body["model"] == "fake-model"
    assert body["id"].startswith("msg_")
    assert body["content"] == [{"type": "text", "text": "Hello world!"}]
    assert body["stop_reason"] == "end_turn" and body["stop_sequence"] is None
    # "<|system|>be nice\n<|user|>hi\n<|assistant|>" = 18 + 11 + 13 bytes
    assert body["usage"] == {"input_tokens": 0, "cache_creation_input_tokens": 42,
                             "cache_read_input_tokens": 0, "output_tokens": 12,
                             "cache_creation": {"ephemeral_5m_input_tokens": 42, "ephemeral_1h_input_tokens": 0}}
    assert engine.rendered[-1][0][0] == {"role": "system", "content": "be nice"}


def test_usage_sums_over_turns(client: TestClient) -> None:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    reads = []
    for turn in range(3):
        body = client.post("/v1/messages", json={"max_tokens": 50, "messages": msgs}).json()
        u = body["usage"]
        prompt = len(FakeEngine().render_chat(
            [{"role": m["role"], "content": m["content"]} for m in msgs]))
        # disjoint, as in Anthropic's API: the three add up to the prompt
        assert (u["input_tokens"] + u["cache_creation_input_tokens"]
                + u["cache_read_input_tokens"]) == prompt
        assert u["input_tokens"] == 0  # every uncached prompt token was stored
        reads.append(u["cache_read_input_tokens"])
        msgs += [{"role": "assistant", "content": body["content"][0]["text"]},
                 {"role": "user", "content": f"turn {turn}"}]
    # turn 1 cold; later turns read the previous prompt + reply (24+12, then +1+15+13+12)
    assert reads == [0, 36, 36 + 1 + 15 + 13 + 12]


def test_messages_streaming_event_sequence(client: TestClient) -> None:
    client.post("/v1/messages", json={"max_tokens": 50, "messages": HI})
    r = client.post("/v1/messages", json={"max_tokens": 5, "messages": HI, "stream": True})
    assert r.status_code == 200
    events = sse_events(r.text)
    names = [n for n, _ in events]
    assert names == ["message_start", "content_block_start", "ping"] + \
        ["content_block_delta"] * 5 + ["content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    # predicted from a pure lookup: 24-token prompt, 23 cached (the last token is
    # recomputed); stored whole already, so nothing is written: the last token is input
    assert start["usage"] == {"input_tokens": 1, "cache_creation_input_tokens": 0,
                              "cache_read_input_tokens": 23, "output_tokens": 0,
                              "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}}
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    text = "".join(d["delta"]["text"] for n, d in events if n == "content_block_delta")
    assert text == "Hello"
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"] == {**start["usage"], "output_tokens": 5}


@pytest.mark.parametrize("case", ["cold", "repeat", "longer"])
def test_streamed_and_whole_usage_agree(engine: FakeEngine, case: str) -> None:
    """message_start's predicted usage, message_delta's and the non-streamed reply's use
    one definition (cache_creation_input_tokens: the uncached tokens when the request
    stores prompt blocks, else 0; a prompt stored whole stores none) and give the same
    numbers: a cold prompt writes all of it; the same prompt again writes nothing (its
    last token, always computed, is input; the stream said 1 created, the delta 0);
    a prompt that extends a stored one writes its new part."""
    prompt = len(engine.render_chat(HI))  # 24
    first = {"cold": None, "repeat": HI, "longer": [{"role": "user", "content": "h"}]}[case]
    common = len("<|user|>h")  # of "<|user|>h\n<|assistant|>Hello" stored first
    want = {"cold": (0, prompt, 0), "repeat": (1, 0, prompt - 1),
            "longer": (0, prompt - common, common)}[case]
    got = []
    for stream in (True, False):
        engine.cache = FakeCache()
        client = TestClient(create_app(engine, ServerConfig()))
        if first is not None:
            client.post("/v1/messages", json={"max_tokens": 5, "messages": first})
        r = client.post("/v1/messages", json={"max_tokens": 5, "messages": HI,
                                              "stream": stream})
        if stream:
            ant = sse_checks.anthropic_stream(r.text)
            assert ant["start_usage"] == {**ant["usage"], "output_tokens": 0}
            got.append(ant["usage"])
        else:
            got.append(r.json()["usage"])
    assert got[0] == got[1]
    u = got[0]
    assert (u["input_tokens"], u["cache_creation_input_tokens"],
            u["cache_read_input_tokens"]) == want
    assert u["cache_creation"] == {"ephemeral_5m_input_tokens": want[1],
                                   "ephemeral_1h_input_tokens": 0}


def test_tool_use_and_tool_result_blocks(client: TestClient, engine: FakeEngine) -> None:
    tools = [{"name": "read_file", "description": "read a file",
              "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "open a.py"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "hmm", "signature": "x"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file",
             "input": {"path": "a.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "print(1)"}]},
            {"type": "text", "text": "explain", "cache_control": {"type": "ephemeral"}}]},
    ]
    system = [{"type": "text", "text": "You are a coder."}]
    r = client.post("/v1/messages", json={"max_tokens": 10, "system": system,
                                          "messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    rendered, rtools = engine.rendered[-1]
    assert rtools == [{"type": "function", "function": {
        "name": "read_file", "description": "read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]
    assert rendered == [
        {"role": "system", "content": "You are a coder."},
        {"role": "user", "content": "open a.py"},
        {"role": "assistant", "content": "Reading.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "print(1)"},
        {"role": "user", "content": "explain"},
    ]


def test_count_tokens(client: TestClient) -> None:
    r = client.post("/v1/messages/count_tokens", json={"model": "fake-model", "messages": HI,
                                                       "system": "be nice"})
    assert r.json() == {"input_tokens": 42}


@pytest.mark.parametrize("payload, status, etype, fragment", [
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, 400,
     "invalid_request_error", "unknown role"),
    ({"messages": HI}, 400, "invalid_request_error", "max_tokens"),
    ({"max_tokens": 0, "messages": HI}, 400, "invalid_request_error", "max_tokens must be > 0"),
    ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error", "must not be empty"),
    ({"max_tokens": 5, "messages": HI, "model": "claude-opus-4"}, 404, "not_found_error",
     "not served"),
    ({"max_tokens": 5, "messages": HI, "temperature": 1.5}, 400, "invalid_request_error",
     "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, "invalid_request_error", "not supported"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "n", "input": {}}]}]}, 400,
     "invalid_request_error", "unexpected content block"),
])
def test_errors_are_anthropic_shaped(client: TestClient, payload: Any, status: int, etype: str,
                                     fragment: str) -> None:
    r = client.post("/v1/messages", json=payload)
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == etype
    assert fragment in body["error"]["message"]


def test_malformed_json_anthropic(client: TestClient) -> None:
    r = client.post("/v1/messages", content=b"[", headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": "request body is not valid JSON"}}
