"""Tool calls in the model's output and stop-sequence reporting (fake engine, exact shapes).

The parser (server/replies/toolcalls.py) is tested directly, then both APIs end to end, streaming
and not, with the official SDKs parsing the responses where it is convenient.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import sse_events

from promptcache.server.replies.toolcalls import (
    ParsedReply,
    ToolCall,
    ToolCallStream,
    offered_tool_names,
    parse_tool_calls,
)

NAMES = frozenset({"get_weather", "read_file"})
WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
READ = '{"name": "read_file", "arguments": {"path": "a.py"}}'
W_CALL = ToolCall("get_weather", {"city": "Paris"})
R_CALL = ToolCall("read_file", {"path": "a.py"})

OAI_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
ANT_TOOLS = [{"name": "get_weather", "description": "weather of a city",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
HI = [{"role": "user", "content": "weather in Paris?"}]
TAGGED = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>"


# --- the parser ------------------------------------------------------------------------


def test_offered_tool_names() -> None:
    assert offered_tool_names(None) == frozenset()
    assert offered_tool_names(OAI_TOOLS + [{"type": "function"}]) == {"get_weather"}


def test_hermes_blocks() -> None:
    assert parse_tool_calls(f"<tool_call>\n{WEATHER}\n</tool_call>", NAMES) == \
        ParsedReply("", (W_CALL,))
    two = f"Let me check.\n\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{READ}</tool_call>\n"
    assert parse_tool_calls(two, NAMES) == ParsedReply("Let me check.", (W_CALL, R_CALL))
    # text after the calls is kept, joined with a blank line
    after = f"A <tool_call>{WEATHER}</tool_call> done. "
    assert parse_tool_calls(after, NAMES) == ParsedReply("A\n\ndone.", (W_CALL,))
    # arguments as a JSON string, "parameters", or no arguments at all
    alt = ('<tool_call>{"name": "read_file", "arguments": "{\\"path\\": \\"a.py\\"}"}</tool_call>'
           '<tool_call>{"name": "get_weather", "parameters": {"city": "Paris"}}</tool_call>'
           '<tool_call>{"name": "get_weather"}</tool_call>')
    assert parse_tool_calls(alt, NAMES) == ParsedReply(
        "", (R_CALL, W_CALL, ToolCall("get_weather", {})))
    # generation stopped at the closing tag: complete JSON still counts, a cut one not
    assert parse_tool_calls(f"<tool_call>{WEATHER}", NAMES) == ParsedReply("", (W_CALL,))
    cut = '<tool_call>{"name": "get_weather", "argum'
    assert parse_tool_calls(cut, NAMES) == ParsedReply(cut)


def test_bad_calls_stay_text() -> None:
    for reply in [
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # bad JSON
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": "get_weather", "arguments": [1]}</tool_call>',  # not an object
        '<tool_call>{"name": "get_weather", "arguments": "{oops"}</tool_call>',
        '<tool_call>["get_weather"]</tool_call>',
        '  x <tool_call>{"name": 3}</tool_call>',
    ]:
        assert parse_tool_calls(reply, NAMES) == ParsedReply(reply), reply
    # one good block, one bad: the good one is a call, the bad one stays in the text
    mixed = f'<tool_call>{{"name": "nope"}}</tool_call>\n<tool_call>{WEATHER}</tool_call>'
    assert parse_tool_calls(mixed, NAMES) == \
        ParsedReply('<tool_call>{"name": "nope"}</tool_call>', (W_CALL,))
    # without offered tools nothing is ever parsed
    assert parse_tool_calls(TAGGED, frozenset()) == ParsedReply(TAGGED)
    assert parse_tool_calls(WEATHER, ()) == ParsedReply(WEATHER)


def test_bare_json() -> None:
    assert parse_tool_calls(f"\n {WEATHER}\n", NAMES) == ParsedReply("", (W_CALL,))
    llama = '{"name": "read_file", "parameters": {"path": "a.py"}}'
    assert parse_tool_calls(llama, NAMES) == ParsedReply("", (R_CALL,))
    assert parse_tool_calls(f"[{WEATHER}, {READ}]", NAMES) == ParsedReply("", (W_CALL, R_CALL))
    for reply in ['{"name": "rm_rf", "arguments": {}}', '{"city": "Paris"}', "[]",
                  f"[{WEATHER}, 1]", f"{WEATHER} and more", "{not json"]:
        assert parse_tool_calls(reply, NAMES) == ParsedReply(reply), reply
    # JSON that is not the whole reply is text
    assert parse_tool_calls(f"Call: {WEATHER}", NAMES) == ParsedReply(f"Call: {WEATHER}")


def test_stream_sends_text_before_the_tag_at_once() -> None:
    s = ToolCallStream(NAMES)
    assert s.feed("Let me") == "Let me"
    assert s.feed(" check. ") == " check."  # trailing whitespace waits
    assert s.feed("<tool") == ""  # could be the tag
    assert s.feed("_call>{\"name\": ") == ""
    assert s.feed('"get_weather", "arguments": {"city": "Paris"}}</tool_call>') == ""
    assert s.finish() == ("", (W_CALL,))
    assert s.text == "Let me check."
    with pytest.raises(RuntimeError):
        s.finish()
    s = ToolCallStream(NAMES)
    assert [s.feed(d) for d in ["a <", "b", " <tool_c", "x"]] == ["a", " <b", "", " <tool_cx"]
    assert s.finish() == ("", ())
    # no tools: a pass-through
    s = ToolCallStream(())
    assert s.feed(" <tool_call>") == " <tool_call>" and s.finish() == ("", ())


REPLIES = [
    TAGGED, f"A <tool_call>{WEATHER}</tool_call> done. ", f"\n {WEATHER}\n", "plain text  \n",
    '<tool_call>{"name": "rm_rf"}</tool_call> tail', f"[{WEATHER}, {READ}]", "{not json",
    f'<tool_call>{{"name": "nope"}}</tool_call>\n<tool_call>{WEATHER}</tool_call>', "",
    "x <tool_call", "   ",
]


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 120), max_size=8))
def test_stream_matches_whole_parse(reply: str, cuts: list[int]) -> None:
    """However a reply is split into deltas, the streamed text + calls equal the parse."""
    points = sorted({min(c, len(reply)) for c in cuts} | {0, len(reply)})
    s = ToolCallStream(NAMES)
    out = "".join(s.feed(reply[a:b]) for a, b in zip(points, points[1:], strict=False))
    tail, calls = s.finish()
    assert ParsedReply(out + tail, calls) == parse_tool_calls(reply, NAMES)


# --- OpenAI ------------------------------------------------------------------------------


@pytest.fixture
def oai(client: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client)


@pytest.fixture
def ant(client: TestClient) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=client)


def test_openai_tool_calls(client: TestClient, engine: FakeEngine, oai: openai.OpenAI) -> None:
    engine.reply = TAGGED
    body = client.post("/v1/chat/completions", json={
        "messages": HI, "tools": OAI_TOOLS, "max_tokens": 200}).json()
    choice = body["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me check."
    assert len(calls) == 1 and calls[0]["id"].startswith("call_") and len(calls[0]["id"]) == 29
    assert calls[0] == {"id": calls[0]["id"], "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris"}'}}
    assert body["usage"]["completion_tokens"] == len(TAGGED)
    # the SDK's view; content null when there is no text
    engine.reply = f"<tool_call>{WEATHER}</tool_call>\n<tool_call>{WEATHER}</tool_call>"
    r = oai.chat.completions.create(model="default", messages=HI, tools=OAI_TOOLS,
                                    max_tokens=200)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []] \
        == [("get_weather", {"city": "Paris"})] * 2
    ids = [c.id for c in msg.tool_calls or []]
    assert len(set(ids)) == 2


def _chunks(text: str) -> list[dict[str, Any]]:
    events = sse_events(text)
    assert events[-1] == (None, "[DONE]")
    return [d for _, d in events[:-1]]


def test_openai_streaming_tool_calls(client: TestClient, engine: FakeEngine,
                                     oai: openai.OpenAI) -> None:
    engine.reply = TAGGED
    r = client.post("/v1/chat/completions", json={
        "messages": HI, "tools": OAI_TOOLS, "max_tokens": 200, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = _chunks(r.text)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    assert text == "Let me check."
    tc = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    call_id = tc[0][0]["id"]
    assert call_id.startswith("call_")
    assert tc == [[{"index": 0, "id": call_id, "type": "function",
                    "function": {"name": "get_weather", "arguments": ""}}],
                  [{"index": 0, "function": {"arguments": '{"city": "Paris"}'}}]]
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finals if f] == ["tool_calls"] and finals[-1] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == len(TAGGED)
    # the SDK accumulates the deltas into the same message
    with oai.chat.completions.stream(model="default", messages=HI,
                                     tools=OAI_TOOLS, max_tokens=200) as stream:
        final = stream.get_final_completion()
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and msg.content == "Let me check."
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] == \
        [("get_weather", '{"city": "Paris"}')]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reply,tools,extra", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', OAI_TOOLS, {}),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', OAI_TOOLS, {}),
    (TAGGED, None, {}),
    (TAGGED, OAI_TOOLS, {"tool_choice": "none"}),
])
def test_openai_non_calls_stay_text(client: TestClient, engine: FakeEngine, reply: str,
                                    tools: Any, extra: dict[str, Any], stream: bool) -> None:
    engine.reply = reply
    req = {"messages": HI, "max_tokens": 200, "stream": stream, **extra}
    if tools is not None:
        req["tools"] = tools
    r = client.post("/v1/chat/completions", json=req)
    assert r.status_code == 200
    if stream:
        chunks = _chunks(r.text)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas) == reply
        assert not any("tool_calls" in d for d in deltas)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        choice = r.json()["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": reply}
        assert choice["finish_reason"] == "stop"


def test_openai_stop_sequence(client: TestClient, engine: FakeEngine) -> None:
    body = client.post("/v1/chat/completions", json={
        "messages": HI, "max_tokens": 50, "stop": ["world", "Hello!"]}).json()
    assert body["choices"][0]["message"]["content"] == "Hello "
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == len("Hello world")
    assert engine.submitted[-1].sampling.stop == ("world", "Hello!")


# --- Anthropic ---------------------------------------------------------------------------


def test_anthropic_tool_use(client: TestClient, engine: FakeEngine,
                            ant: anthropic.Anthropic) -> None:
    engine.reply = TAGGED
    body = client.post("/v1/messages", json={"messages": HI, "tools": ANT_TOOLS,
                                             "max_tokens": 200}).json()
    content = body["content"]
    tool_id = content[1]["id"]
    assert tool_id.startswith("toolu_") and len(tool_id) == 30
    assert content == [{"type": "text", "text": "Let me check."},
                       {"type": "tool_use", "id": tool_id, "name": "get_weather",
                        "input": {"city": "Paris"}}]
    assert body["stop_reason"] == "tool_use" and body["stop_sequence"] is None
    assert body["usage"]["output_tokens"] == len(TAGGED)
    # the template saw the tools in the OpenAI function format
    assert engine.rendered[-1][1][0]["function"]["name"] == "get_weather"
    # the SDK's view; no text block when the reply is only calls
    engine.reply = f"<tool_call>{WEATHER}</tool_call>"
    msg = ant.messages.create(model="default", messages=HI, tools=ANT_TOOLS,
                              max_tokens=200)
    assert msg.stop_reason == "tool_use" and len(msg.content) == 1
    block = msg.content[0]
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.input == {"city": "Paris"}


def test_anthropic_streaming_tool_use(client: TestClient, engine: FakeEngine,
                                      ant: anthropic.Anthropic) -> None:
    engine.reply = f"Let me check. <tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}"
    r = client.post("/v1/messages", json={"messages": HI, "tools": ANT_TOOLS,
                                          "max_tokens": 200, "stream": True})
    events = sse_events(r.text)
    names = [n for n, _ in events]
    # the fake engine emits a byte per token: text streams at once, a space waits for
    # the next word (whitespace before a call is dropped)
    text_deltas = ["L", "e", "t", " m", "e", " c", "h", "e", "c", "k", "."]
    assert names == ["message_start", "ping", "content_block_start"] + \
        ["content_block_delta"] * len(text_deltas) + ["content_block_stop"] + \
        ["content_block_start", "content_block_delta", "content_block_stop"] * 2 + \
        ["message_delta", "message_stop"]
    data = [d for _, d in events]
    assert [d["delta"]["text"] for d in data[3:3 + len(text_deltas)]] == text_deltas
    starts = [d for d in data if d["type"] == "content_block_start"]
    assert starts[0] == {"type": "content_block_start", "index": 0,
                         "content_block": {"type": "text", "text": ""}}
    ids = [s["content_block"]["id"] for s in starts[1:]]
    assert starts[1:] == [{"type": "content_block_start", "index": i + 1, "content_block": {
        "type": "tool_use", "id": ids[i], "name": "get_weather", "input": {}}} for i in range(2)]
    assert len(set(ids)) == 2 and all(i.startswith("toolu_") for i in ids)
    json_deltas = [d for d in data if d["type"] == "content_block_delta"
                   and d["delta"]["type"] == "input_json_delta"]
    assert json_deltas == [{"type": "content_block_delta", "index": i + 1, "delta": {
        "type": "input_json_delta", "partial_json": '{"city": "Paris"}'}} for i in range(2)]
    assert [d["index"] for d in data if d["type"] == "content_block_stop"] == [0, 1, 2]
    assert data[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    # the SDK rebuilds the tool inputs from the partial JSON
    engine.reply = f"<tool_call>{WEATHER}</tool_call>"
    with ant.messages.stream(model="default", messages=HI, tools=ANT_TOOLS,
                             max_tokens=200) as stream:
        msg = stream.get_final_message()
    assert msg.stop_reason == "tool_use" and len(msg.content) == 1
    assert msg.content[0].type == "tool_use" and msg.content[0].input == {"city": "Paris"}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reply,tools,extra", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>', ANT_TOOLS, {}),
    ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', ANT_TOOLS, {}),
    (TAGGED, None, {}),
    (TAGGED, ANT_TOOLS, {"tool_choice": {"type": "none"}}),
])
def test_anthropic_non_calls_stay_text(client: TestClient, engine: FakeEngine, reply: str,
                                       tools: Any, extra: dict[str, Any], stream: bool) -> None:
    engine.reply = reply
    req = {"messages": HI, "max_tokens": 200, "stream": stream, **extra}
    if tools is not None:
        req["tools"] = tools
    r = client.post("/v1/messages", json=req)
    assert r.status_code == 200
    if stream:
        data = [d for _, d in sse_events(r.text)]
        blocks = [d["content_block"] for d in data if d["type"] == "content_block_start"]
        assert blocks == [{"type": "text", "text": ""}]
        assert "".join(d["delta"]["text"] for d in data
                       if d["type"] == "content_block_delta") == reply
        assert data[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    else:
        body = r.json()
        assert body["content"] == [{"type": "text", "text": reply}]
        assert body["stop_reason"] == "end_turn"


def test_anthropic_empty_reply_with_tools(client: TestClient, engine: FakeEngine) -> None:
    engine.reply = ""
    req = {"messages": HI, "max_tokens": 20, "tools": ANT_TOOLS}
    assert client.post("/v1/messages", json=req).json()["content"] == \
        [{"type": "text", "text": ""}]
    data = [d for _, d in sse_events(client.post("/v1/messages",
                                                 json={**req, "stream": True}).text)]
    assert [d["type"] for d in data] == ["message_start", "ping", "content_block_start",
                                         "content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_stop_sequence(client: TestClient, stream: bool,
                                 ant: anthropic.Anthropic) -> None:
    req = {"messages": HI, "max_tokens": 50, "stop_sequences": ["world", "Hello!"],
           "stream": stream}
    r = client.post("/v1/messages", json=req)
    if stream:
        data = [d for _, d in sse_events(r.text)]
        assert "".join(d["delta"]["text"] for d in data
                       if d["type"] == "content_block_delta") == "Hello "
        assert data[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "world"}
        assert data[-2]["usage"]["output_tokens"] == len("Hello world")
    else:
        body = r.json()
        assert body["content"] == [{"type": "text", "text": "Hello "}]
        assert (body["stop_reason"], body["stop_sequence"]) == ("stop_sequence", "world")
        assert body["usage"]["output_tokens"] == len("Hello world")
    # not matched -> end_turn; cut by max_tokens before the stop string -> max_tokens
    body = client.post("/v1/messages", json={**req, "stream": False,
                                             "stop_sequences": ["zzz"]}).json()
    assert (body["stop_reason"], body["stop_sequence"]) == ("end_turn", None)
    body = client.post("/v1/messages", json={**req, "stream": False, "max_tokens": 8}).json()
    assert (body["stop_reason"], body["stop_sequence"]) == ("max_tokens", None)
    assert body["content"] == [{"type": "text", "text": "Hello wo"}]
    msg = ant.messages.create(model="default", messages=HI, max_tokens=50,
                              stop_sequences=["world"])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "world")
