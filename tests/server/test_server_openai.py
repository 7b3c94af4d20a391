"""OpenAI endpoints against the fake engine: shapes, SSE sequences, usage, errors."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import sse_events

USER_HI = [{"role": "user", "content": "hi"}]


def rendered_len(engine: FakeEngine, messages: list[dict[str, Any]], tools: Any = None) -> int:
    return len(FakeEngine().render_chat(messages, tools))


def test_chat_non_streaming_shape_and_usage(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/chat/completions", json={"model": "fake-model", "messages": USER_HI})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "fake-model"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant",
                                                        "content": "Hello world!"},
                                "logprobs": None, "finish_reason": "stop"}]
    n = rendered_len(engine, USER_HI)  # "<|user|>hi\n<|assistant|>" = 24 bytes
    assert n == 24
    assert body["usage"] == {"prompt_tokens": 24, "completion_tokens": 12, "total_tokens": 36,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    req = engine.submitted[0]
    assert req.tenant == "default" and req.session_id is None
    assert req.sampling.max_tokens == 64  # default_max_tokens of the fake's EngineConfig
    assert req.message_starts == (0,)


def test_second_turn_reports_cached_tokens(client: TestClient, engine: FakeEngine) -> None:
    client.post("/v1/chat/completions", json={"messages": USER_HI})
    turn2 = USER_HI + [{"role": "assistant", "content": "Hello world!"},
                       {"role": "user", "content": "more"}]
    body = client.post("/v1/chat/completions", json={"messages": turn2}).json()
    # stored: "<|user|>hi\n<|assistant|>Hello world!" (24 + 12 bytes); turn 2 renders
    # "<|user|>hi\n<|assistant|>Hello world!\n<|user|>more\n<|assistant|>"
    assert body["usage"]["prompt_tokens"] == 24 + 12 + 1 + 13 + 13
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 36}


def test_chat_streaming_with_usage(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={
        "messages": USER_HI, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == (None, "[DONE]")
    chunks = [d for _, d in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello world!"
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["stop"]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 24, "completion_tokens": 12,
                                   "total_tokens": 36,
                                   "prompt_tokens_details": {"cached_tokens": 0}}
    # 1 role chunk + 12 content chunks + 1 finish chunk + 1 usage chunk
    assert len(chunks) == 15


def test_chat_streaming_without_usage(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json={"messages": USER_HI, "stream": True,
                                                  "max_tokens": 5})
    chunks = [d for _, d in sse_events(r.text)[:-1]]
    assert all("usage" not in c for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "Hello"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_max_tokens_and_length_finish(client: TestClient, engine: FakeEngine) -> None:
    body = client.post("/v1/chat/completions", json={
        "messages": USER_HI, "max_completion_tokens": 5, "temperature": 0.5, "top_p": 0.9,
        "seed": 7, "stop": ["\n"]}).json()
    assert body["choices"][0]["message"]["content"] == "Hello"
    assert body["choices"][0]["finish_reason"] == "length"
    s = engine.submitted[0].sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.stop) == (5, 0.5, 0.9, 7, ("\n",))


def test_content_parts_tools_and_tool_calls(client: TestClient, engine: FakeEngine) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [
        {"role": "developer", "content": [{"type": "text", "text": "be "},
                                          {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.post("/v1/chat/completions", json={"messages": messages, "tools": tools})
    assert r.status_code == 200, r.text
    rendered, rtools = engine.rendered[-1]
    assert rtools == tools
    assert rendered == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]


def test_completions(client: TestClient, engine: FakeEngine) -> None:
    body = client.post("/v1/completions", json={"model": "default", "prompt": "abc",
                                                "max_tokens": 4}).json()
    assert body["object"] == "text_completion"
    assert body["choices"] == [{"index": 0, "text": "Hell", "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"]["prompt_tokens"] == 3
    assert engine.submitted[0].prompt_tokens == (97, 98, 99)
    body = client.post("/v1/completions", json={"prompt": [97, 98, 99]}).json()
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2}
    r = client.post("/v1/completions", json={"prompt": "abc", "stream": True,
                                             "stream_options": {"include_usage": True}})
    events = sse_events(r.text)
    chunks = [d for _, d in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello world!"
    assert chunks[-1]["usage"]["prompt_tokens"] == 3


def test_models(client: TestClient) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fake-model"]
    assert client.get("/v1/models/default").json()["id"] == "fake-model"
    assert client.get("/v1/models/gpt-4").status_code == 404


def _post(client: TestClient, payload: Any = None, **kw: Any) -> Any:
    return client.post("/v1/chat/completions", json=payload, **kw)


@pytest.mark.parametrize("payload, status, code, fragment", [
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request", "unknown role"),
    ({"messages": []}, 400, "invalid_request", "must not be empty"),
    ({"messages": USER_HI, "max_tokens": 0}, 400, None, "max_tokens must be > 0"),
    ({"messages": USER_HI, "max_tokens": -3}, 400, None, "max_tokens must be > 0"),
    ({"messages": [{"role": "user", "content": "x" * 5000}]}, 400, "context_length_exceeded",
     "context length"),
    ({"model": "gpt-4", "messages": USER_HI}, 404, "model_not_found", "not served"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "invalid_request", "not supported"),
    ({"messages": USER_HI, "n": 2}, 400, None, "n=1"),
    ({"messages": USER_HI, "temperature": 500}, 400, "invalid_request", "temperature"),
    ({"messages": [{"role": "user", "content": "EXPLODE"}]}, 400, "invalid_messages",
     "chat template"),
    ({"messages": "hello"}, 400, "invalid_request", "messages"),
    ({"prompt": "no messages"}, 400, "invalid_request", "messages"),
    ({"messages": [{"role": "user", "content": None}]}, 400, "invalid_request", "null"),
])
def test_chat_errors_are_openai_shaped_4xx(client: TestClient, payload: Any, status: int,
                                           code: str | None, fragment: str) -> None:
    r = _post(client, payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert fragment in err["message"]
    assert err["type"] == "invalid_request_error"
    # the server keeps serving
    assert _post(client, {"messages": USER_HI}).status_code == 200


def test_malformed_json_and_content_type(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "request body is not valid JSON"
    r = client.post("/v1/chat/completions", content=b"messages=1",
                    headers={"content-type": "text/plain"})
    assert r.status_code == 415
    assert r.json()["error"]["code"] == "unsupported_media_type"
    r = client.get("/v1/nope")
    assert r.status_code == 404 and "unknown endpoint" in r.json()["error"]["message"]
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_engine_value_error_is_400(client: TestClient) -> None:
    # the fake engine refuses token ids > 255 at submit time
    r = client.post("/v1/completions", json={"prompt": [1, 300]})
    assert r.status_code == 400
    assert "out of range" in r.json()["error"]["message"]
