"""GLM-4.7 (``<arg_key>`` / ``<arg_value>``) and Kimi-K2 (``<|tool_calls_section_begin|>``)
tool calls, parsed by mlx-lm's parsers, through chat, Messages and Responses, streamed
and whole: a 200-line file as a GLM argument, nested JSON as a Kimi argument."""

from __future__ import annotations

import json
from typing import Any

import pytest
import sse_checks
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers import assert_streamed_equals_whole
from test_server_structured import HI, _app

from promptcache.engine.chat_format import ChatFormat, tool_call_format

WRITE = {"type": "function", "function": {"name": "write_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"},
                                     "content": {"type": "string"},
                                     "options": {"type": "object"}}}}}
OAI_TOOLS = [WRITE]
ANT_TOOLS = [{"name": "write_file", "input_schema": WRITE["function"]["parameters"]}]
RESP_TOOLS = [{"type": "function", **WRITE["function"]}]
FILE = "\n".join(f"x{i} = f({i})" for i in range(200)) + "\n"  # 200 lines
OPTIONS = {"mode": "w", "backup": {"keep": 3, "dirs": ["a", "b"]}, "force": True}

GLM = ("Writing it.<tool_call>write_file<arg_key>path</arg_key><arg_value>src/app.py"
       f"</arg_value><arg_key>content</arg_key><arg_value>{FILE}</arg_value>"
       "</tool_call>")
KIMI = ("Writing it.<|tool_calls_section_begin|><|tool_call_begin|>functions.write_file:0"
        "<|tool_call_argument_begin|>"
        + json.dumps({"path": "src/app.py", "options": OPTIONS})
        + "<|tool_call_end|><|tool_calls_section_end|>")
WANT = {"glm47": ("write_file", {"path": "src/app.py", "content": FILE}),
        "kimi_k2": ("write_file", {"path": "src/app.py", "options": OPTIONS})}
REPLIES = {"glm47": GLM, "kimi_k2": KIMI}


def engine(fmt: str) -> Any:
    from fake_engine import FakeEngine

    eng = FakeEngine(reply=REPLIES[fmt], context_length=65_536)
    eng.chat_format = ChatFormat(tool_format=tool_call_format(fmt))
    return eng


@pytest.mark.parametrize("fmt", sorted(REPLIES))
@pytest.mark.parametrize("stream", [False, True])
def test_every_api(fmt: str, stream: bool) -> None:
    client = _app(engine(fmt))
    want = WANT[fmt]
    r = client.post("/v1/chat/completions", json={"messages": HI, "tools": OAI_TOOLS,
                                                  "max_tokens": 4000, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        got = sse_checks.chat_stream(r.text)
        [call] = got["tool_calls"]
        assert (call["name"], json.loads(call["arguments"])) == want
        assert got["content"] == "Writing it."
    else:
        msg = r.json()["choices"][0]["message"]
        [tc] = msg["tool_calls"]
        assert (tc["function"]["name"], json.loads(tc["function"]["arguments"])) == want
        assert msg["content"] == "Writing it."
    r = client.post("/v1/messages", json={"messages": HI, "tools": ANT_TOOLS,
                                          "max_tokens": 4000, "stream": stream})
    blocks = (sse_checks.anthropic_stream(r.text) if stream else r.json())["content"]
    assert blocks[0] == {"type": "text", "text": "Writing it."}
    assert [(b["name"], b["input"]) for b in blocks[1:]] == [want]
    r = client.post("/v1/responses", json={"input": "write it", "tools": RESP_TOOLS,
                                           "max_output_tokens": 4000, "stream": stream})
    final = sse_checks.responses_stream(r.text) if stream else r.json()
    message, call = final["output"]
    assert message["content"][0]["text"] == "Writing it."
    assert (call["name"], json.loads(call["arguments"])) == want


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(REPLIES)), st.lists(st.integers(0, 9000), max_size=8))
def test_streamed_and_whole_agree(fmt: str, cuts: list[int]) -> None:
    assert_streamed_equals_whole(REPLIES[fmt], cuts, {"write_file"}, tool_call_format(fmt),
                                 OAI_TOOLS)
