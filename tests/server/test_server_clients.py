"""What agentic clients rely on, against the fake engine: Claude Code's request shape,
thinking, the context-window policy in the wordings clients parse, keep-alive during a
long prefill, prefill continuation, client session headers, HEAD /, 4xx logging,
logprobs, a scripted tool call through all three APIs, the tools fallback."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import sse_checks
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from test_prompt_rewrites import FakeClock

from promptcache.server import create_app
from promptcache.server.prompts.prompt import tools_text
from promptcache.serving_config import EngineConfig, ServerConfig

HI = [{"role": "user", "content": "hi"}]


def _app(engine: FakeEngine, **config: Any) -> TestClient:
    return TestClient(create_app(engine, ServerConfig(**config),
                                 engine_config=EngineConfig(max_tokens_limit=32768,
                                                            default_max_tokens=64)))


# --- Claude Code's Messages requests ----------------------------------------------------

CLAUDE_BODY: dict[str, Any] = {
    "model": "default", "max_tokens": 64, "stream": False,
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.197;"},
               {"type": "text", "text": "You are Claude Code.",
                "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "say hi",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "system", "content": "Available agent types: general-purpose"},
    ],
    "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"},
               "cache_control": {"type": "ephemeral"}},
              {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
    "tool_choice": {"type": "auto"},
    "thinking": {"type": "adaptive"},
    "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
    "output_config": {"effort": "high"},
    "metadata": {"user_id": '{"device_id":"0","session_id":"s"}'},
    "service_tier": "auto",
}
CLAUDE_HEADERS = {"anthropic-beta": "claude-code-20250219,mid-conversation-system-2026-04-07",
                  "anthropic-version": "2023-06-01", "x-api-key": "dummy",
                  "X-Claude-Code-Session-Id": "cc-session-1"}


def test_claude_code_request_is_accepted(engine: FakeEngine, client: TestClient) -> None:
    r = client.post("/v1/messages?beta=true", json=CLAUDE_BODY, headers=CLAUDE_HEADERS)
    assert r.status_code == 200, r.text
    messages, tools = engine.rendered[-1]
    # the billing header block is dropped (canonical prompts, server/prompts/canon.py)
    assert messages == [
        {"role": "system", "content": "You are Claude Code."},
        {"role": "user", "content": "say hi"},
        {"role": "system", "content": "Available agent types: general-purpose"}]
    # the server tool is left out; the client tool offered
    assert [t["function"]["name"] for t in tools] == ["Bash"]
    assert engine.submitted[-1].session_id == "cc-session-1"


def test_mid_conversation_system_as_a_note_when_the_template_cannot(
        engine: FakeEngine) -> None:
    class NoMidSystem(FakeEngine):
        def render_chat_with_offsets(self, messages: Any, *a: Any, **kw: Any) -> Any:
            if any(x["role"] == "system" for x in messages[1:]):
                raise RuntimeError("System message must be at the beginning")
            return super().render_chat_with_offsets(messages, *a, **kw)

    eng = NoMidSystem()
    client = _app(eng)
    r = client.post("/v1/messages", json=CLAUDE_BODY)
    assert r.status_code == 200, r.text
    assert eng.rendered[-1][0][1:] == [{"role": "user", "content": (
        "say hi\n\n<system-message>\nAvailable agent types: general-purpose\n"
        "</system-message>")}]


def test_thinking_switch_and_thinking_blocks() -> None:
    eng = FakeEngine(think=True, reply="Let me see.</think>The answer.")
    client = _app(eng)
    body = {"max_tokens": 100, "messages": HI, "thinking": {"type": "enabled",
                                                            "budget_tokens": 1024}}
    r = client.post("/v1/messages", json=body)
    assert eng.template_kwargs[-1] == {"enable_thinking": True}
    content = r.json()["content"]
    assert [b["type"] for b in content] == ["thinking", "text"]
    assert content[0]["thinking"] == "Let me see." and content[0]["signature"]
    assert content[1] == {"type": "text", "text": "The answer."}
    got = sse_checks.anthropic_stream(client.post("/v1/messages", json={**body, "stream": True}).text)
    assert got["content"] == content
    client.post("/v1/messages", json={**body, "thinking": {"type": "disabled"}})
    assert eng.template_kwargs[-1] == {"enable_thinking": False}
    client.post("/v1/messages", json={**body, "thinking": {"type": "adaptive"}})
    assert eng.template_kwargs[-1] == {"enable_thinking": True}
    client.post("/v1/messages", json={"max_tokens": 10, "messages": HI})
    assert eng.template_kwargs[-1] is None
    r = client.post("/v1/messages", json={**body, "thinking": {"type": "sometimes"}})
    assert r.status_code == 400 and "thinking.type" in r.json()["error"]["message"]


def test_tool_choice_types(client: TestClient, engine: FakeEngine) -> None:
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    for kind in ("auto", "any", "tool"):
        choice = {"type": kind, "name": "f"} if kind == "tool" else {"type": kind}
        r = client.post("/v1/messages", json={"max_tokens": 5, "messages": HI, "tools": tools,
                                              "tool_choice": choice})
        assert r.status_code == 200 and engine.rendered[-1][1] is not None
    client.post("/v1/messages", json={"max_tokens": 5, "messages": HI, "tools": tools,
                                      "tool_choice": {"type": "none"}})
    assert engine.rendered[-1][1] is None
    r = client.post("/v1/messages", json={"max_tokens": 5, "messages": HI, "tools": tools,
                                          "tool_choice": {"type": "maybe"}})
    assert r.status_code == 400


def test_media_blocks_name_the_block(client: TestClient) -> None:
    for block in ({"type": "image", "source": {}}, {"type": "document", "source": {}}):
        r = client.post("/v1/messages", json={"max_tokens": 5, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "look"}, block]}]})
        assert r.status_code == 400
        assert r.json()["error"]["message"] == (
            f"messages[0].content[1]: content type {block['type']!r} is not supported "
            "(text-only model)")


# --- the context-window policy ----------------------------------------------------------


def test_anthropic_context_wordings() -> None:
    eng = FakeEngine(context_length=100)
    long = [{"role": "user", "content": "x" * 90}]  # 8 + 90 + 1 + 13 = 112 tokens
    client = _app(eng)
    r = client.post("/v1/messages", json={"max_tokens": 10, "messages": long})
    assert r.status_code == 400
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "prompt is too long: 112 tokens > 100 maximum"}}
    mid = [{"role": "user", "content": "x" * 60}]  # 82 tokens
    strict = _app(eng, max_tokens_overflow="error")
    r = strict.post("/v1/messages", json={"max_tokens": 32000, "messages": mid})
    assert r.json()["error"]["message"] == (
        "input length and `max_tokens` exceed context limit: 82 + 32000 > 100, decrease "
        "input length or `max_tokens` and try again")
    # what Claude Code's regular expression reads from it
    import re
    got = re.search(r"input length and `max_tokens` exceed context limit: (\d+) \+ (\d+) > (\d+)",
                    r.json()["error"]["message"])
    assert got is not None and got.groups() == ("82", "32000", "100")


def test_openai_context_wordings() -> None:
    eng = FakeEngine(context_length=100)
    long = [{"role": "user", "content": "x" * 90}]
    r = _app(eng).post("/v1/chat/completions", json={"messages": long})
    assert r.status_code == 400
    assert r.json() == {"error": {
        "message": "This model's maximum context length is 100 tokens. However, your "
                   "messages resulted in 112 tokens. Please reduce the length of the messages.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}
    mid = [{"role": "user", "content": "x" * 60}]
    r = _app(eng, max_tokens_overflow="error").post(
        "/v1/chat/completions", json={"messages": mid, "max_tokens": 50})
    assert r.json()["error"] == {
        "message": "This model's maximum context length is 100 tokens. However, you requested "
                   "132 tokens (82 in the messages, 50 in the completion). Please reduce the "
                   "length of the messages or completion.",
        "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}


def test_max_tokens_32000_on_an_8k_window_is_clamped() -> None:
    eng = FakeEngine(context_length=8192, reply="y" * 9000)
    client = _app(eng)
    msgs = [{"role": "user", "content": "x" * 8000}]  # 8022 tokens: 170 left
    r = client.post("/v1/messages", json={"max_tokens": 32000, "messages": msgs})
    assert r.status_code == 200, r.text
    assert eng.submitted[-1].sampling.max_tokens == 170
    assert r.json()["stop_reason"] == "max_tokens"
    assert r.json()["usage"]["output_tokens"] == 170
    r = client.post("/v1/chat/completions", json={"max_tokens": 32000, "messages": msgs})
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = client.post("/v1/responses", json={"max_output_tokens": 32000, "input": "x" * 8000})
    assert r.json()["status"] == "incomplete"


def test_max_tokens_100000_is_clamped_in_every_api() -> None:
    """docs/api.md: max_tokens past the room left in the window, or past
    ``--max-tokens-limit``, is clamped (the reply ends at it: ``length`` /
    ``max_tokens`` / incomplete), streamed or not, in every API; a 400 only with
    ``--max-tokens-overflow error``."""
    eng = FakeEngine(context_length=8192, reply="y" * 9000)
    client = _app(eng)  # --max-tokens-limit 32768
    msgs = [{"role": "user", "content": "x" * 8000}]  # 8022 tokens: 170 left
    for stream in (False, True):
        r = client.post("/v1/chat/completions", json={
            "max_tokens": 100000, "messages": msgs, "stream": stream,
            "stream_options": {"include_usage": True}} if stream else {
            "max_tokens": 100000, "messages": msgs})
        assert r.status_code == 200, r.text
        got = sse_checks.chat_stream(r.text) if stream else {
            "finish_reason": r.json()["choices"][0]["finish_reason"],
            "usage": r.json()["usage"]}
        assert eng.submitted[-1].sampling.max_tokens == 170
        assert (got["finish_reason"], got["usage"]["completion_tokens"]) == ("length", 170)
        r = client.post("/v1/messages", json={"max_tokens": 100000, "messages": msgs,
                                              "stream": stream})
        assert r.status_code == 200, r.text
        if stream:
            ant = sse_checks.anthropic_stream(r.text)
            stop, out = ant["stop"]["stop_reason"], ant["usage"]["output_tokens"]
        else:
            stop, out = r.json()["stop_reason"], r.json()["usage"]["output_tokens"]
        assert (stop, out) == ("max_tokens", 170)
        r = client.post("/v1/responses", json={"max_output_tokens": 100000,
                                               "input": "x" * 8000, "stream": stream})
        assert r.status_code == 200, r.text
        final = sse_checks.responses_stream(r.text) if stream else r.json()
        assert (final["status"], final["incomplete_details"], final["usage"]["output_tokens"]
                ) == ("incomplete", {"reason": "max_output_tokens"}, 170)
        assert eng.submitted[-1].sampling.max_tokens == 170
    r = client.post("/v1/completions", json={"max_tokens": 100000, "prompt": "x" * 8100})
    assert r.status_code == 200, r.text
    assert (r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]
            ) == ("length", 92)  # 8192 - 8100
    # a short prompt: clamped to --max-tokens-limit
    big = FakeEngine(context_length=200_000, reply="y" * 40_000)
    client = _app(big)
    r = client.post("/v1/messages", json={"max_tokens": 100000, "messages": HI})
    assert (r.json()["stop_reason"], r.json()["usage"]["output_tokens"]) == ("max_tokens",
                                                                             32768)
    r = client.post("/v1/chat/completions", json={"max_tokens": 100000, "messages": HI})
    assert (r.json()["choices"][0]["finish_reason"], r.json()["usage"]["completion_tokens"]
            ) == ("length", 32768)
    # --max-tokens-overflow error: past the limit is a 400 naming it
    r = _app(big, max_tokens_overflow="error").post(
        "/v1/chat/completions", json={"max_tokens": 100000, "messages": HI})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "max_tokens must be <= 32768, got 100000"
    assert r.json()["error"]["param"] == "max_tokens"


def test_default_max_tokens_and_context_window_override() -> None:
    eng = FakeEngine(context_length=4096, reply="z" * 500)
    client = TestClient(create_app(eng, ServerConfig(context_window=1000),
                                   engine_config=EngineConfig(default_max_tokens=300)))
    client.post("/v1/chat/completions", json={"messages": HI})
    assert eng.submitted[-1].sampling.max_tokens == 300
    r = client.post("/v1/chat/completions", json={"messages": [
        {"role": "user", "content": "x" * 990}]})
    assert r.json()["error"]["message"].startswith("This model's maximum context length is 1000")
    card = client.get("/v1/models").json()["data"][0]
    assert (card["context_window"], card["max_model_len"], card["max_output_tokens"]) == \
        (1000, 1000, 1000)
    assert card["type"] == "model" and card["display_name"] == "fake-model"


# --- keep-alive, prefill, HEAD, logging --------------------------------------------------


@pytest.mark.parametrize("api", ["anthropic", "chat", "responses"])
def test_keepalive_during_a_10_minute_prefill(api: str) -> None:
    eng = FakeEngine(reply="ok")
    clock = FakeClock(event_at=605.0)
    eng.before_first_token = clock.wait_event
    app = create_app(eng, ServerConfig(keepalive_s=10.0))
    app.state.pc_sleep = clock.sleep
    client = TestClient(app)
    if api == "anthropic":
        r = client.post("/v1/messages", json={"max_tokens": 5, "messages": HI, "stream": True})
        got = sse_checks.anthropic_stream(r.text)
        assert got["pings"] == 1 + 60  # the one after message_start, then one per 10 s
        assert got["content"] == [{"type": "text", "text": "ok"}]
    elif api == "chat":
        r = client.post("/v1/chat/completions", json={"messages": HI, "stream": True})
        got = sse_checks.chat_stream(r.text)
        assert got["comments"] == 60 and got["content"] == "ok"
    else:
        r = client.post("/v1/responses", json={"input": "hi", "stream": True})
        assert sse_checks.responses_stream(r.text)["comments"] == 60
    assert clock.ticks == [10.0 * i for i in range(1, 61)]


def test_assistant_prefill_is_continued(engine: FakeEngine, client: TestClient) -> None:
    engine.reply = '"answer": 42}'
    msgs = [{"role": "user", "content": "JSON please"}, {"role": "assistant", "content": "{"}]
    r = client.post("/v1/messages", json={"max_tokens": 50, "messages": msgs})
    text = r.json()["content"][0]["text"]
    assert json.loads("{" + text) == {"answer": 42}
    prompt = bytes(engine.submitted[-1].prompt_tokens).decode()
    assert prompt.endswith("<|assistant|>{")  # left open: no end of turn, no new turn
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 50})
    assert json.loads("{" + r.json()["choices"][0]["message"]["content"]) == {"answer": 42}
    assert bytes(engine.submitted[-1].prompt_tokens).decode().endswith("<|assistant|>{")


def test_head_root_and_4xx_logging(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    assert client.head("/").status_code == 200
    assert client.get("/").json()["model"] == "fake-model"
    with caplog.at_level(logging.WARNING, logger="promptcache.server.ops.request_log"):
        client.post("/v1/messages", json={"max_tokens": 5, "messages": [
            {"role": "wizard", "content": "x"}]}, headers={"X-Claude-Code-Session-Id": "s-1"})
        client.get("/v1/nope")
    # the request log's records only (another test may have let httpx's INFO lines reach
    # the root logger, which caplog sees too)
    lines = [r.getMessage() for r in caplog.records
             if r.name == "promptcache.server.ops.request_log"]
    assert lines[0] == ("POST /v1/messages -> 400: messages[0].role: unknown role 'wizard' "
                        "(expected user, assistant or system) "
                        "(session=s-1 (x-claude-code-session-id))")
    assert lines[1] == "GET /v1/nope -> 404: unknown endpoint: GET /v1/nope (session=-)"


# --- client identity -> sessions ---------------------------------------------------------


@pytest.mark.parametrize("headers, body, session, source", [
    ({"X-Session-Id": "explicit", "X-Claude-Code-Session-Id": "cc"}, {}, "explicit",
     "x-session-id"),
    ({"X-Claude-Code-Session-Id": "cc", "x-claude-code-agent-id": "ag"}, {}, "cc",
     "x-claude-code-session-id"),
    ({"session-id": "codex-1"}, {"prompt_cache_key": "other"}, "codex-1", "session-id"),
    ({"x-session-affinity": "ses_1"}, {}, "ses_1", "x-session-affinity"),
    ({}, {"prompt_cache_key": "pck"}, "pck", "prompt_cache_key"),
    ({"X-Claude-Code-Session-Id": "bad id with spaces"}, {}, None, None),
])
def test_session_sources(engine: FakeEngine, client: TestClient, headers: dict[str, str],
                         body: dict[str, Any], session: str | None, source: str | None,
                         caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="promptcache.server.replies.runner"):
        r = client.post("/v1/chat/completions", json={"messages": HI, **body}, headers=headers)
        assert r.status_code == 200
        r = client.post("/v1/responses", json={"input": "hi", **body}, headers=headers)
        assert r.status_code == 200
    assert [req.session_id for req in engine.submitted] == [session, session]
    logged = [rec.getMessage() for rec in caplog.records if "request " in rec.getMessage()]
    want = f"session={session} ({source})" if session else "session=-"
    assert all(want in line for line in logged) and len(logged) == 2
    if "x-claude-code-agent-id" in headers:
        assert all("agent=ag" in line for line in logged)


def test_bad_explicit_session_header_is_a_400(client: TestClient) -> None:
    r = client.post("/v1/messages", json={"max_tokens": 5, "messages": HI},
                    headers={"X-Session-Id": "has space"})
    assert r.status_code == 400 and "X-Session-Id" in r.json()["error"]["message"]


# --- logprobs ------------------------------------------------------------------------------


def test_chat_logprobs_shapes(engine: FakeEngine, client: TestClient) -> None:
    engine.reply = "Hi!"
    r = client.post("/v1/chat/completions", json={"messages": HI, "logprobs": True,
                                                  "top_logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert engine.submitted[-1].sampling.logprobs == 2
    # "H" = 72, "i" = 105, "!" = 33: logprob -(id % 7) / 10, alternatives id+1, id+2
    assert lp["refusal"] is None
    assert lp["content"][0] == {
        "token": "H", "logprob": -0.2, "bytes": [72],
        "top_logprobs": [{"token": "H", "logprob": -0.2, "bytes": [72]},
                         {"token": "I", "logprob": -1.3, "bytes": [73]}]}
    assert [e["token"] for e in lp["content"]] == ["H", "i", "!"]
    streamed = sse_checks.chat_stream(client.post("/v1/chat/completions", json={
        "messages": HI, "logprobs": True, "top_logprobs": 2, "stream": True}).text)
    assert streamed["logprobs"] == lp["content"]
    r = client.post("/v1/chat/completions", json={"messages": HI, "logprobs": True})
    assert r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"] == []
    assert client.post("/v1/chat/completions", json={"messages": HI}).json()[
        "choices"][0]["logprobs"] is None
    r = client.post("/v1/chat/completions", json={"messages": HI, "top_logprobs": 3})
    assert r.status_code == 400


def test_responses_logprobs_shapes(engine: FakeEngine, client: TestClient) -> None:
    engine.reply = "Hi!"
    body = client.post("/v1/responses", json={"input": "hi", "top_logprobs": 1}).json()
    part = body["output"][0]["content"][0]
    assert [e["token"] for e in part["logprobs"]] == ["H", "i", "!"]
    assert part["logprobs"][1] == {"token": "i", "logprob": 0.0, "bytes": [105],
                                   "top_logprobs": [{"token": "i", "logprob": 0.0,
                                                     "bytes": [105]}]}
    final = sse_checks.responses_stream(client.post("/v1/responses", json={
        "input": "hi", "top_logprobs": 1, "stream": True}).text)
    assert final["output"][0]["content"][0]["logprobs"] == part["logprobs"]


# --- a scripted tool call through all three APIs -----------------------------------------

CALL_TEXT = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
OAI_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}


@pytest.mark.parametrize("renders_tools", [True, False])
@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trips_through_every_api(renders_tools: bool, stream: bool) -> None:
    eng = FakeEngine(reply=CALL_TEXT, renders_tools=renders_tools)
    client = _app(eng)
    want = {"city": "Paris"}
    # chat completions
    r = client.post("/v1/chat/completions", json={"messages": HI, "tools": [OAI_TOOL],
                                                  "max_tokens": 200, "stream": stream})
    if stream:
        got = sse_checks.chat_stream(r.text)
        call = got["tool_calls"][0]
        assert got["finish_reason"] == "tool_calls" and got["content"] == ""
        call_id, name, args = call["id"], call["name"], call["arguments"]
    else:
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        tc = choice["message"]["tool_calls"][0]
        call_id, name, args = tc["id"], tc["function"]["name"], tc["function"]["arguments"]
    assert (name, json.loads(args)) == ("get_weather", want)
    eng.reply = "Sunny."
    r = client.post("/v1/chat/completions", json={"max_tokens": 50, "tools": [OAI_TOOL],
                                                  "messages": HI + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": args}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "20C"}]})
    assert r.json()["choices"][0]["message"]["content"] == "Sunny."
    _assert_history_shown(eng, renders_tools)
    # Anthropic messages
    eng.reply = CALL_TEXT
    tools = [{"name": "get_weather", "input_schema": OAI_TOOL["function"]["parameters"]}]
    r = client.post("/v1/messages", json={"max_tokens": 200, "messages": HI, "tools": tools,
                                          "stream": stream})
    blocks = sse_checks.anthropic_stream(r.text)["content"] if stream else r.json()["content"]
    [use] = [b for b in blocks if b["type"] == "tool_use"]
    assert (use["name"], use["input"]) == ("get_weather", want)
    eng.reply = "Sunny."
    r = client.post("/v1/messages", json={"max_tokens": 50, "tools": tools, "messages": HI + [
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                      "content": "20C"}]}]})
    assert r.json()["content"] == [{"type": "text", "text": "Sunny."}]
    _assert_history_shown(eng, renders_tools)
    # Responses
    eng.reply = CALL_TEXT
    rtool = {"type": "function", "name": "get_weather",
             "parameters": OAI_TOOL["function"]["parameters"]}
    r = client.post("/v1/responses", json={"input": "hi", "tools": [rtool], "stream": stream,
                                           "max_output_tokens": 200})
    final = sse_checks.responses_stream(r.text) if stream else r.json()
    [fc] = final["output"]
    assert (fc["type"], fc["name"], json.loads(fc["arguments"])) == \
        ("function_call", "get_weather", want)
    eng.reply = "Sunny."
    r = client.post("/v1/responses", json={
        "previous_response_id": final["id"], "tools": [rtool], "max_output_tokens": 50,
        "input": [{"type": "function_call_output", "call_id": fc["call_id"], "output": "20C"}]})
    assert r.json()["output"][0]["content"][0]["text"] == "Sunny."
    _assert_history_shown(eng, renders_tools)


def _assert_history_shown(eng: FakeEngine, renders_tools: bool) -> None:
    """The model saw the tools, its call and the result, whichever way they render."""
    text = bytes(eng.submitted[-1].prompt_tokens).decode()
    assert '"get_weather"' in text and "20C" in text
    if renders_tools:
        assert text.startswith("<|tools|>") and "<|tool|>20C" in text
    else:
        assert text.startswith("<|system|># Tools") and "<tool_response>\n20C" in text
        assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text


def test_count_tokens_grows_by_the_tools_when_the_template_drops_them() -> None:
    eng = FakeEngine(renders_tools=False)
    client = _app(eng)
    tools = [{"name": "get_weather", "description": "weather",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    base = client.post("/v1/messages/count_tokens", json={"messages": HI, "system": "sys"})
    with_tools = client.post("/v1/messages/count_tokens", json={"messages": HI, "system": "sys",
                                                                "tools": tools})
    block = tools_text([{"type": "function", "function": {
        "name": "get_weather", "description": "weather",
        "parameters": tools[0]["input_schema"]}}])
    grown = with_tools.json()["input_tokens"] - base.json()["input_tokens"]
    assert grown == len(("\n\n" + block).encode())


def test_rendering_runs_off_the_event_loop(engine: FakeEngine, client: TestClient) -> None:
    """Templates, tokenization and the usage prediction's cache lookup run in the
    preparer's worker thread, never on the loop's thread."""
    import threading

    seen: list[str] = []
    render, lookup = engine.render_chat_with_offsets, engine.cache.lookup  # type: ignore[union-attr]

    def spy_render(*a: Any, **kw: Any) -> Any:
        seen.append(threading.current_thread().name)
        return render(*a, **kw)

    def spy_lookup(*a: Any, **kw: Any) -> Any:
        seen.append(threading.current_thread().name)
        return lookup(*a, **kw)

    engine.render_chat_with_offsets = spy_render  # type: ignore[method-assign]
    engine.cache.lookup = spy_lookup  # type: ignore[union-attr, method-assign]
    client.post("/v1/messages", json={"max_tokens": 5, "messages": HI, "stream": True})
    client.post("/v1/chat/completions", json={"messages": HI})
    client.post("/v1/responses", json={"input": "hi"})
    client.post("/v1/messages/count_tokens", json={"messages": HI})
    assert len(seen) >= 5
    assert all(name.startswith("promptcache-prep") for name in seen), seen


def test_official_sdks_read_the_context_window(client: TestClient) -> None:
    import anthropic

    sdk = anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=client,
                              max_retries=0)
    page = sdk.models.list()
    assert [m.id for m in page.data] == ["fake-model"]


def test_chat_reasoning_content() -> None:
    eng = FakeEngine(think=True, reply="<think>Hmm.</think>Yes.")
    client = _app(eng)
    msg = client.post("/v1/chat/completions", json={"messages": HI}).json()["choices"][0][
        "message"]
    assert (msg["reasoning_content"], msg["content"]) == ("Hmm.", "Yes.")
    got = sse_checks.chat_stream(client.post("/v1/chat/completions", json={
        "messages": HI, "stream": True}).text)
    assert (got["reasoning"], got["content"]) == ("Hmm.", "Yes.")
    client.post("/v1/chat/completions", json={"messages": HI, "reasoning_effort": "high"})
    assert eng.template_kwargs[-1] == {"enable_thinking": True}


def test_request_log_leaves_secrets_out(tmp_path: Any) -> None:
    eng = FakeEngine()
    client = TestClient(create_app(eng, ServerConfig(log_requests_dir=tmp_path,
                                                     api_key="sekrit")))
    r = client.post("/v1/messages?beta=true", json={"max_tokens": 5, "messages": HI},
                    headers={"x-api-key": "sekrit", "X-Claude-Code-Session-Id": "s9",
                             "Authorization": "Bearer sekrit"})
    assert r.status_code == 200
    client.post("/v1/chat/completions", json={"messages": HI})  # 401: recorded too
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["000001-messages.json", "000002-chat.json"]
    rec = json.loads((tmp_path / files[0]).read_text())
    assert (rec["method"], rec["path"], rec["query"], rec["status"]) == \
        ("POST", "/v1/messages", "beta=true", 200)
    assert rec["body"] == {"max_tokens": 5, "messages": HI}
    assert rec["headers"]["x-claude-code-session-id"] == "s9"
    assert "sekrit" not in (tmp_path / files[0]).read_text()
    assert json.loads((tmp_path / files[1]).read_text())["status"] == 401


def test_documented_defaults() -> None:
    cfg = ServerConfig()
    assert (cfg.keepalive_s, cfg.responses_store_size, cfg.max_tokens_overflow,
            cfg.context_window) == (10.0, 256, "clamp", None)
    assert EngineConfig().default_max_tokens == 512


def test_count_tokens_with_odd_extras(client: TestClient) -> None:
    r = client.post("/v1/messages/count_tokens", json={"messages": HI, "tool_choice": "auto"})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]
    r = client.post("/v1/messages/count_tokens", json={"messages": HI,
                                                       "tool_choice": {"type": "none"}})
    assert r.status_code == 200
