"""gpt-oss's harmony format (server/replies/harmony.py): analysis is reasoning and never
content, final is the answer, ``to=functions.NAME`` is a tool call; streamed byte by
byte and whole the same; through chat, Messages and Responses, streamed and not, with
a 200-line file as a call argument."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from sse_checks import anthropic_stream, chat_stream, responses_stream

from promptcache.engine.formats.chat_format import ChatFormat, ToolCall
from promptcache.server import create_app
from promptcache.server.replies.harmony import HarmonyParser
from promptcache.server.replies.reasoning import parse_reply
from promptcache.serving_config import EngineConfig, ServerConfig

WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"},
                                     "content": {"type": "string"}}}}}
FILE = "\n".join(f'def f_{i}(x):\n    return {{"to=functions.x": "{i}"}}  # quotes, braces' if i == 3
                 else f"line {i}: value = compute({i})" for i in range(200)) + "\n"
ARGS = {"path": "src/app.py", "content": FILE}
ANALYSIS = "<|channel|>analysis<|message|>The user wants the file written. I will call it.<|end|>"
CALL = ("<|start|>assistant<|channel|>commentary to=functions.write_file <|constrain|>json"
        "<|message|>" + json.dumps(ARGS) + "<|call|>")
ANSWER = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Done: it is written.<|return|>"


def parse(text: str, names: tuple[str, ...] = ("write_file",), stream: bool = False
          ) -> tuple[str, str, tuple[ToolCall, ...]]:
    p = HarmonyParser(tool_names=names, tools=[WRITE])
    if stream:
        for ch in text:
            p.feed(ch)
        _, calls = p.finish()
        return p.reasoning, p.text, calls
    r = parse_reply(text, p)
    return r.reasoning, r.text, r.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_channels(stream: bool) -> None:
    assert parse(ANSWER, stream=stream) == (
        "The user wants the file written. I will call it.", "Done: it is written.", ())
    assert parse(ANALYSIS + CALL, stream=stream) == (
        "The user wants the file written. I will call it.", "",
        (ToolCall("write_file", ARGS),))
    # the recipient in the role part, no <|start|> before the first header, no end marker
    alt = ("<|channel|>analysis<|message|>think<|end|><|start|>assistant to=functions.write_file"
           "<|channel|>commentary json<|message|>{\"path\": \"a\"}")
    assert parse(alt, stream=stream) == ("think", "", (ToolCall("write_file", {"path": "a"}),))
    # a final message without its end marker (the engine stopped on <|return|>)
    assert parse("<|channel|>final<|message|>Hi there", stream=stream) == ("", "Hi there", ())


@pytest.mark.parametrize("stream", [False, True])
def test_what_is_not_a_call_stays_text(stream: bool) -> None:
    unknown = "<|channel|>commentary to=functions.rm_rf <|constrain|>json<|message|>{}<|call|>"
    assert parse(unknown, stream=stream) == ("", "{}", ())
    broken = "<|channel|>commentary to=functions.write_file<|message|>{\"path\": <|call|>"
    assert parse(broken, stream=stream) == ("", "{\"path\": ", ())
    preamble = "<|channel|>commentary<|message|>Let me check.<|end|>"
    assert parse(preamble, stream=stream) == ("", "Let me check.", ())
    assert parse("Plain text, no harmony.", stream=stream) == ("", "Plain text, no harmony.", ())
    assert parse(ANALYSIS + CALL, names=(), stream=stream)[2] == ()


def test_text_streams_before_the_reply_ends() -> None:
    p = HarmonyParser()
    pieces = p.feed("<|channel|>final<|message|>Hello wor")
    assert [(x.kind, x.text) for x in pieces] == [("text", "Hello wor")]
    assert [(x.kind, x.text) for x in p.feed("ld<|en")] == [("text", "ld")]  # holds "<|en"
    assert p.text == "Hello world"
    rest, _ = p.finish()
    assert [(x.kind, x.text) for x in rest] == [("text", "<|en")] and p.text == "Hello world<|en"


def engine_with(reply: str) -> FakeEngine:
    eng = FakeEngine(reply=reply, context_length=65_536)
    eng.chat_format = ChatFormat(harmony=True)
    eng.config = EngineConfig(max_tokens_limit=20_000, default_max_tokens=20_000)
    return eng


@pytest.fixture
def call_client() -> TestClient:
    return TestClient(create_app(engine_with(ANALYSIS + CALL), ServerConfig(prerender=False)))


CHAT: dict[str, Any] = {"model": "default", "max_tokens": 20_000, "tools": [WRITE],
                        "messages": [{"role": "user", "content": "Write src/app.py"}]}
MSG: dict[str, Any] = {"model": "default", "max_tokens": 20_000,
                       "tools": [{"name": "write_file",
                                  "input_schema": WRITE["function"]["parameters"]}],
                       "messages": [{"role": "user", "content": "Write src/app.py"}]}
RESP: dict[str, Any] = {"model": "default", "max_output_tokens": 20_000,
                        "tools": [{"type": "function", "name": "write_file",
                                   "parameters": WRITE["function"]["parameters"]}],
                        "input": "Write src/app.py"}


@pytest.mark.parametrize("stream", [False, True])
def test_chat_round_trip(call_client: TestClient, stream: bool) -> None:
    r = call_client.post("/v1/chat/completions", json={**CHAT, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        got = chat_stream(r.text)
        calls = [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]]
        content, reasoning, finish = got["content"], got["reasoning"], got["finish_reason"]
    else:
        msg = r.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                 for c in msg["tool_calls"]]
        content, reasoning = msg["content"], msg.get("reasoning_content")
        finish = r.json()["choices"][0]["finish_reason"]
    assert calls == [("write_file", ARGS)]
    assert not content and finish == "tool_calls"
    assert reasoning == "The user wants the file written. I will call it."


@pytest.mark.parametrize("stream", [False, True])
def test_messages_round_trip(call_client: TestClient, stream: bool) -> None:
    r = call_client.post("/v1/messages", json={**MSG, "stream": stream})
    assert r.status_code == 200, r.text
    blocks = anthropic_stream(r.text)["content"] if stream else r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert blocks[0]["thinking"] == "The user wants the file written. I will call it."
    assert blocks[1]["name"] == "write_file" and blocks[1]["input"] == ARGS


@pytest.mark.parametrize("stream", [False, True])
def test_responses_round_trip(call_client: TestClient, stream: bool) -> None:
    r = call_client.post("/v1/responses", json={**RESP, "stream": stream})
    assert r.status_code == 200, r.text
    out = responses_stream(r.text)["output"] if stream else r.json()["output"]
    assert [o["type"] for o in out] == ["reasoning", "function_call"]
    assert out[1]["name"] == "write_file" and json.loads(out[1]["arguments"]) == ARGS
    assert "analysis" not in json.dumps(out)


def test_a_final_answer_never_carries_the_reasoning() -> None:
    c = TestClient(create_app(engine_with(ANSWER), ServerConfig(prerender=False)))
    msg = c.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
    assert msg["content"] == "Done: it is written."
    assert msg["reasoning_content"] == "The user wants the file written. I will call it."
    blocks = c.post("/v1/messages", json=MSG).json()["content"]
    assert [(b["type"], b.get("text")) for b in blocks][1] == ("text", "Done: it is written.")


def test_harmony_is_recognised_from_the_template() -> None:
    from promptcache.engine.formats.chat_format import chat_format_of

    class Tok:
        chat_template = ("{{- '<|start|>assistant<|channel|>final<|message|>' }}"
                         "{{- message.content }}{{- '<|end|>' }}")

    class Plain:
        chat_template = "{{ message.content }}<|im_end|>"

    assert chat_format_of(Tok()).harmony and not chat_format_of(Plain()).harmony
